"""Where a checkpoint's bytes come from when they are not a local path: object storage URLs
(s3://, gs://, az://, http(s)://), their configuration, and the choice between files, a store and
a state dict (``source``).

Owns: resolving and opening remote checkpoints into the checkpoint room's vocabulary.
Must not know: models, plans, memory budgets or how the bytes are read into tensors.
"""
