"""Training on a loaded model: gradient checkpointing as a runtime toggle on the model graph,
never stored in a saved config (``gradient_checkpointing``), and training readiness: the
parameters a forward leaves without gradient, which DDP needs to know of (``readiness``).

May import: the leaves of :mod:`fastload.core` (arguments, errors, keys, skeleton); the core's
pipeline applies the ``gradient_checkpointing=`` option through this package.
"""
