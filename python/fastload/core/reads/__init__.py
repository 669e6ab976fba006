"""The reads: allocating the destinations the plan names, filling them from files or object
storage through the engine (the mapped or positioned path, the staged ring to a device), and disk
offload.

Owns: executing a plan's bytes. Must not know: the decisions themselves (it takes them from the
plan) or who called the load.
"""
