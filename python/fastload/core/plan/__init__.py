"""The plan of a load, made once: the options (``LoadOptions``), the model family's hooks and the
steps the entry passes in, each tensor's placement, its source bytes and mode (view, copy,
convert, slice, merge, offload, init, keep), whether the planned load fits the memory budget, and
the report derived from it.

Owns: every decision of a load. Must not know: how the bytes are read (the reads room executes
the plan) or who called the load.
"""
