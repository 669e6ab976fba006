"""A checkpoint's files on a local disk: resolving a path or index to its files, opening them
(headers validated by the engine), pickle files, the per-tensor digests in a file's metadata, and
small files written crash-safely.

Owns: which files a checkpoint is and what they hold. Must not know: object storage (the store
room resolves URLs into the same vocabulary), models, plans or memory.
"""
