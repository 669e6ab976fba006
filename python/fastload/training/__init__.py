"""Training on a loaded model: gradient checkpointing as a runtime toggle on the model graph,
never stored in a saved config (``gradient_checkpointing``), and training readiness: the
parameters a forward leaves without gradient, which DDP needs to know of (``readiness``).

May import: :mod:`fastload.core` (its leaves: arguments, errors, keys) and
:mod:`fastload.families` (transformers models keep their own switch). The core never imports this
package: the entry of a load passes ``gradient_checkpointing_enable`` in as a step
(:mod:`fastload.core.plan.steps`) for ``gradient_checkpointing=True``.
"""
