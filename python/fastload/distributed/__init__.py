"""Loads across ranks: collective reads, where each rank reads about 1/N of the checkpoint and
the ranks exchange the rest (``collective``), and fastload's own tensor-parallel slicing plans
(``tensor_parallel``). transformers' DTensor tensor parallelism is transformers-specific and lives
in :mod:`fastload.hf.dtensor_tp`.

May import: :mod:`fastload.core` (its leaves: checkpoint, dtypes, errors, the steps' interface).
The core never imports this package: the entry of a load passes ``steps.RANK_STEPS`` in, and the
core's pipeline runs them where a load needs them (:mod:`fastload.core.plan.steps`).
"""
