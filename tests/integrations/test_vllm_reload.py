"""Reloading a running vLLM engine (``--load-format fastload``) with
``collective_rpc("reload_weights", kwargs={"weights_path": ...})``, as users run it: offline
(``LLM(...)`` in a fresh process) and through ``vllm serve`` between two requests. The tokens after
a reload must be those of a fresh engine on the new checkpoint; a checkpoint that does not fit is
refused with the old weights serving; a failure part way names the layers holding new weights and
the engine refuses to generate until a reload succeeds.

The checkpoints are tiny random-weight Llamas (tests/support/vllm_models.py) rewritten with fastload
digests; helpers come from tests/integrations/test_vllm.py. These tests run in the vLLM environment
(``bash scripts/vllm-tests.sh``); elsewhere they skip.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from test_vllm import (
    ENGINE,
    MAX_TOKENS,
    PROMPTS,
    TIMEOUT,
    _config_only,
    _env,
    _listening,
    _request,
    _Run,
    _serve,
    _tokens,
    pytestmark,  # noqa: F401  (skips the module without vLLM)
)

#: one engine, reloaded step by step: the step's JSON on stdin, a line back for each; the
#: engine's own weight iterators replaced by ones that say they were called
_DRIVER = """
import json, os, sys

def main():
    import vllm.model_executor.model_loader.default_loader as default_loader
    from vllm import LLM, SamplingParams

    def own(*args, **kwargs):
        print("OWN-ITERATOR-CALLED", flush=True)
        raise RuntimeError("vLLM's own weight iterator was called")

    def scribble(worker):  # what vLLM's sleep level 2 leaves: the weights' memory rewritten
        import torch

        with torch.no_grad():
            for p in worker.model_runner.model.parameters():
                p.zero_()

    for name in dir(default_loader):
        if name.endswith("_weights_iterator"):
            setattr(default_loader, name, own)
    llm = LLM(model=sys.argv[2], **json.loads(sys.argv[1]))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    print("LOADED", flush=True)
    for line in sys.stdin:
        step = json.loads(line)
        try:
            if step.get("fault"):  # the file changes once the reload checked it, before it reads
                import fastload.integrations.vllm.reload as fastload_reload

                real = fastload_reload.open_reload

                def faulty(*args, fault=step["fault"], **kwargs):
                    fastload_reload.open_reload = real
                    stream = real(*args, **kwargs)
                    if fault["kind"] == "truncate":
                        with open(fault["path"], "r+b") as f:
                            f.truncate(fault["size"])
                    else:  # replaced: another file renamed over it
                        os.replace(fault["by"], fault["path"])
                    return stream

                fastload_reload.open_reload = faulty
            if step["do"] == "scribble":
                llm.collective_rpc(scribble)
                print("RELOADED", flush=True)
            elif step["do"] == "generate":
                out = llm.generate(PROMPTS, params, use_tqdm=False)
                tokens = [list(o.outputs[0].token_ids) for o in out]
                print("RESULT " + json.dumps(tokens), flush=True)
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

    def reload(
        self, weights_path: str | Path | None = None, fault: dict[str, object] | None = None
    ) -> tuple[str, object]:
        """``("RELOADED", None)`` or ``("ERROR", [exception type, message])``; ``fault``: a
        shard truncated (``{"kind": "truncate", "path", "size"}``) or replaced (``{"kind":
        "replace", "path", "by"}``) once the reload has checked it, before it reads it."""
        kwargs = {} if weights_path is None else {"weights_path": str(weights_path)}
        return self._step({"do": "reload", "kwargs": kwargs, "fault": fault})

    def scribble(self) -> None:
        """Zeroes every parameter in place, as vLLM's sleep level 2 discards them."""
        assert self._step({"do": "scribble"}) == ("RELOADED", None)

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


def test_weights_written_since_by_something_else_are_read_again_though_digests_are_equal(
    base: Path, fresh_tokens: dict[str, list[list[int]]]
) -> None:
    engine = Engine(base, load_format="fastload")
    try:
        assert engine.generate() == fresh_tokens["base"]
        engine.scribble()
        assert engine.generate() != fresh_tokens["base"]
        # the checkpoint the engine held: every digest equal, every layer's bytes not
        assert engine.reload() == ("RELOADED", None)
        assert engine.generate() == fresh_tokens["base"]
    finally:
        output = engine.close()
    # (on the CPU, vLLM's post-processing packs the linear weights for oneDNN into memory of
    # its own: zeroing their parameters changes nothing, and the reload reads only the others)
    assert "fastload: reloaded" in output and " 0 tensors read" not in output, output


