"""The plan's vocabulary: what happens to each model tensor in a load (:class:`Action`) and how a
loaded one gets its bytes (:class:`Mode`). A leaf: every step of the pipeline reads these, so they
live apart from the planner that decides them (:mod:`fastload.core.plan.planning`).
"""

from __future__ import annotations

from enum import Enum


class Mode(str, Enum):
    """How a loaded tensor gets its bytes."""

    #: a copy-on-write view of the file's validated mapping (no copy)
    VIEW = "view"
    #: a copy into memory of its own, in the stored dtype
    COPY = "copy"
    #: a copy converting the dtype on the way
    CONVERT = "convert"
    #: the part of a stored tensor this rank or device keeps (tensor parallelism)
    SLICE = "slice"
    #: assembled from several stored tensors (the model family's merges)
    MERGE = "merge"
    #: left in the file, read when its module runs (disk offload)
    OFFLOAD = "offload"
    #: into the model family's own tensor, in place (a DTensor's local shard)
    FILL = "fill"


class Action(str, Enum):
    """What happens to a model tensor (a tie group) in a load."""

    LOAD = "load"  # from the checkpoint
    INIT = "init"  # initialized: the checkpoint lacks it (or its shape differs, when allowed)
    KEEP = "keep"  # left as the model holds it


__all__ = ["Action", "Mode"]
