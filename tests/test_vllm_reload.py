"""Reloading a running vLLM engine (``--load-format fastload``) with
``collective_rpc("reload_weights", kwargs={"weights_path": ...})``, as users run it: offline
(``LLM(...)`` in a fresh process) and through ``vllm serve`` between two requests. The tokens after
a reload must be those of a fresh engine on the new checkpoint; a checkpoint that does not fit is
refused with the old weights serving; a failure part way names the layers holding new weights and
the engine refuses to generate until a reload succeeds.

The checkpoints are tiny random-weight Llamas (tests/vllm_models.py) rewritten with fastload
digests; helpers come from tests/test_vllm.py. These tests run in the vLLM environment
(``bash scripts/vllm-tests.sh``); elsewhere they skip.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from test_vllm import (
    ENGINE,
    MAX_TOKENS,
    PROMPTS,
    TIMEOUT,
    _env,
    _Run,
    _tokens,
    pytestmark,  # noqa: F401  (skips the module without vLLM)
)

#: one engine, reloaded step by step: the step's JSON on stdin, a line back for each; the
#: engine's own weight iterators replaced by ones that say they were called
_DRIVER = """
import json, sys

def main():
    import vllm.model_executor.model_loader.default_loader as default_loader
    from vllm import LLM, SamplingParams

    def own(*args, **kwargs):
        print("OWN-ITERATOR-CALLED", flush=True)
        raise RuntimeError("vLLM's own weight iterator was called")

    for name in dir(default_loader):
        if name.endswith("_weights_iterator"):
            setattr(default_loader, name, own)
    llm = LLM(model=sys.argv[2], **json.loads(sys.argv[1]))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    print("LOADED", flush=True)
    for line in sys.stdin:
        step = json.loads(line)
        try:
            if step["do"] == "generate":
                out = llm.generate(PROMPTS, params, use_tqdm=False)
                print("RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in out]), flush=True)
            else:
                llm.collective_rpc("reload_weights", kwargs=step.get("kwargs") or {})
                print("RELOADED", flush=True)
        except Exception as e:
            print("ERROR " + json.dumps([type(e).__name__, str(e)]), flush=True)
    print("DONE", flush=True)

if __name__ == "__main__":
    main()
""".replace("MAX_TOKENS", str(MAX_TOKENS)).replace("PROMPTS", repr(PROMPTS))


class Engine:
    """One offline engine in a fresh process (``LLM(model, **kwargs)``), driven step by step."""

    def __init__(self, model: Path, env: dict[str, str] | None = None, **kwargs: object) -> None:
        script = Path(tempfile.mkdtemp()) / "driver.py"
        script.write_text(_DRIVER)
        argv = [sys.executable, str(script), json.dumps({**ENGINE, **kwargs}), str(model)]
        self.run = _Run(argv, env or _env(VLLM_ENABLE_V1_MULTIPROCESSING="0"), merge_stderr=True)
        assert self.run.until("LOADED") is not None, self.run.output()

    def _step(self, step: dict[str, object]) -> tuple[str, object]:
        assert self.run.proc.stdin is not None
        self.run.proc.stdin.write(json.dumps(step) + "\n")
        self.run.proc.stdin.flush()
        while True:
            line = self.run.until("")
            assert line is not None, self.run.output()
            word, _, rest = line.partition(" ")
            if word in ("RESULT", "ERROR"):
                return word, json.loads(rest)
            if word == "RELOADED":
                return word, None

    def generate(self) -> list[list[int]]:
        word, value = self._step({"do": "generate"})
        assert word == "RESULT", (value, self.run.output())
        return value  # type: ignore[return-value]

    def reload(self, weights_path: str | Path | None = None) -> tuple[str, object]:
        """``("RELOADED", None)`` or ``("ERROR", [exception type, message])``."""
        kwargs = {} if weights_path is None else {"weights_path": str(weights_path)}
        return self._step({"do": "reload", "kwargs": kwargs})

    def attempt(self) -> tuple[str, object]:
        return self._step({"do": "generate"})

    def output(self) -> str:
        return self.run.output()

    def close(self) -> str:
        self.run.stop()
        return self.run.output()


def rewrite(
    src: Path,
    dst: Path,
    change: Callable[[str], bool] = lambda name: False,
    *,
    digests: bool = True,
    seed: int = 1,
) -> Path:
    """A copy of checkpoint ``src`` at ``dst`` written by fastload (``digests``: with a digest per
    tensor), the tensors ``change`` picks given new random values."""
    import torch
    from safetensors.torch import load_file

    from fastload import save_file

    dst.mkdir()
    generator = torch.Generator().manual_seed(seed)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
            continue
        state = load_file(f)
        for name in sorted(state):
            if change(name):
                t = state[name]
                fresh = torch.randn(t.shape, generator=generator, dtype=torch.float32) * 0.5
                state[name] = (fresh + 1.0 if name.endswith("norm.weight") else fresh).to(t.dtype)
        save_file(state, dst / f.name, metadata={"format": "pt"}, digests=digests)
    return dst


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama (two layers), written by fastload with digests."""
    from vllm_models import make_llama

    made = make_llama(tmp_path_factory.mktemp("made"), shards=3)
    return rewrite(made, tmp_path_factory.mktemp("ckpt") / "base")


#: a new fine-tune: one input of each fused parameter (q of qkv, gate of gate_up) in layer 0, and
#: the final norm; layer 1 and the embeddings unchanged
def _fine_tune(name: str) -> bool:
    return name in (
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.norm.weight",
    )


@pytest.fixture(scope="module")
def tuned(base: Path) -> Path:
    return rewrite(base, base.parent / "tuned", _fine_tune)


@pytest.fixture(scope="module")
def fresh_tokens(base: Path, tuned: Path) -> dict[str, list[list[int]]]:
    """Greedy tokens of fresh engines (vLLM's own loader) on each checkpoint."""
    results, output = _tokens(
        [base, tuned], _env(VLLM_ENABLE_V1_MULTIPROCESSING="0"), load_format="safetensors"
    )
    out = dict(zip(("base", "tuned"), results, strict=True))
    assert out["base"] != out["tuned"], output  # else a reload that did nothing would pass
    return out  # type: ignore[return-value]


def test_reload_weights_gives_the_tokens_of_a_fresh_engine_reading_only_changed_layers(
    base: Path, tuned: Path, fresh_tokens: dict[str, list[list[int]]]
) -> None:
    engine = Engine(base, load_format="fastload")
    try:
        assert engine.generate() == fresh_tokens["base"]
        assert engine.reload(tuned) == ("RELOADED", None)
        assert engine.generate() == fresh_tokens["tuned"]
        # back again, and once more with no path: the checkpoint the engine now holds
        assert engine.reload(base) == ("RELOADED", None)
        assert engine.generate() == fresh_tokens["base"]
        assert engine.reload() == ("RELOADED", None)
        assert engine.generate() == fresh_tokens["base"]
    finally:
        output = engine.close()
    assert "OWN-ITERATOR-CALLED" not in output, output
    # (vLLM warns for the rotary embedding's cache, which no checkpoint holds, on every reload)
    failed = [line for line in output.splitlines() if "Failed to load weights" in line]
    assert all("RotaryEmbedding" in line for line in failed), output
    assert "were not loaded from checkpoint" not in output, output
    # q_proj and gate_proj changed: their layers (qkv_proj, gate_up_proj) are read whole, with
    # k/v and up; the final norm alone. Layer 1, the embeddings, lm_head and the layer norms
    # are neither read nor copied.
    assert "6 tensors read" in output and "15 unchanged tensors" in output, output
    # the reload naming no path re-reads the same checkpoint: every layer unchanged
    assert "0 tensors read" in output and "21 unchanged tensors" in output, output
