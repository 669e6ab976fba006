"""Running a fresh interpreter inside a real memory cgroup, for the tests of loads larger than
memory (tests/core/test_low_memory.py).

The cgroup itself is :class:`fastload.tools.bench.lowram.MemoryCgroup` (the low-RAM benchmark's): a
v2 ``memory.max`` or a v1 ``memory.limit_in_bytes`` group, removed afterwards. It needs root and a
cgroup filesystem with the memory controller (as on the project's machines and CI); elsewhere
the tests that use it are skipped with :func:`unavailable`'s reason.
"""

from __future__ import annotations

import json
import sys
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from fastload.tools.bench.lowram import MemoryCgroup

#: the reason no memory cgroup can be made here, or None
UNAVAILABLE = MemoryCgroup.unavailable()

#: marks a test that runs a child in a memory cgroup
needs_memory_cgroup = pytest.mark.skipif(
    UNAVAILABLE is not None, reason=f"no memory cgroup can be made here: {UNAVAILABLE}"
)

_PROBE = """
import json, sys
import torch, fastload, fastload.api  # what the children import before they load
from fastload.core.memory.budget import memory_budget
budget = memory_budget()
print(json.dumps({"held": budget.limit - budget.available, "source": budget.source}))
"""


@dataclass
class Child:
    returncode: int
    stdout: str
    stderr: str
    oom_killed: bool

    def json(self) -> dict:
        """The last line of stdout, parsed (the child prints its result as JSON)."""
        assert self.returncode == 0, f"exit {self.returncode}, OOM {self.oom_killed}\n{self.stderr}"
        return json.loads(self.stdout.strip().splitlines()[-1])


def run_in_cgroup(code: str, *args: object, limit: int | None, timeout: float = 300) -> Child:
    """Runs ``code`` (dedented) as a script in a fresh interpreter, inside a new memory cgroup of
    ``limit`` bytes (``None``: outside any new cgroup, for the reference run)."""
    with tempfile.TemporaryDirectory() as where:
        script = Path(where) / "child.py"
        script.write_text(textwrap.dedent(code))
        cmd = [sys.executable, str(script), *map(str, args)]
        if limit is None:
            import subprocess

            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
            return Child(done.returncode, done.stdout, done.stderr, False)
        with MemoryCgroup(limit) as group:
            done = group.run(cmd, timeout=timeout)
            return Child(done.returncode, done.stdout, done.stderr, group.oom_killed())


def baseline_bytes() -> int:
    """What a child holds in its cgroup once torch and fastload are imported (measured in a
    generous cgroup), so that a test's limit can leave a known room above it."""
    return run_in_cgroup(_PROBE, limit=8 << 30).json()["held"]
