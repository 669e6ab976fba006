"""Devices: checks of a requested device, ``device_map`` (which device each tensor goes to, planned
with accelerate where it is installed), and dispatch (inputs moved to each module's weights when a
model is spread over devices).

Owns: where tensors live. Must not know: files, the plan's modes or how bytes are read.
"""