def _header(shard: Path) -> tuple[int, dict[str, dict[str, object]]]:
    raw = shard.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return 8 + n, json.loads(raw[8 : 8 + n])


def _shard_of(model: Path, tensor: str) -> Path:
    index = json.loads((model / "model.safetensors.index.json").read_text())
    return model / index["weight_map"][tensor]


def _bad(base: Path, where: Path) -> dict[str, tuple[Path, str, str]]:
    """Checkpoints that do not fit the engine serving ``base``: {kind: (directory, file named,
    tensor named)}."""
    from vllm_models import rewrite_header

    o_proj = "model.layers.0.self_attn.o_proj.weight"
    out = {}
    d = rewrite(base, where / "wrong-shape")
    shard = _shard_of(d, o_proj)

    def reshaped(header: dict) -> dict:
        rows, cols = header[o_proj]["shape"]
        header[o_proj]["shape"] = [rows * 2, cols // 2]
        return header

    rewrite_header(shard, reshaped)
    out["wrong-shape"] = (d, str(shard), o_proj)

    d = rewrite(base, where / "truncated")
    shard = _shard_of(d, o_proj)
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 1000)
    begin, header = _header(shard)
    header.pop("__metadata__", None)
    last = max(header, key=lambda name: header[name]["data_offsets"][1])  # type: ignore[index]
    out["truncated"] = (d, str(shard), last)

    d = rewrite(base, where / "missing")
    norm = "model.layers.1.post_attention_layernorm.weight"
    shard = _shard_of(d, norm)

    from safetensors.torch import load_file

    from fastload import save_file

    state = load_file(shard)
    del state[norm]
    save_file(state, shard, metadata={"format": "pt"}, digests=True)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    del index["weight_map"][norm]
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    out["missing"] = (d, "", norm)
    return out


def test_a_checkpoint_that_does_not_fit_is_refused_and_the_old_weights_keep_serving(
    base: Path, tuned: Path, fresh_tokens: dict[str, list[list[int]]], tmp_path: Path
) -> None:
    bad = _bad(base, tmp_path)
    engine = Engine(base, load_format="fastload")
    try:
        for kind, (path, file, tensor) in bad.items():
            word, error = engine.reload(path)
            assert word == "ERROR", (kind, error)
            name, message = error  # type: ignore[misc]
            assert name in ("CheckpointError", "ModelMismatchError"), (kind, error)
            assert file in message and repr(tensor) in message, (kind, error)
            assert engine.generate() == fresh_tokens["base"], kind
        # the refused path was not kept: a reload naming none re-reads what the engine holds
        assert engine.reload() == ("RELOADED", None)
        assert engine.generate() == fresh_tokens["base"]
        assert engine.reload(tuned) == ("RELOADED", None)
        assert engine.generate() == fresh_tokens["tuned"]
    finally:
        output = engine.close()
    assert "OWN-ITERATOR-CALLED" not in output, output


