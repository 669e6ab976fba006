"""fastload as a vLLM load format: ``vllm serve MODEL --load-format fastload``.

vLLM loads every installed package's ``vllm.general_plugins`` entry points in each process it
starts (API server, engine core, workers); fastload's package metadata names :func:`register`
there, so with fastload installed beside vLLM the load format exists with no code from the user::

    vllm serve MODEL --load-format fastload
    vllm serve MODEL --load-format fastload --model-loader-extra-config '{"threads": 8}'
    LLM(model=MODEL, load_format="fastload")

Nothing here is imported by ``import fastload``; importing this package does not import vLLM
either (only :func:`register` does, when vLLM calls it). The loader:
:class:`fastload.integrations.vllm.loader.FastloadModelLoader`; its options:
:mod:`fastload.integrations.vllm.options`.
"""

from __future__ import annotations

_registered = False


def register() -> None:
    """Registers the ``fastload`` load format with vLLM (its ``vllm.general_plugins`` hook; vLLM
    may call it more than once per process)."""
    global _registered
    if _registered:
        return
    from vllm.model_executor.model_loader import register_model_loader

    from .loader import FastloadModelLoader
    from .options import LOAD_FORMAT

    register_model_loader(LOAD_FORMAT)(FastloadModelLoader)
    _registered = True


__all__ = ["register"]
