"""The core loader: checkpoint files into any ``nn.Module``, in the order of a load.

Its rooms, bottom up (each imports only the rooms before it; each ``__init__`` says what it owns
and what it must not know):

- ``basics``: errors, units, dtypes, argument checks, redaction, progress, the engine's door;
- ``checkpoint``: a checkpoint's files on disk, their headers, index, digests;
- ``store``: object storage URLs, and the choice of source (files, a store, a state dict);
- ``memory``: the budget, views or copies of the mapping, read-ahead, the pinned staging pool;
- ``model``: key mapping and its policies, tie groups, the skeleton on meta;
- ``devices``: device checks, ``device_map``, dispatch over devices;
- ``plan``: the options, the family's hooks and the entry's steps, each tensor's placement and
  mode, the memory check of the plan, the report;
- ``reads``: allocation, the read step (mapped, positioned, staged), disk offload.

On top, the spine: ``loading`` (the pipeline, one function per phase), ``phases`` (what every
load runs under) and ``finishing`` (putting the loaded tensors into the model, all or nothing).

May import: ``fastload._core`` and its own modules, nothing else. The packages whose steps a load
runs plug in from above: :mod:`fastload.distributed` (collective reads, tensor-parallel slicing),
:mod:`fastload.training` (the ``gradient_checkpointing`` option) and :mod:`fastload.reloading`
(the record a reload needs) through :class:`~fastload.core.plan.steps.LoadSteps`, a model family
through its :class:`~fastload.core.plan.hooks.ModelHooks`; the entry of a load passes both in.
Nothing here names a framework, a serving engine or a model family.
"""