def test_a_shard_truncated_during_the_reload_leaves_old_weights_or_names_the_new_ones(
    base: Path, tuned: Path, fresh_tokens: dict[str, list[list[int]]], tmp_path: Path
) -> None:
    q_proj, norm = "model.layers.0.self_attn.q_proj.weight", "model.norm.weight"
    first, last = _shard_of(tuned, q_proj).name, _shard_of(tuned, norm).name
    assert first < last  # read in this order: q_proj's layer is filled before the norm is read
    engine = Engine(base, load_format="fastload")
    try:
        # the shard read first cut to its header: no layer took anything
        cut = rewrite(tuned, tmp_path / "cut-first")
        begin, _ = _header(cut / first)
        fault = {"kind": "truncate", "path": str(cut / first), "size": begin}
        word, error = engine.reload(cut, fault)
        assert word == "ERROR", error
        assert str(cut / first) in error[1], error  # type: ignore[index]
        assert "keeps its previous weights" in error[1], error  # type: ignore[index]
        assert engine.generate() == fresh_tokens["base"]

        # a shard replaced during the reload: the file opened and checked is the one read
        swapped = rewrite(tuned, tmp_path / "swapped")
        other = rewrite(base, tmp_path / "other", lambda name: True, seed=7)
        fault = {"kind": "replace", "path": str(swapped / first), "by": str(other / first)}
        assert engine.reload(swapped, fault) == ("RELOADED", None)
        assert engine.generate() == fresh_tokens["tuned"]

        # the norm's shard cut where the norm begins: layer 0's qkv and gate_up took new weights
        for attempt in ("reload", "generate"):
            cut = rewrite(base, tmp_path / f"cut-last-{attempt}", _fine_tune, seed=3)
            begin, header = _header(cut / last)
            size = begin + header[norm]["data_offsets"][0]  # type: ignore[index]
            fault = {"kind": "truncate", "path": str(cut / last), "size": size}
            word, error = engine.reload(cut, fault)
            assert word == "ERROR" and error[0] == "ReloadError", error  # type: ignore[index]
            message = error[1]  # type: ignore[index]
            assert str(cut / last) in message, message
            assert "model.layers.0.self_attn.qkv_proj.weight" in message, message
            assert "model.layers.0.mlp.gate_up_proj.weight" in message, message
            assert "model.layers.1" not in message, message
            if attempt == "reload":
                # a reload that succeeds lifts the mark (every tensor read: the digests no
                # longer say what the torn layers hold)
                assert engine.reload(base) == ("RELOADED", None)
                assert engine.generate() == fresh_tokens["base"]
            else:
                # generating on the torn model is refused (vLLM's engine stops there: it has
                # no way to fail one step and go on)
                word, refused = engine.attempt()
                assert word == "ERROR" and refused[0] == "ReloadError", refused  # type: ignore[index]
                assert "refuses to run until a reload succeeds" in refused[1], refused  # type: ignore[index]
    finally:
        output = engine.close()
    assert "21 tensors read" in output, output


def test_a_shard_truncated_during_the_reload_of_an_engine_of_another_dtype_is_an_error(
    base: Path, tuned: Path, tmp_path: Path
) -> None:
    """A float32 engine serving the bf16 checkpoint: every weight loader's copy converts. The
    engine makes those copies too (positioned reads, converting on the way), so a shard cut short
    during the reload is an error naming it, as in an engine of the checkpoint's dtype, not a
    SIGBUS that kills the engine (torch's converting copy read the file's mapping)."""
    first = _shard_of(tuned, "model.layers.0.self_attn.q_proj.weight").name
    engine = Engine(base, load_format="fastload", dtype="float32")
    try:
        before = engine.generate()
        cut = rewrite(tuned, tmp_path / "cut-first")
        begin, _ = _header(cut / first)
        fault = {"kind": "truncate", "path": str(cut / first), "size": begin}
        word, error = engine.reload(cut, fault)
        assert word == "ERROR", error
        assert str(cut / first) in error[1], error  # type: ignore[index]
        assert "keeps its previous weights" in error[1], error  # type: ignore[index]
        assert engine.generate() == before
        assert engine.reload(tuned) == ("RELOADED", None)
        assert engine.generate() != before
    finally:
        output = engine.close()
    assert "OWN-ITERATOR-CALLED" not in output, output


