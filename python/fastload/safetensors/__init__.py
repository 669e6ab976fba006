"""The safetensors-compatible API: ``safe_open``, ``load_file`` (``files``), lazy slices
(``slices``), bytes and modules (``serialize``: ``load``, ``save``, ``save_model``,
``load_model``), writing checkpoints (``saving``: ``save_file``, ``save_pretrained``), putting them
in place crash-safely (``publish``) and the save locks (``ownership``).

May import: :mod:`fastload.core`, :mod:`fastload.distributed` (``process_group=`` reads),
:mod:`fastload.training` (a saved config never carries gradient checkpointing) and
:mod:`fastload.families` (what a transformers model leaves out of a save). Not the Hugging Face
layer, the integrations or the tools. ``files`` imports ``slices``, never the reverse: a slice
reads through the small interface it declares (``slices.OpenFile``).
"""
