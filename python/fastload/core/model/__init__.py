"""The model's side: mapping checkpoint names to the model's (and the missing/unexpected
policies), tie groups, and the skeleton built on the meta device.

Owns: names and identities of a module's tensors. Must not know: files, devices, plans or reads.
"""