def test_an_engine_on_object_storage_weights_reloads_what_each_call_names(
    base: Path, tuned: Path, fresh_tokens: dict[str, list[list[int]]], tmp_path: Path, server
) -> None:
    """Started with the ``weights`` option (the model argument names only the config): a reload
    reads the URL or directory the call names, re-reads the URL the engine holds when it names
    none, and refuses a path it could read as either."""
    base_url = server.place(base, "models", "base")
    tuned_url = server.place(tuned, "models", "tuned")
    config = tmp_path / "config-only"
    config.mkdir()
    for f in base.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, config / f.name)
    # more retries than the default, as a margin: the server shares the cores with vLLM
    extra = {"weights": base_url, "storage_options": {"max_retries": 8}}
    env = _env(VLLM_ENABLE_V1_MULTIPROCESSING="0", **server.env())
    engine = Engine(config, env, load_format="fastload", model_loader_extra_config=extra)
    try:
        assert engine.generate() == fresh_tokens["base"]
        # weight files put beside the config: naming the model argument could mean them or the
        # URL the engine holds
        for f in tuned.glob("*.safetensors"):
            shutil.copy(f, config / f.name)
        word, error = engine.reload(config)
        assert word == "ERROR" and error[0] == "RequestError", error  # type: ignore[index]
        assert "'weights' option" in error[1] and str(config) in error[1], error  # type: ignore[index]
        assert engine.generate() == fresh_tokens["base"]
        for f in config.glob("*.safetensors"):
            f.unlink()
        assert engine.reload() == ("RELOADED", None)  # no path: the option's URL, re-read
        assert engine.generate() == fresh_tokens["base"]
        assert engine.reload(tuned_url) == ("RELOADED", None)
        assert engine.generate() == fresh_tokens["tuned"]
        assert engine.reload() == ("RELOADED", None)  # the URL it now holds, not the option's
        assert engine.generate() == fresh_tokens["tuned"]
        assert engine.reload(base) == ("RELOADED", None)  # a local directory
        assert engine.generate() == fresh_tokens["base"]
    finally:
        output = engine.close()
    assert "OWN-ITERATOR-CALLED" not in output, output
    assert f"reloaded {tuned_url} in" in output and "6 tensors read" in output, output


def test_vllm_serve_reloads_between_two_requests(
    base: Path, tuned: Path, fresh_tokens: dict[str, list[list[int]]], monkeypatch
) -> None:
    """``POST /collective_rpc`` (``VLLM_SERVER_DEV_MODE=1``) between two completion requests."""
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    run, uds = _serve(base, "fastload")

    def complete() -> list[list[int]]:
        body = {
            "model": str(base),
            "prompt": PROMPTS,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "return_token_ids": True,
        }
        answer = _request(uds, "/v1/completions", body)
        choices = sorted(answer["choices"], key=lambda c: c["index"])  # type: ignore[index]
        return [list(c["token_ids"]) for c in choices]

    try:
        _listening(run, uds)
        assert complete() == fresh_tokens["base"]
        rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(tuned)}}
        assert _request(uds, "/collective_rpc", rpc) == {"results": [None]}, run.output()
        assert complete() == fresh_tokens["tuned"]
    finally:
        run.stop()
    output = run.output()
    assert f"fastload: reloaded {tuned} in" in output and "6 tensors read" in output, output


#: two tensor-parallel ranks in worker processes, each on a core of its own
TP2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}


def _tp2_env(**extra: str) -> dict[str, str]:
    return _env(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND="0|1", **extra)


@pytest.fixture(scope="module")
def tp2_tokens(base: Path, tuned: Path) -> dict[str, list[list[int]]]:
    """Greedy tokens of vLLM's own loader on two ranks, on each checkpoint: like is compared with
    like (bf16 sums in another order than on one rank)."""
    results, output = _tokens([base, tuned], _tp2_env(), load_format="safetensors", **TP2)
    out = dict(zip(("base", "tuned"), results, strict=True))
    assert out["base"] != out["tuned"], output
    return out  # type: ignore[return-value]


def test_two_tensor_parallel_ranks_reload_their_slices(
    base: Path, tuned: Path, tp2_tokens: dict[str, list[list[int]]]
) -> None:
    engine = Engine(base, _tp2_env(), load_format="fastload", **TP2)
    try:
        assert engine.generate() == tp2_tokens["base"]
        assert engine.reload(tuned) == ("RELOADED", None)
        assert engine.generate() == tp2_tokens["tuned"]
    finally:
        output = engine.close()
    # each rank left out the same unchanged layers
    assert output.count("15 unchanged tensors") == 2, output


