"""What a reload did (:class:`ReloadReport`): the tensors read, skipped as unchanged, verified,
the bytes read, written and staged, and the time."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from fastload.core.basics.redaction import RedactedFields
from fastload.core.basics.units import format_bytes

__all__ = ["ReloadReport"]


@dataclass
class ReloadReport(RedactedFields):
    """What a reload did: tensors and bytes read, and those skipped as unchanged (equal
    digests in both checkpoints). ``source`` and ``files`` are stored with a URL's query and
    user-info hidden."""

    source: str
    files: list[str] = field(default_factory=list)
    #: model tensors (a tie counted once) filled from the new checkpoint
    tensors_read: int = 0
    #: model tensors left as they were: their digest is the same in both checkpoints
    tensors_unchanged: int = 0
    bytes_read: int = 0
    bytes_unchanged: int = 0
    #: bytes written into the model's tensors (their dtype)
    bytes_written: int = 0
    atomic: bool = False
    #: bytes held by the staged copies of ``atomic=True``
    bytes_staged: int = 0
    #: tensors whose bytes read were checked against their digest (``verify=True``: every one
    #: read whose file records a digest, whatever its dtype, device or tensor-parallel part)
    tensors_verified: int = 0
    seconds: float = 0.0

    def summary(self) -> str:
        """One line: what was read, skipped and how fast."""
        rate = self.bytes_read / self.seconds / 2**30 if self.seconds > 0 else 0.0
        mode = " (atomic)" if self.atomic else ""
        return (
            f"reloaded {self.source}{mode}: {self.tensors_read} tensors read "
            f"({format_bytes(self.bytes_read)}), {self.tensors_unchanged} unchanged "
            f"({format_bytes(self.bytes_unchanged)}) in {self.seconds:.3f} s ({rate:.2f} GiB/s)"
        )

    def to_dict(self) -> dict[str, Any]:
        """The report as plain data (for JSON)."""
        return asdict(self)

    def __str__(self) -> str:
        return self.summary()
