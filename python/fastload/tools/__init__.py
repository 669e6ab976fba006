"""Tools built on the public API: the ``fastload`` command (``cli``), the demo (``demo``) and the
benchmarks (:mod:`fastload.tools.bench`).

May import: any layer below (they are the top); the benchmarks use internal seams only where a
variant they measure has no public spelling, and say so.
"""