def test_two_tensor_parallel_ranks_reload_only_their_slices_from_object_storage(
    base: Path, tuned: Path, tp2_tokens: dict[str, list[list[int]]], tmp_path: Path, server
) -> None:
    from s3_server import FaultProxy
    from vllm_models import bytes_needed

    base_url = server.place(base, "models", "tp-base")
    tuned_url = server.place(tuned, "models", "tp-tuned")
    faulty_url = server.place(base, "models", "tp-faulty")
    config = _config_only(base, tmp_path / "config-only")
    # the shard of the final norm, the first tensor the reload reads (its shard is the index's
    # first: it holds lm_head): changed in the store when both ranks, having opened it, ask for
    # the norm (one read each: the shard's other tensors are unchanged), before either is served
    norm = "model.norm.weight"
    shard = _shard_of(base, norm).name
    stored = server.root / "models" / "tp-faulty" / shard
    header_end, _ = _header(stored)
    changed = threading.Event()
    # bounded like every wait here (a rank that never asks fails the test), never by a pace
    both = threading.Barrier(2, timeout=TIMEOUT)
    lock = threading.Lock()

    def change_once(path: str, start: int) -> None:
        if f"tp-faulty/{shard}" not in path or start < header_end or changed.is_set():
            return
        both.wait()
        with lock:
            if not changed.is_set():
                raw = bytearray(stored.read_bytes())
                raw[header_end : header_end + 4096] = bytes(
                    b ^ 0xFF for b in raw[header_end:][:4096]
                )
                server.rewrite("models", f"tp-faulty/{shard}", bytes(raw))  # with its ETag
                changed.set()

    proxy = FaultProxy(server.port)  # counts the bytes it forwards to each client process
    try:
        extra = {"weights": base_url, "storage_options": {"max_retries": 8}}
        env = _tp2_env(**server.env(proxy.endpoint))
        engine = Engine(config, env, load_format="fastload", model_loader_extra_config=extra, **TP2)
        try:
            assert engine.generate() == tp2_tokens["base"]
            before = dict(proxy.sent_to)
            assert engine.reload(tuned_url) == ("RELOADED", None)
            after = dict(proxy.sent_to)
            assert engine.generate() == tp2_tokens["tuned"]
            # a shard replaced in the store while the ranks fetch their slices: every rank stops
            # naming it and the tensor, and every layer keeps its old weights (the norm's too,
            # whose fetch failed in its weight loader)
            proxy.on_get = change_once
            word, error = engine.reload(faulty_url)
            proxy.on_get = None
            assert changed.is_set()
            assert word == "ERROR", error
            message = error[1]  # type: ignore[index]
            assert f"{faulty_url}{shard}" in message and repr(norm) in message, message
            assert f"keeps its previous weights ({tuned_url}) whole" in message, message
            assert engine.generate() == tp2_tokens["tuned"]
            # (no collective_rpc after it here: vLLM 0.32's executor raises the first rank's
            # failure and leaves the second's reply queued, which the next call then returns)
        finally:
            output = engine.close()
    finally:
        proxy.close()
    log = "\n".join(line for line in output.splitlines() if "fastload" in line)
    # measured from outside: the response bytes (headers included) the store sent each process
    # during the first reload
    sent = {pid: n - before.get(pid, 0) for pid, n in after.items() if n > before.get(pid, 0)}
    assert None not in sent and len(sent) == 2, (sent, log)
    # what that reload reads: the fused layers of the fine-tune's changed tensors (q with k and
    # v, gate with up) and the final norm; each rank its rows of each and the norm whole, plus
    # the shards' headers (each read exactly: its length, then the header) and one
    # response's HTTP header per ranged GET. Before each rank fetched every byte of them.
    fused = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj")
    read = {f"model.layers.0.{name}.weight" for name in (*fused, "mlp.up_proj")} | {norm}
    shards = sorted(tuned.glob("*.safetensors"))
    needed = bytes_needed(shards, ranks=2, names=read)
    whole = bytes_needed(shards, ranks=1, names=read)[0]
    opened = sum(_header(f)[0] for f in shards)
    for n, need in zip(sorted(sent.values()), sorted(needed), strict=True):
        assert need < 0.55 * whole, (needed, whole)
        assert n < need + opened + (64 << 10), (sent, needed, opened, log)
    assert sum(sent.values()) - 2 * opened > 0.95 * whole, (sent, whole, log)  # it did come
    # on each rank: the fine-tune's layers read, and what the rank fetched of them
    assert log.count(" 6 tensors read (") == 2, log
    assert log.count("this rank fetched") == 2, log
