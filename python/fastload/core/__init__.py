"""The core loader: checkpoint files into any ``nn.Module``, in the order of a load.

options (``load_options``, ``arguments``, ``devices``, ``dtypes``, ``units``, ``threads``) ->
the checkpoint (``checkpoint``, ``source``, ``pickle_file``, ``json_text``; ``object_store``:
checkpoints at ``s3://``, ``gs://``, ``az://``, ``http(s)://`` URLs, configured by
``store_config``) -> the plan
(``planning``, ``keys``, ``placement``, ``device_map``, ``hooks``: what a model family may add)
-> allocation (``allocation``, ``memory``: the budget) -> reading (``reading``, ``engine``: the one
door to the Rust copy, ``streaming``: pinned staging for accelerators, ``sharing``: views of the
mapping, ``paced``: read-ahead paced by the first forward, ``page_cache``, ``offload``: disk) ->
finishing (``finishing``, ``tying``, ``skeleton``) -> the report (``report``, ``progress``).
``loading`` is the pipeline, top to bottom; ``errors`` the one exception hierarchy.

May import: ``fastload._core``, its own modules, and the two packages whose steps a load runs:
:mod:`fastload.distributed` (collective reads, tensor-parallel slicing) and
:mod:`fastload.training` (the ``gradient_checkpointing`` option). Never a layer above (the model
family's layer, the integrations, the tools, the safetensors-compatible API or the public entry):
nothing here names a framework, a serving engine or a model family.
"""
