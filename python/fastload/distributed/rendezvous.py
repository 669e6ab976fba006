"""Groups of processes that are not one ``torch.distributed`` job: the replicas of a server that
start one model, meeting at a rendezvous address to share its fetch.

Each replica (a vLLM engine's worker, a pod of an autoscaling fleet) has its own process group,
or none; nothing joins them. :func:`join` makes one: the processes that name the same
``host:port`` and the same share (the checkpoint's URL) meet at a ``torch.distributed.TCPStore``
there (served by whichever process on that host binds the port first; the others connect to it),
take ranks in the order they arrive, and once the expected number have arrived open a gloo
process group of their own, apart from any group their program made. :class:`SharedGroup` gives
it the interface of :class:`~fastload.distributed.group.RankGroup`, so a collective read
(:func:`~fastload.distributed.collective.read_collectively`) runs over it unchanged. Peers on
several machines (each says which: its host name, or what it is given) broadcast in two tiers,
each chunk crossing to each machine once (:mod:`fastload.distributed.tiers`).

Every wait is bounded: a process that expects another number of peers than the first arrival
stops every waiting process at once with one error saying both numbers; peers that do not all
arrive within the timeout stop each waiting process with an error saying how many came, and so
does the process serving the store leaving (a peer that gave up); a port held by a program that
is not a store fails within the timeout, naming the port. Peers that read different sources
(checkpoint URLs) stop at once when all have arrived (``[version-mismatch]``).
"""

from __future__ import annotations

import datetime
import hashlib
import io
import pickle
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from fastload.core.basics.errors import CheckpointError, FastloadIOError, RequestError
from fastload.distributed.group import RankGroup
from fastload.distributed.tiers import Tiers, gloo_group

#: seconds a process waits for its peers to arrive, by default
DEFAULT_TIMEOUT = 300.0
#: seconds between two looks at the rendezvous while peers arrive
_POLL = 0.05

_lock = threading.Lock()
#: the stores this process serves or reaches, by (host, port): a store served here lives as long
#: as the process, for the shares that come later (a reload)
_stores: dict[tuple[str, int], Any] = {}
#: the shares this process joined, by key: the n-th share of one key meets the others' n-th
_generations: Counter[str] = Counter()


@dataclass(frozen=True)
class Rendezvous:
    """Where peers meet (``host``, ``port``), how many (``peers``), and how long each waits for
    the others (``timeout`` seconds)."""

    host: str
    port: int
    peers: int
    timeout: float = DEFAULT_TIMEOUT
    #: the machine this process is on (None: its host name): peers on several machines
    #: exchange in two tiers (:mod:`fastload.distributed.tiers`)
    node: str | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def parse_address(text: object, where: str) -> tuple[str, int]:
    """``(host, port)`` of ``"host:port"`` (an IPv6 host in brackets); ``RequestError``
    otherwise, naming ``where``."""
    if not isinstance(text, str) or ":" not in text:
        raise RequestError(f"{where} must be 'host:port', got {text!r}")
    host, _, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise RequestError(f"{where} must be 'host:port' with a port from 1 to 65535, got {text!r}")
    return host, int(port)


