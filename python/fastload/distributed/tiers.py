"""A broadcast in two tiers for peers on several machines: once to each machine, then inside it.

A flat broadcast among N peers spread over M machines sends each chunk to every peer of another
machine, so a chunk crosses the machines' network once per remote peer. In tiers it crosses it
once per remote machine:

1. **Across machines**, in the chunk's *lane*: the peers, one per machine, that hold the owner's
   place on their machine (the owner's local index; on a machine with fewer peers, the index
   modulo their number). The owner broadcasts the chunk in its lane.
2. **Inside each machine**, the lane's member there broadcasts it to the machine's other peers.

Every peer makes the same calls in the same order (every chunk, every tier it belongs to), so no
group waits for a call another peer will never make; each tier is a gloo group of its own, made
once every peer arrived (:func:`fastload.distributed.rendezvous.join`).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from typing import Any

import torch


class Tiers:
    """The machines of a group's peers (``nodes[r]``: peer ``r``'s machine) and this peer's
    groups of each tier: ``make(name, ranks)`` makes the gloo group of the global ranks
    ``ranks`` (this peer among them) under a store prefix ``name``."""

    def __init__(
        self, nodes: Sequence[str], rank: int, make: Callable[[str, list[int]], Any]
    ) -> None:
        self.rank = rank
        self.machines = sorted(set(nodes))
        #: each machine's peers, in rank order
        self.members = {m: [r for r, n in enumerate(nodes) if n == m] for m in self.machines}
        self.node = nodes[rank]
        self.index = {r: rs.index(r) for rs in self.members.values() for r in rs}
        self.lanes = max(len(rs) for rs in self.members.values())
        mine = self.members[self.node]
        #: this machine's group (None: the only peer here)
        self.local = make(f"node/{self.machines.index(self.node)}", mine) if len(mine) > 1 else None
        #: the lanes this peer is in: lane -> (its group, lane ranks by global rank)
        self.groups: dict[int, tuple[Any, dict[int, int]]] = {}
        for lane in range(self.lanes):  # in lane order on every peer: no two wait on each other
            ranks = self.lane(lane)
            if rank in ranks:
                self.groups[lane] = (
                    make(f"lane/{lane}", ranks),
                    {r: i for i, r in enumerate(ranks)},
                )

    def lane(self, lane: int) -> list[int]:
        """The global ranks of ``lane``, one per machine, in machine order."""
        return [rs[lane % len(rs)] for rs in (self.members[m] for m in self.machines)]

    def broadcast(self, buffer: torch.Tensor, owner: int) -> None:
        """``buffer`` of peer ``owner``, to every peer (see the module docstring)."""
        lane = self.index[owner]
        if lane in self.groups:
            group, ranks = self.groups[lane]
            _broadcast(group, buffer, ranks[owner])
        if self.local is not None:
            here = self.members[self.node]
            source = here[lane % len(here)]
            _broadcast(self.local, buffer, here.index(source))


def _broadcast(group: Any, buffer: torch.Tensor, root: int) -> None:
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = root
    group.broadcast([buffer], options).wait()


def gloo_group(store: Any, prefix: str, ranks: list[int], rank: int, timeout: float) -> Any:
    """The gloo group of global ranks ``ranks`` (this ``rank`` among them), met under
    ``prefix`` of ``store``."""
    import torch.distributed as dist

    return dist.ProcessGroupGloo(
        dist.PrefixStore(prefix, store),
        ranks.index(rank),
        len(ranks),
        datetime.timedelta(seconds=timeout),
    )


__all__ = ["Tiers", "gloo_group"]
