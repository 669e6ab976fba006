"""The core loader: checkpoint files into any ``nn.Module``, in the order of a load.

options (``load_options``, ``arguments``, ``devices``, ``dtypes``, ``units``, ``threads``) ->
the checkpoint (``checkpoint``, ``source``, ``pickle_file``, ``json_text``; ``object_store``:
checkpoints at ``s3://``, ``gs://``, ``az://``, ``http(s)://`` URLs, configured by
``store_config``) -> the plan
(``planning``, ``keys``, ``placement``, ``device_map``, ``hooks``: what a model family may add,
``steps``: what the packages beside the core add)
-> allocation (``allocation``, ``memory``: the budget) -> reading (``reading``, ``engine``: the one
door to the Rust copy, ``streaming``: pinned staging for accelerators, ``sharing``: views of the
mapping, ``paced``: read-ahead paced by the first forward, ``page_cache``, ``offload``: disk) ->
finishing (``finishing``, ``tying``, ``skeleton``) -> the report (``report``, ``progress``).
``loading`` is the pipeline, top to bottom, one function per phase (``phases``: what every load
runs under); ``errors`` the one exception hierarchy.

One folder, its modules named in the order of a load (the architecture page says why it stays
flat). May import: ``fastload._core`` and its own modules, nothing else. The packages whose steps
a load runs plug in from above: :mod:`fastload.distributed` (collective reads, tensor-parallel
slicing) and :mod:`fastload.training` (the ``gradient_checkpointing`` option) through
:class:`~fastload.core.steps.LoadSteps`, a model family through its
:class:`~fastload.core.hooks.ModelHooks`; the entry of a load passes both in. Nothing here names a
framework, a serving engine or a model family.
"""
