"""Serving frameworks that load through fastload (vLLM, SGLang).

Each integration is imported only by its framework (vLLM: the ``vllm.general_plugins`` entry point
in fastload's package metadata), never by ``import fastload``: fastload does not depend on any of
them, and users bring the build of the framework that fits their hardware.
"""
