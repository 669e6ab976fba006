"""vLLM replicas that start one model from object storage share its fetch (``share_fetch``).

Two offline vLLM processes (two replicas: separate engines, no process group in common), each
reaching the S3-compatible test server through its own proxy (which counts the bytes the store
sent it, outside fastload), load the same ``weights`` URL with ``share_fetch``: each replica
fetched about half of the checkpoint, together they fetched it about once, and each generates
the tokens of vLLM's own loader. Runs in the vLLM environment (scripts/vllm-tests.sh).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from test_vllm import (
    MAX_TOKENS,
    _config_only,
    _env,
    _offline,
    llama,  # noqa: F401  (the fixtures: the checkpoint and vLLM's own tokens of it)
    pytestmark,  # noqa: F401  (skips the module without vLLM)
    reference,  # noqa: F401
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
