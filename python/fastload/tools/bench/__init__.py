"""The benchmark against the peers (``run``: ``fastload bench``, ``python -m
fastload.tools.bench``), the loaders it times (``loaders``) and the low-RAM mode in memory cgroups
(``lowram``)."""
