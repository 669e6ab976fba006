"""Loads across ranks: collective reads, where each rank reads about 1/N of the checkpoint and
the ranks exchange the rest (``collective``), and fastload's own tensor-parallel slicing plans
(``tensor_parallel``). transformers' DTensor tensor parallelism is transformers-specific and lives
in :mod:`fastload.hf.dtensor_tp`.

May import: the leaves of :mod:`fastload.core` (checkpoint, dtypes, errors); the core's pipeline
runs these as steps of a load, so nothing here imports the pipeline back.
"""
