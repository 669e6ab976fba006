"""The words every room of the core speaks: the exception hierarchy, redaction of URLs, byte
units, dtypes, argument and thread checks, the progress bar and the one door to the Rust engine.

Owns: vocabulary with no opinion about checkpoints, plans or models. Must not know: any other room
of the core (every room imports this one; it imports none of them).
"""
