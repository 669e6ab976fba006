"""The loaders and floors :mod:`fastload.tools.bench.run` times, each run in a fresh child process.

Every entry's timed region ends with a *touch*: one read per 4 KiB page of every parameter, so a
loader that returns lazily mapped tensors pays for the page faults it deferred, as its first
forward pass would. Peers are loaded the way their documentation shows for CPU.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

#: name -> what it measures. Floors first, then the peers, then fastload.
LOADERS: dict[str, str] = {
    "floor(map+touch)": "zero-copy floor: map the file and read one byte per 4 KiB page of its "
    "data (no load that hands out memory of its own can reach it; fastload's default warm load "
    "is measured against it too)",
    "floor(parallel read)": "the floor of both modes: 8 threads pread the data in 16 MiB blocks "
    "into reused buffers (one copy of the bytes: from the disk cold, from the page cache warm)",
    "floor(read into fresh memory)": "the same reads into one new buffer of the data's size (one "
    "copy into memory never written before, which a load that copies pays too)",
    "floor(skeleton+map+touch)": "the warm floor plus what every loader that builds the model "
    "pays: config read and the model's constructors on the meta device",
    "floor(fresh f32 memory)": "conversion floor: allocate the bf16 checkpoint's bytes twice over "
    "(its float32 size) and write every page, with torch's threads",
    "safetensors+load_state_dict": "model built normally, safetensors load_file, load_state_dict",
    "safetensors+meta+assign": "meta skeleton, safetensors load_file, load_state_dict(assign=True)",
    "transformers": "transformers AutoModelForCausalLM.from_pretrained (its default path)",
    "torch.load(mmap)+assign": "meta skeleton, torch.load(.bin, mmap=True, weights_only=True), "
    "load_state_dict(assign=True)",
    "fastsafetensors": "meta skeleton, fastsafetensors.fastsafe_open(nogds=True, device='cpu'), "
    "get_tensor each, load_state_dict(assign=True)",
    "runai-model-streamer": "meta skeleton, runai SafetensorsStreamer.stream_file, get_tensors, "
    "load_state_dict(assign=True)",
    "fastload": "fastload.from_pretrained, defaults (views of the mapping on a local filesystem)",
    "fastload(mmap=copy)": "fastload.from_pretrained(mmap='copy'): private copies",
    "transformers(bf16->f32)": "transformers from_pretrained(dtype=torch.float32) of the bf16 "
    "checkpoint",
    "fastload(bf16->f32)": "fastload.from_pretrained(dtype=torch.float32) of the bf16 checkpoint",
}

FLOORS = (
    "floor(map+touch)",
    "floor(parallel read)",
    "floor(read into fresh memory)",
    "floor(skeleton+map+touch)",
    "floor(fresh f32 memory)",
)
#: Rows only the bf16 checkpoint gets (they produce float32 from it).
CONVERSIONS = ("floor(fresh f32 memory)", "transformers(bf16->f32)", "fastload(bf16->f32)")
#: The loader each mode's ratios are taken against: a floor a load can reach, one copy of the bytes
#: (cold: from the disk, warm: from the page cache).
FLOOR_OF_MODE = {"warm": "floor(parallel read)", "cold": "floor(parallel read)"}
#: The floor of a warm load that copies nothing (fastload's default: views of the mapping),
#: given beside the mode's floor for that row only.
ZERO_COPY_FLOOR = "floor(map+touch)"


def is_peer(name: str) -> bool:
    """Another library's stored-dtype load (what fastload's default is compared with)."""
    return name not in FLOORS and name not in CONVERSIONS and not name.startswith("fastload")


def files_read(loader: str, checkpoint: Path) -> list[Path]:
    """The files a loader reads (to warm or evict before it runs)."""
    if loader.startswith("torch.load"):
        return [checkpoint / "pytorch_model.bin"]
    return [checkpoint / "model.safetensors"]


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _touch(tensors: Any) -> float:
    """One read per 4 KiB page of each tensor: faults in whatever a loader mapped lazily."""
    total = 0.0
    for t in tensors:
        flatten = getattr(t, "__tensor_flatten__", None)
        if flatten is not None:  # a tensor subclass (torchao's): the tensors it holds
            total += _touch([getattr(t, name) for name in flatten()[0]])
            continue
        flat = t.detach().reshape(-1)
        if flat.numel():
            total += float(flat[:: max(1, 4096 // flat.element_size())].float().sum())
    return total


def _skeleton(checkpoint: Path) -> Any:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(checkpoint)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _assign(checkpoint: Path, state: dict[str, Any]) -> list[Any]:
    model = _skeleton(checkpoint)
    model.load_state_dict(state, strict=False, assign=True)
    return list(model.parameters())


def _data_range(path: Path) -> tuple[int, int]:
    from fastload.core.reads.reading import open_file

    f = open_file(path)
    return f.data_start, f.file_size


def _map_and_touch(path: Path) -> list[Any]:
    import torch

    start, size = _data_range(path)
    storage = torch.UntypedStorage.from_file(str(path), False, size)
    return [torch.empty(0, dtype=torch.uint8).set_(storage, start, (size - start,))]


def parallel_read(
    path: Path, threads: int = 8, block: int = 16 << 20, into: memoryview | None = None
) -> list[Any]:
    """Reads the file's data section with ``threads`` positioned reads of ``block`` bytes at
    once: into per-thread buffers used again and again (the read floor), or into ``into``, as
    many bytes as the data section (the floor of reading into memory of one's own)."""
    start, size = _data_range(path)
    fd = os.open(path, os.O_RDONLY)
    buffers = [bytearray(block) for _ in range(threads)] if into is None else []
    try:

        def worker(i: int) -> int:
            view, done = (memoryview(buffers[i]) if into is None else into), 0
            for offset in range(start + i * block, size, threads * block):
                at = 0 if into is None else offset - start
                done += os.preadv(fd, [view[at : at + min(block, size - offset)]], offset)
            return done

        with ThreadPoolExecutor(threads) as pool:
            total = sum(pool.map(worker, range(threads)))
    finally:
        os.close(fd)
    if total != size - start:
        raise RuntimeError(f"{path}: read {total} of {size - start} bytes")
    return []


def _load(loader: str, checkpoint: Path) -> list[Any]:
    import torch

    import fastload

    st_path = checkpoint / "model.safetensors"
    if loader == "floor(map+touch)":
        return _map_and_touch(st_path)
    if loader == "floor(parallel read)":
        return parallel_read(st_path)
    if loader == "floor(read into fresh memory)":
        start, size = _data_range(st_path)
        out = torch.empty(size - start, dtype=torch.uint8)
        parallel_read(st_path, into=memoryview(out.numpy()))
        return [out]
    if loader == "floor(skeleton+map+touch)":
        _skeleton(checkpoint)
        return _map_and_touch(st_path)
    if loader == "floor(fresh f32 memory)":
        # Memory the kernel has never handed to this process costs a fault (and, in a VM, often
        # the host's work too) per page on first write: the part of a conversion no loader avoids.
        start, size = _data_range(st_path)
        out = torch.empty(2 * (size - start), dtype=torch.uint8)
        out.fill_(1)
        return [out]
    if loader == "safetensors+load_state_dict":
        from safetensors.torch import load_file
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(checkpoint)
        model = AutoModelForCausalLM.from_config(config, dtype=config.dtype)
        model.load_state_dict(load_file(st_path), strict=False)
        return list(model.parameters())
    if loader == "safetensors+meta+assign":
        from safetensors.torch import load_file

        return _assign(checkpoint, load_file(st_path))
    if loader in ("transformers", "transformers(bf16->f32)"):
        from transformers import AutoModelForCausalLM

        kwargs = {"dtype": torch.float32} if "->" in loader else {}
        return list(AutoModelForCausalLM.from_pretrained(checkpoint, **kwargs).parameters())
    if loader == "torch.load(mmap)+assign":
        state = torch.load(checkpoint / "pytorch_model.bin", mmap=True, weights_only=True)
        return _assign(checkpoint, state)
    if loader == "fastsafetensors":
        from fastsafetensors import fastsafe_open

        with fastsafe_open(str(st_path), nogds=True, device="cpu") as f:
            state = {k: f.get_tensor(k) for k in f.keys()}
        return _assign(checkpoint, state)
    if loader == "runai-model-streamer":
        from runai_model_streamer import SafetensorsStreamer

        with SafetensorsStreamer() as streamer:
            streamer.stream_file(str(st_path))
            state = dict(streamer.get_tensors())
        return _assign(checkpoint, state)
    if loader == "fastload":
        return list(fastload.from_pretrained(None, checkpoint, progress=False).parameters())
    if loader == "fastload(mmap=copy)":
        model = fastload.from_pretrained(None, checkpoint, mmap="copy", progress=False)
        return list(model.parameters())
    if loader == "fastload(bf16->f32)":
        model = fastload.from_pretrained(None, checkpoint, dtype=torch.float32, progress=False)
        return list(model.parameters())
    raise SystemExit(f"unknown loader {loader!r}")


def child(loader: str, checkpoint: Path) -> dict[str, Any]:
    """Runs one load and touch; imports happen before the clock and the RSS baseline, so that only
    the load is measured (a server has its modelling code imported already)."""
    import torch  # noqa: F401 - imported before the baseline on purpose
    import transformers  # noqa: F401
    from safetensors.torch import load_file  # noqa: F401
    from transformers import LlamaForCausalLM  # noqa: F401 - the model code every loader needs

    # fastload's entry point and its transformers layer, as the peers' code above: a load then
    # imports nothing of any library inside the clock (checked by the bench's tests)
    import fastload.api  # noqa: F401
    import fastload.hf.front  # noqa: F401

    if loader == "fastsafetensors":
        import fastsafetensors  # noqa: F401

        with contextlib.suppress(ImportError):  # its torch backend, imported on first open
            import fastsafetensors.frameworks._torch  # noqa: F401
    if loader == "runai-model-streamer":
        import runai_model_streamer  # noqa: F401
    if loader.startswith("torch.load"):
        with contextlib.suppress(ImportError):  # what torch.load imports on first use
            import torch.utils.serialization.config  # noqa: F401

    before = set(sys.modules)
    rss0 = _status_bytes("VmRSS")
    t0 = time.perf_counter()
    _touch(_load(loader, checkpoint))
    seconds = time.perf_counter() - t0
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over fork+exec from the parent (the runner,
    # which wrote the checkpoint), while VmHWM belongs to this process's address space alone.
    peak = _status_bytes("VmHWM")
    return {
        "seconds": seconds,
        "peak_rss_over_baseline": max(0, peak - rss0),
        # modules a loader imported inside the clock: import time, not load time (none expected)
        "imported_in_clock": sorted(set(sys.modules) - before),
    }
