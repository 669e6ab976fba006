"""Memory: the budget a load may use (cgroup limit or MemAvailable) and its refusals, views of the
file mapping or private copies (``sharing``), read-ahead and its pacing, the pinned staging pool,
and the page cache helpers of benches and tests.

Owns: how much memory there is and how bytes are held. Must not know: plans, models or where
the checkpoint came from (the plan room asks it whether a planned load fits).
"""
