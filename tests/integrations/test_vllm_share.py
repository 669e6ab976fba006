"""vLLM replicas that start one model from object storage share its fetch (``share_fetch``).

Two offline vLLM processes (two replicas: separate engines, no process group in common), each
reaching the S3-compatible test server through its own proxy (which counts the bytes the store
sent it, outside fastload), load the same ``weights`` URL with ``share_fetch``: each replica
fetched about half of the checkpoint, together they fetched it about once, and each generates
the tokens of vLLM's own loader. A reload of both (each replica's ``reload_weights`` at once)
fetches the changed tensors once in all. Runs in the vLLM environment (scripts/vllm-tests.sh).
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from test_vllm import (
    MAX_TOKENS,
    TIMEOUT,
    _config_only,
    _env,
    _offline,
    llama,  # noqa: F401  (the fixtures: the checkpoint and vLLM's own tokens of it)
    pytestmark,  # noqa: F401  (skips the module without vLLM)
    reference,  # noqa: F401
)
from test_vllm_reload import (
    Engine,
    base,  # noqa: F401  (the fixtures: a checkpoint with digests, a fine-tune of it, and
    fresh_tokens,  # noqa: F401  vLLM's own tokens of each)
    tuned,  # noqa: F401
)


def _finish(run) -> tuple[object, str]:  # type: ignore[no-untyped-def]
    """The tokens (or error) of a one-model offline run, and its output."""
    try:
        got: object = None
        while (line := run.until("")) is not None:
            word, _, rest = line.partition(" ")
            if word in ("RESULT", "ERROR"):
                got = json.loads(rest)
            if word == "DONE":
                break
    finally:
        run.stop()
    return got, run.output()


def test_two_replicas_share_one_fetch_and_give_the_tokens_of_safetensors(
    llama: Path,  # noqa: F811
    reference: list[list[int]],  # noqa: F811
    tmp_path: Path,
) -> None:
    from s3_server import FaultProxy, S3Server
    from spawn_ranks import free_port

    (tmp_path / "s3-root").mkdir()
    s3 = S3Server(tmp_path / "s3-root")
    proxies = [FaultProxy(s3.port), FaultProxy(s3.port)]
    try:
        url = s3.place(llama, "models", "llama")
        local = _config_only(llama, tmp_path / "config-only")
        extra = {
            "weights": url,
            "storage_options": {"max_retries": 8},
            "share_fetch": "node",
            "share_fetch_address": f"127.0.0.1:{free_port()}",
            "share_fetch_peers": 2,
            # a replica may start much later than the other on a busy machine
            "share_fetch_timeout": TIMEOUT,
        }
        runs = [
            _offline(
                [local],
                _env(**s3.env(p.endpoint), VLLM_CPU_OMP_THREADS_BIND=str(i)),
                load_format="fastload",
                model_loader_extra_config=extra,
            )
            for i, p in enumerate(proxies)
        ]
        results = [_finish(run) for run in runs]
        sent = [p.sent for p in proxies]
    finally:
        for p in proxies:
            p.close()
        s3.stop()
    for tokens, output in results:
        assert tokens == reference, output
        assert isinstance(tokens, list) and all(len(t) == MAX_TOKENS for t in tokens)
    size = sum(f.stat().st_size for f in llama.glob("*.safetensors"))
    # counted outside fastload: each replica about half, together the checkpoint about once
    # (plus each replica's reads of the shards' headers and the index)
    for share in sent:
        assert 0.4 * size < share < 0.5 * size + (4 << 20), (sent, size)
    assert sum(sent) < size + (8 << 20), (sent, size)
    # each says what it fetched and what it received from its peer
    ranks = set()
    for _, output in results:
        m = re.search(r"share_fetch: peer (\d) of 2 fetched ([0-9.]+ MiB) from the store", output)
        assert m is not None, output
        ranks.add(m.group(1))
    assert ranks == {"0", "1"}


def test_two_replicas_reloading_at_once_fetch_the_changed_tensors_once_in_all(
    base: Path,  # noqa: F811
    tuned: Path,  # noqa: F811
    fresh_tokens: dict[str, list[list[int]]],  # noqa: F811
    tmp_path: Path,
    server,  # the S3 server (tests/support/s3_fixtures.py)
) -> None:
    from s3_server import FaultProxy
    from spawn_ranks import free_port

    from fastload import load_file

    base_url = server.place(base, "models", "share-base")
    tuned_url = server.place(tuned, "models", "share-tuned")
    config = _config_only(base, tmp_path / "config-only")
    proxies = [FaultProxy(server.port), FaultProxy(server.port)]
    extra = {
        "weights": base_url,
        "storage_options": {"max_retries": 8},
        "share_fetch": "node",
        "share_fetch_address": f"127.0.0.1:{free_port()}",
        "share_fetch_peers": 2,
        # a replica may start much later than the other on a busy machine
        "share_fetch_timeout": TIMEOUT,
    }

    def start(i: int) -> Engine:
        env = _env(
            VLLM_ENABLE_V1_MULTIPROCESSING="0",
            VLLM_CPU_OMP_THREADS_BIND=str(i),
            **server.env(proxies[i].endpoint),
        )
        return Engine(config, env, load_format="fastload", model_loader_extra_config=extra)

    engines: list[Engine] = []
    try:
        with ThreadPoolExecutor(2) as pool:  # each load waits for the other replica
            engines = list(pool.map(start, range(2)))
            assert [e.generate() for e in engines] == [fresh_tokens["base"]] * 2
            before = [p.sent for p in proxies]
            reloads = list(pool.map(lambda e: e.reload(tuned_url), engines))
            sent = [p.sent - b for p, b in zip(proxies, before, strict=True)]
        assert reloads == [("RELOADED", None)] * 2, reloads
        assert [e.generate() for e in engines] == [fresh_tokens["tuned"]] * 2
    finally:
        outputs = [e.close() for e in engines]
        for p in proxies:
            p.close()
    # the changed tensors (their layers' other inputs too: qkv and gate_up are read whole, as
    # without sharing), fetched once in all, about half by each replica, counted at its proxy;
    # besides them, each replica reads the new shards' headers
    read = {
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.norm.weight",
    }
    changed = 0
    for shard in tuned.glob("*.safetensors"):
        changed += sum(
            t.numel() * t.element_size() for n, t in load_file(shard).items() if n in read
        )
    for share in sent:
        assert 0.3 * changed < share < 0.5 * changed + (2 << 20), (sent, changed)
    assert sum(sent) < changed + (4 << 20), (sent, changed)
    for output in outputs:
        assert "6 tensors read" in output and "15 unchanged tensors" in output, output
