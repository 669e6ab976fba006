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
    for dtype, methods in _BY_DTYPE.items():
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
