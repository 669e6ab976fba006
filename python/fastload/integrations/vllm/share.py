"""``share_fetch``: the processes that load one checkpoint from object storage share its fetch.

An autoscaling fleet, the data-parallel replicas of one deployment and the ranks of each engine
all start the same model from the same bucket; without sharing, each process fetches what it
needs, and the bucket sends the model once per replica. With ``share_fetch``, every process that
loads the ``weights`` URL joins one group through a rendezvous of its own
(:mod:`fastload.distributed.rendezvous`: a TCP store at ``share_fetch_address``, a gloo group
apart from vLLM's), and the checkpoint is read as a collective load reads it
(:func:`~fastload.distributed.collective.read_collectively`): each process fetches about 1/N of
the bytes with the engine's ranged GETs, pinned to the version every process agreed on, and
receives the rest from the others; a failure on one stops every one with one error naming it.

``"node"`` groups the processes of one machine (the rendezvous on 127.0.0.1): the bucket sends
the model once per node. ``"world"`` groups every process on every machine: once in all, each
chunk crossing to each machine once (:mod:`fastload.distributed.tiers`).
"""

from __future__ import annotations

from typing import Any

from vllm.logger import init_logger

from fastload.distributed.rendezvous import Rendezvous, SharedGroup, join, parse_address

from .options import SHARE_PORT, VllmLoadOptions

logger = init_logger("vllm.model_executor.model_loader.fastload")


def _parallel_config() -> Any:
    """vLLM's parallel configuration of this process's engine (``None`` outside one)."""
    try:
        from vllm.config import get_current_vllm_config

        return get_current_vllm_config().parallel_config
    except (ImportError, AssertionError, AttributeError):
        return None


def rendezvous_of(options: VllmLoadOptions) -> Rendezvous:
    """Where and how many, from the options, defaulted from vLLM's parallel configuration: the
    engine's ranks (tensor times pipeline parallel) times its data-parallel replicas (those on
    this node for ``"node"``)."""
    parallel = _parallel_config()
    ranks = int(getattr(parallel, "world_size", 1) or 1)
    if options.share_fetch == "node":
        replicas = int(getattr(parallel, "data_parallel_size_local", 1) or 1)
        host = "127.0.0.1"
    else:
        replicas = int(getattr(parallel, "data_parallel_size", 1) or 1)
        host = str(getattr(parallel, "data_parallel_master_ip", "127.0.0.1") or "127.0.0.1")
    port = SHARE_PORT
    if options.share_fetch_address is not None:
        host, port = parse_address(
            options.share_fetch_address, "--model-loader-extra-config: 'share_fetch_address'"
        )
    peers = options.share_fetch_peers or ranks * replicas
    return Rendezvous(host, port, peers, options.share_fetch_timeout, options.share_fetch_node)


def share_group(options: VllmLoadOptions, url: str) -> SharedGroup | None:
    """This process's group for a fetch of ``url`` shared as ``options`` say (``None``: not
    shared, or a group of one)."""
    if options.share_fetch is None:
        return None
    rdv = rendezvous_of(options)
    if rdv.peers == 1:
        logger.warning(
            "fastload: share_fetch: this process is the only peer (one rank, one replica): it "
            "fetches the whole checkpoint; set share_fetch_peers to the number of processes "
            "loading it"
        )
        return None
    # the peers meet per scope, whatever URL each was given: one given another URL stops every
    # peer at once ([version-mismatch]) rather than wait at a rendezvous of its own
    return join(rdv, options.share_fetch, what="share_fetch", source=url)


__all__ = ["rendezvous_of", "share_group"]