def _is_this_host(host: str) -> bool:
    """Whether ``host`` names this machine (then this process may serve the rendezvous)."""
    try:
        wanted = {str(info[4][0]) for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    if any(a.startswith("127.") or a == "::1" for a in wanted):
        return True
    try:
        mine = {str(info[4][0]) for info in socket.getaddrinfo(socket.gethostname(), None)}
    except OSError:
        return False
    return bool(wanted & mine)


#: seconds a client's connection may take past the timeout before the port is taken to be held
#: by another program (torch's own wait for a store that is not served yet ends at the timeout)
_GRACE = 10.0


def _client(rdv: Rendezvous, timeout: datetime.timedelta) -> Any:
    """A client of the store at ``rdv``, its wait bounded: torch's client waits without limit
    for the handshake of a program that accepts connections on the port and never answers (any
    other server there); it runs on a helper thread (without the GIL), given up here after the
    timeout with an error naming the port. A client given up is left to its thread (a daemon)."""
    import torch.distributed as dist

    made: dict[str, Any] = {}

    def connect() -> None:
        try:
            made["store"] = dist.TCPStore(rdv.host, rdv.port, None, False, timeout=timeout)
        except BaseException as e:  # raised on the caller's thread
            made["error"] = e

    helper = threading.Thread(target=connect, name="fastload-rendezvous", daemon=True)
    helper.start()
    helper.join(rdv.timeout + _GRACE)
    if helper.is_alive():
        raise FastloadIOError(
            f"share_fetch: the rendezvous port {rdv.port} at {rdv.address} is held by a program "
            f"that is not a rendezvous: it took the connection but did not answer within "
            f"{rdv.timeout:g} s; give the peers a free port (share_fetch_address)"
        )
    if "error" in made:
        raise made["error"]
    return made["store"]


def _store(rdv: Rendezvous) -> Any:
    """The rendezvous' store: served by this process where the port is free on this host,
    reached over TCP otherwise (retrying until the timeout while nobody serves it yet)."""
    import torch.distributed as dist

    key = (rdv.host, rdv.port)
    with _lock:
        store = _stores.get(key)
        if store is not None:
            try:
                store.check([])  # alive (its server may have been a process that ended)
                return store
            except RuntimeError:
                _stores.pop(key, None)
        timeout = datetime.timedelta(seconds=rdv.timeout)
        if _is_this_host(rdv.host):
            try:
                store = dist.TCPStore(
                    rdv.host, rdv.port, None, True, timeout=timeout, wait_for_workers=False
                )
            except (RuntimeError, OSError):  # served by another process already
                store = None
        if store is None:
            try:
                store = _client(rdv, timeout)
            except FastloadIOError:
                raise
            except (RuntimeError, OSError) as e:
                raise FastloadIOError(
                    f"share_fetch: the rendezvous at {rdv.address} could not be reached within "
                    f"{rdv.timeout:g} s ({e}); the process on that host that serves it must be "
                    "started too"
                ) from e
        _stores[key] = store
        return store


class _Watched:
    """The rendezvous' store, its calls watched: where the process serving it stops (a peer that
    gave up waiting and exited), a call fails with the store's bare connection error; here it is
    a ``FastloadIOError`` saying how many peers had joined."""

    def __init__(self, store: Any, rdv: Rendezvous, key: str, what: str) -> None:
        self.store, self.rdv, self.key, self.what = store, rdv, key, what
        #: the peers known to have joined, as last seen
        self.arrived = 0

    def __getattr__(self, name: str) -> Any:
        call = getattr(self.store, name)

        def watched(*args: Any) -> Any:
            try:
                value = call(*args)
            except RuntimeError as e:  # torch's DistNetworkError, DistStoreError ...
                rdv = self.rdv
                raise FastloadIOError(
                    f"{self.what}: the rendezvous at {rdv.address} for {self.key} was lost "
                    f"while the peers arrived ({min(self.arrived, rdv.peers)} of {rdv.peers} "
                    "peers joined): the process serving it stopped (a peer that gave up "
                    f"waiting, or was stopped) ({e})"
                ) from e
            if name == "add":
                self.arrived = max(self.arrived, int(value))
            return value

        return watched


def join(
    rdv: Rendezvous, key: str, *, what: str = "share_fetch", source: str | None = None
) -> SharedGroup:
    """This process's place in the group of ``rdv.peers`` processes that join ``key`` at ``rdv``
    (see the module docstring). ``what``: how errors name the option. ``source``: what this
    process reads (a checkpoint's URL): peers that meet at one key with different sources stop
    at once, each with one ``CheckpointError [version-mismatch]`` naming every peer's, before
    any byte is read."""
    store = _Watched(_store(rdv), rdv, key, what)
    with _lock:
        _generations[key] += 1
        generation = _generations[key]
    prefix = f"fastload/{hashlib.sha256(key.encode()).hexdigest()[:16]}/{generation}/"
    rank = int(store.add(prefix + "arrivals", 1)) - 1
    if rank == 0:
        store.set(prefix + "peers", str(rdv.peers))
    store.set(prefix + f"node/{rank}", rdv.node or socket.gethostname())
    store.set(prefix + f"source/{rank}", source or "")
    deadline = time.monotonic() + rdv.timeout
    while True:
        refused = store.check([prefix + "refused"])
        if refused:
            raise RequestError(store.get(prefix + "refused").decode())
        if store.check([prefix + "peers"]):
            expected = int(store.get(prefix + "peers"))
            if expected != rdv.peers:
                message = (
                    f"{what}: the peers at {rdv.address} disagree on their number: the first to "
                    f"arrive expects {expected}, another {rdv.peers}; every peer must be given "
                    "the same number"
                )
                store.set(prefix + "refused", message)
                raise RequestError(message)
            if rank >= expected:
                raise RequestError(
                    f"{what}: more than the {expected} peers expected joined the rendezvous at "
                    f"{rdv.address} for {key}; this process is peer {rank + 1}"
                )
            arrived = int(store.add(prefix + "arrivals", 0))
            if arrived >= expected:
                break
        else:
            arrived = int(store.add(prefix + "arrivals", 0))
        if time.monotonic() > deadline:
            raise FastloadIOError(
                f"{what}: {min(arrived, rdv.peers)} of {rdv.peers} peers joined the rendezvous at "
                f"{rdv.address} for {key} within {rdv.timeout:g} s; the others never came (not "
                "started, stopped, or given another address, checkpoint or number of peers)"
            )
        time.sleep(_POLL)
    nodes = [store.get(prefix + f"node/{r}").decode() for r in range(rdv.peers)]
    sources = [store.get(prefix + f"source/{r}").decode() for r in range(rdv.peers)]
    if len(set(sources)) > 1:
        listed = "; ".join(f"peer {r}: {s or '(none)'}" for r, s in enumerate(sources))
        raise CheckpointError(
            f"{what}: the peers at {rdv.address} were given different checkpoints ({listed}); "
            "every peer must load one version of one checkpoint [version-mismatch]"
        )
    try:
        everyone = list(range(rdv.peers))
        plain = store.store  # torch's own store, for the groups
        group = gloo_group(plain, prefix + "gloo/", everyone, rank, rdv.timeout)
        tiers = None
        if 1 < len(set(nodes)) < rdv.peers:  # several machines, several peers on one
            tiers = Tiers(
                nodes,
                rank,
                lambda name, ranks: gloo_group(plain, f"{prefix}{name}/", ranks, rank, rdv.timeout),
            )
    except RuntimeError as e:
        raise FastloadIOError(
            f"{what}: peer {rank} of {rdv.peers} at {rdv.address} could not connect to the "
            f"others ({e})"
        ) from e
    return SharedGroup(group, rank, rdv.peers, address=rdv.address, tiers=tiers)


class _PlainValues(pickle.Unpickler):
    """Unpickles plain values only (numbers, strings, bytes, lists, tuples, dicts, sets): what
    the peers exchange. Anyone who reaches the rendezvous port can send bytes; none of them can
    make this process build an object of any class."""

    def find_class(self, module: str, name: str) -> Any:
        raise RequestError(f"share_fetch: a peer sent a {module}.{name} object; refused")


def _loads(data: bytes) -> Any:
    return _PlainValues(io.BytesIO(data)).load()


class SharedGroup(RankGroup):
    """A gloo group made by :func:`join`: a :class:`~fastload.distributed.group.RankGroup` whose
    collective calls go to the group itself (it is not registered with ``torch.distributed``'s
    default group, which the process may not have, or have for another job)."""

    def __init__(
        self, group: Any, rank: int, world_size: int, *, address: str, tiers: Tiers | None = None
    ) -> None:
        self.group = group
        #: the two-tier broadcast of peers on several machines (None: flat)
        self.tiers = tiers
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device("cpu")
        self.address = address

    def global_rank(self, rank: int) -> int:
        return rank

    def gather(self, value: Any) -> list[Any]:
        buffer = io.BytesIO()
        pickle.dump(value, buffer)
        mine = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
        try:
            sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
            self.group.allgather([sizes], [torch.tensor([mine.numel()])]).wait()
            longest = int(max(s.item() for s in sizes))
            padded = torch.zeros(longest, dtype=torch.uint8)
            padded[: mine.numel()] = mine
            out = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world_size)]
            self.group.allgather([out], [padded]).wait()
        except RuntimeError as e:
            raise self.lost(e, "the peers exchanged their state") from e
        return [
            _loads(o[: int(s.item())].numpy().tobytes()) for o, s in zip(out, sizes, strict=True)
        ]

    def send_each(self, parts: dict[int, torch.Tensor], tag: int) -> None:
        try:
            works = [self.group.send([part], r, tag) for r, part in parts.items()]
            for work in works:
                work.wait()
        except RuntimeError as e:
            raise self.lost(e, "this peer sent a chunk") from e

    def receive(self, buffer: torch.Tensor, owner: int, tag: int) -> None:
        try:
            self.group.recv([buffer], owner, tag).wait()
        except RuntimeError as e:
            raise self.lost(e, f"peer {owner} sent a chunk") from e

    def largest(self, flag: torch.Tensor) -> None:
        import torch.distributed as dist

        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MAX
        try:
            self.group.allreduce([flag], options).wait()
        except RuntimeError as e:
            raise self.lost(e, "the peers said whether they had read their chunks") from e

    def broadcast(self, buffer: torch.Tensor, owner: int) -> None:
        import torch.distributed as dist

        if self.tiers is not None:
            try:
                self.tiers.broadcast(buffer, owner)
            except RuntimeError as e:
                raise self.lost(e, f"peer {owner} sent a chunk") from e
            return
        options = dist.BroadcastOptions()
        options.rootRank = owner
        try:
            self.group.broadcast([buffer], options).wait()
        except RuntimeError as e:
            raise self.lost(e, f"peer {owner} sent a chunk") from e


__all__ = ["DEFAULT_TIMEOUT", "Rendezvous", "SharedGroup", "join", "parse_address"]
