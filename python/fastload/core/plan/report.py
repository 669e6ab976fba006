"""The report of one ``from_pretrained`` load: what matched, what did not, and what it cost."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastload.core.basics.redaction import RedactedFields
from fastload.core.basics.units import format_bytes


def _names(title: str, names: list[str], limit: int) -> list[str]:
    if not names:
        return []
    lines = [f"  {title} ({len(names)}):"]
    lines += [f"    {n}" for n in names[:limit]]
    if len(names) > limit:
        lines.append(f"    ... and {len(names) - limit} more")
    return lines


@dataclass
class LoadReport(RedactedFields):
    """What :func:`fastload.from_pretrained` did.

    Names in ``missing`` are model names; names in ``unexpected`` are checkpoint names. The
    ``authorized_*`` lists hold the names the model class declares as expected
    (``_keys_to_ignore_on_load_*``, layers the model does not build, buffers it computes itself):
    they are handled silently and never trigger a policy.

    File names and URLs are stored with a URL's query and user-info hidden
    (:class:`~fastload.core.basics.redaction.RedactedFields`).
    """

    #: model tensors the checkpoint does not provide (initialized, or kept for a built module)
    missing: list[str] = field(default_factory=list)
    #: checkpoint tensors the model has no place for
    unexpected: list[str] = field(default_factory=list)
    #: (model name, checkpoint shape, model shape) re-initialized under ignore_mismatched_sizes
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    #: groups of model names that share one Parameter after loading
    tied: list[list[str]] = field(default_factory=list)
    authorized_missing: list[str] = field(default_factory=list)
    authorized_unexpected: list[str] = field(default_factory=list)
    #: the authorized unexpected names the model class does not declare, found expected by
    #: fastload: tensors of layers the model does not build (``add_pooling_layer=False``),
    #: buffers it computes itself; ``to_dict`` lists these as unexpected
    inferred_unexpected: list[str] = field(default_factory=list)
    #: checkpoint name -> its name after the ``key_map`` and the model family's renames, for
    #: unused checkpoint tensors where they differ (the names ``to_dict`` lists)
    unexpected_renamed: dict[str, str] = field(default_factory=dict)
    #: checkpoint name -> model name, where they differ (prefix, legacy names, key_map)
    renamed: dict[str, str] = field(default_factory=dict)
    #: model tensors initialized the model's own way
    initialized: list[str] = field(default_factory=list)
    #: bytes read from the checkpoint files (by this rank: with a tp_plan, its shards and the
    #: replicated tensors), and written into the model's tensors
    bytes_read: int = 0
    bytes_written: int = 0
    #: bytes served as views of a copy-on-write mapping of the file (``mmap="auto"/"shared"``)
    bytes_shared: int = 0
    #: file path -> how its tensors were loaded: "views of the file mapping (ext4)", "copies
    #: (nfs is a network or FUSE filesystem)", "copies (mmap='copy')", ... (see
    #: fastload.core.memory.sharing)
    sharing: dict[str, str] = field(default_factory=dict)
    #: in a collective load (``process_group``, ``tp_plan``): bytes this rank received from the
    #: others (``bytes_read`` is then what it read from storage, in whole pages)
    bytes_received: int = 0
    #: bytes offloaded to disk (device_map "disk"): left in the checkpoint file, read on use
    bytes_offloaded: int = 0
    #: the most host memory the staging pool held (pinned buffers for accelerator destinations;
    #: 0 when nothing was staged)
    staging_bytes: int = 0
    #: bytes the staged path read past the page cache (direct I/O: cold ranges), and through it
    #: (ranges already cached, or where the filesystem refuses direct I/O)
    bytes_staged_direct: int = 0
    bytes_staged_cached: int = 0
    tensors_loaded: int = 0
    #: wall-clock seconds per phase, in order
    seconds: dict[str, float] = field(default_factory=dict)
    read_mode: str = "pread"
    files: list[str] = field(default_factory=list)
    device: str = "cpu"
    dtype: str = "auto"
    model_class: str = ""
    #: with tp_plan: this process's rank and the number of ranks sharing the model
    rank: int = 0
    world_size: int = 1
    #: with device_map: {module prefix: device} as resolved ("auto" planned)
    device_map: dict[str, str] | None = None
    #: the memory the load found it may use (its cgroup's limit less what the cgroup holds, else
    #: MemAvailable; ``None``: unknown) and where that figure came from
    #: (:mod:`fastload.core.memory.budget`)
    memory_budget: int | None = None
    memory_source: str = ""
    #: bytes of the views read (or mapped) ahead of their first use: all of them when they fit
    #: the budget, else only what fits, in the order the model uses them
    bytes_read_ahead: int = 0
    #: how the views were read ahead: the whole files, all views, the first ones that fit the
    #: budget, or paced by the first forward (a model larger than the budget); "" for none
    read_ahead: str = ""
    #: the quantization method of a pre-quantized checkpoint, as its config names it; "" for an
    #: unquantized one
    quant_method: str = ""
    #: seconds its quantizer's hooks and load operations took (module swaps, dequantizing,
    #: post-processing), within the phases ``seconds`` lists and apart from the reads
    quant_seconds: float = 0.0

    @property
    def total_seconds(self) -> float:
        """Seconds of the whole load."""
        return sum(self.seconds.values())

    def to_dict(self) -> dict[str, Any]:
        """The report as an ``output_loading_info`` dict, for code written against that shape:
        sets of names (and of ``(name, checkpoint shape, model shape)``), a list of error
        messages. Unused checkpoint tensors are listed under their renamed names, those of
        layers the model does not build included."""
        unused = [*self.unexpected, *self.inferred_unexpected]
        return {
            "missing_keys": set(self.missing),
            "unexpected_keys": {self.unexpected_renamed.get(n, n) for n in unused},
            "mismatched_keys": {(n, tuple(c), tuple(m)) for n, c, m in self.mismatched},
            "error_msgs": [],
        }

    def _sharing_lines(self) -> list[str]:
        if len(self.sharing) == 1:
            return [f"  tensors: {how}" for how in self.sharing.values()]
        if len(self.sharing) <= 3:
            return [f"  {path}: {how}" for path, how in self.sharing.items()]
        counts: dict[str, int] = {}
        for how in self.sharing.values():
            counts[how] = counts.get(how, 0) + 1
        return [f"  {n} files: {how}" for how, n in counts.items()]

    def summary(self, limit: int = 10) -> str:
        """A readable multi-line summary; at most ``limit`` names per list."""
        rate = self.bytes_read / self.total_seconds / 2**20 if self.total_seconds > 0 else 0.0
        files = ", ".join(self.files) if len(self.files) <= 3 else f"{len(self.files)} files"
        lines = [
            f"fastload: loaded {self.tensors_loaded} tensors "
            f"({format_bytes(self.bytes_read)}) into "
            f"{self.model_class or 'the model'} in {self.total_seconds:.3f} s ({rate:.0f} MiB/s)",
            f"  from: {files}",
            f"  read mode: {self.read_mode}, device: {self.device}, dtype: {self.dtype}",
            *(
                [
                    f"  quantized: {self.quant_method} (its quantizer's hooks and operations "
                    f"{self.quant_seconds * 1000:.1f} ms)"
                ]
                if self.quant_method
                else []
            ),
            *(
                [
                    f"  shared (copy-on-write views of the file, not copied): "
                    f"{format_bytes(self.bytes_shared)}"
                ]
                if self.bytes_shared
                else []
            ),
            *self._sharing_lines(),
            *(
                [
                    f"  memory budget: {format_bytes(self.memory_budget)} "
                    f"({self.memory_source}); read ahead: {format_bytes(self.bytes_read_ahead)}"
                    + (f", {self.read_ahead}" if self.read_ahead else "")
                ]
                if self.memory_budget is not None
                else []
            ),
            *(
                [
                    f"  staged through {format_bytes(self.staging_bytes)} of host buffers: "
                    f"{format_bytes(self.bytes_staged_direct)} read past the page cache, "
                    f"{format_bytes(self.bytes_staged_cached)} through it"
                ]
                if self.staging_bytes
                else []
            ),
            *(
                [f"  offloaded to disk (read when used): {format_bytes(self.bytes_offloaded)}"]
                if self.bytes_offloaded
                else []
            ),
            *(
                [
                    f"  collective: rank {self.rank} of {self.world_size} read "
                    f"{format_bytes(self.bytes_read)} from storage and received "
                    f"{format_bytes(self.bytes_received)} from the others"
                ]
                if self.world_size > 1
                else []
            ),
            "  phases: " + ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in self.seconds.items()),
        ]
        lines += _names("missing", self.missing, limit)
        lines += _names("unexpected", self.unexpected, limit)
        lines += _names(
            "mismatched (re-initialized)",
            [f"{n}: checkpoint {list(c)} vs model {list(m)}" for n, c, m in self.mismatched],
            limit,
        )
        lines += _names("initialized", self.initialized, limit)
        lines += _names("expected missing (authorized)", self.authorized_missing, limit)
        lines += _names("expected unused (authorized)", self.authorized_unexpected, limit)
        lines += _names("tied", [" = ".join(g) for g in self.tied], limit)
        lines += _names("renamed", [f"{k} -> {v}" for k, v in self.renamed.items()], limit)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()
