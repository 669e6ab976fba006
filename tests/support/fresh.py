"""Running code as a user runs it: a script file in a fresh interpreter, which imports only what
the script imports (the test process's modules do not leak in)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path


def run_script(
    code: str,
    *args: object,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 300,
) -> str:
    """Runs ``code`` (dedented) as a script file with ``args`` as ``sys.argv[1:]`` in a fresh
    interpreter; returns its stdout. A file, not ``-c``, so that workers it spawns can import it.
    Fails with the script, its stdout and its stderr when it exits non-zero."""
    code = textwrap.dedent(code)
    with tempfile.TemporaryDirectory() as where:
        script = Path(where) / "user.py"
        script.write_text(code)
        done = subprocess.run(
            [sys.executable, str(script), *map(str, args)],
            capture_output=True,
            text=True,
            cwd=cwd,
            env=os.environ.copy() if env is None else env,
            timeout=timeout,
        )
    assert done.returncode == 0, f"{code}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    return done.stdout
