"""Patch mode: transformers' own ``from_pretrained`` served by fastload, callers unchanged.

:func:`patch_transformers` replaces ``PreTrainedModel.from_pretrained``; every model class and
every path to it (``AutoModel*.from_pretrained`` calls it, and so do ``pipeline(model=...)`` and
``SentenceTransformer(path)``) then loads through fastload. A call fastload cannot honour (an
option it refuses, positional ``__init__`` arguments, a pickle checkpoint) goes to transformers'
own implementation, with one log line saying why. The patch is undone by
:func:`unpatch_transformers`, or at the end of ``with patch_transformers():``.

What the caller gets is what transformers returns: the model, or ``(model, loading_info)`` with
``output_loading_info=True`` where ``loading_info`` is the dict transformers returns (sets, as
transformers has them), and the load is reported on transformers' logger in its words
(:mod:`fastload.hf.contract`). The full :class:`~fastload.core.plan.report.LoadReport` of the latest
patched load is in :data:`last_report` and logged at INFO level on the ``fastload`` logger. Both
globals describe the latest patched call, never an earlier one: a call left to transformers sets
:data:`last_report` to ``None`` and :data:`last_fallback` to the reason (also logged), a call
fastload serves sets :data:`last_fallback` to ``None``, and a call whose load by fastload raises
leaves both ``None``. A component of a pipeline read from object storage
(:mod:`fastload.hf.remote_folders`) is never left to transformers, which cannot read it:
its call raises ``UnsupportedError`` naming the component, its URL and why.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any

from fastload.core.basics.errors import (
    PickleRefusedError,
    UninitializedTensorError,
    UnsupportedError,
)
from fastload.core.plan.report import LoadReport

logger = logging.getLogger("fastload")

_LOCK = threading.Lock()
_original: Any = None  # the classmethod object patched over, while patched
#: the report of the latest patched call, if fastload served it (``None`` when that call was left
#: to transformers' own loader, or raised)
last_report: LoadReport | None = None
#: why the latest patched call was left to transformers' own loader (``None`` when fastload
#: served it, or fastload's load raised an error it did not leave to transformers)
last_fallback: str | None = None


class Patch:
    """The handle :func:`patch_transformers` (and :func:`fastload.patch_diffusers`) returns; as a
    context manager it undoes the patch on exit (if this call installed it) with ``undo``."""

    def __init__(self, installed: bool, undo: Callable[[], object] | None = None) -> None:
        self.installed = installed
        self._undo = unpatch_transformers if undo is None else undo

    def __enter__(self) -> Patch:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.installed:
            self._undo()


def is_patched() -> bool:
    """Whether ``PreTrainedModel.from_pretrained`` is fastload's."""
    return _original is not None


def patch_transformers() -> Patch:
    """Routes ``transformers.PreTrainedModel.from_pretrained`` through fastload (idempotent)."""
    global _original
    from transformers.modeling_utils import PreTrainedModel

    with _LOCK:
        if _original is not None:
            return Patch(installed=False)
        _original = PreTrainedModel.__dict__["from_pretrained"]
        PreTrainedModel.from_pretrained = classmethod(_from_pretrained)  # type: ignore[assignment]
    return Patch(installed=True)


def unpatch_transformers() -> None:
    """Puts transformers' own ``from_pretrained`` back (nothing happens if it is not patched)."""
    global _original
    from transformers.modeling_utils import PreTrainedModel

    with _LOCK:
        if _original is None:
            return
        PreTrainedModel.from_pretrained = _original  # type: ignore[method-assign]
        _original = None


def _transformers_own(cls: type, name: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    original = _original if _original is not None else None
    if original is None:  # unpatched meanwhile: the class's own method is transformers'
        return cls.from_pretrained(name, *args, **kwargs)  # type: ignore[attr-defined]
    return original.__func__(cls, name, *args, **kwargs)


def _distributed() -> bool:
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_initialized())


def _from_pretrained(
    cls: type, pretrained_model_name_or_path: Any, *args: Any, **kwargs: Any
) -> Any:
    global last_report, last_fallback
    # whatever this call ends in, the globals never describe an earlier one
    last_report = None
    last_fallback = None
    if args:
        reason = "positional __init__ arguments"
    elif pretrained_model_name_or_path is None and kwargs.get("state_dict") is None:
        reason = "no model name or state_dict"
    elif not _distributed() and any(
        kwargs.get(k) is not None for k in ("tp_plan", "tp_size", "distributed_config")
    ):
        # transformers then loads an ordinary model (with its deprecation warning)
        reason = "tp_plan without an initialized torch.distributed"
    else:
        from fastload.hf.context import ambient_core_options
        from fastload.hf.contract import finish_contract
        from fastload.hf.front import load_hf

        options = dict(kwargs)
        info = bool(options.pop("output_loading_info", False))
        config = options.pop("config", None)
        state_dict = options.pop("state_dict", None)
        # transformers loads tensors of another shape re-initialized, reports them, then raises
        # unless they were to be ignored (fastload.hf.contract)
        ignore_mismatched = bool(options.get("ignore_mismatched_sizes"))
        options["ignore_mismatched_sizes"] = True
        # the ambient device and transformers' environment variables (fastload.hf.context)
        given: dict[str, Any] = ambient_core_options(options)
        try:
            model, report = load_hf(
                cls,
                pretrained_model_name_or_path,
                config=config,
                state_dict=state_dict,
                given=given,
                kwargs=options,
                contract=True,
            )
        except (UnsupportedError, PickleRefusedError, UninitializedTensorError) as e:
            # UninitializedTensorError: transformers returns such a model, that tensor left as
            # torch.empty gave it; only its own loader can give that model
            reason = str(e)
        except BaseException:  # a patched call made inside this one may have set them
            last_report, last_fallback = None, None
            raise
        else:
            logger.info(
                "fastload served %s.from_pretrained(%r)",
                cls.__name__,
                pretrained_model_name_or_path,
            )
            loading_info = finish_contract(
                model,
                pretrained_model_name_or_path,
                report,
                ignore_mismatched_sizes=ignore_mismatched,
            )
            last_report = report  # only once the call cannot raise any more
            return (model, loading_info) if info else model
    from fastload.hf.remote_folders import lookup, not_served

    remote = lookup(pretrained_model_name_or_path)
    if remote is not None:  # a pipeline's component in object storage: its folder has no weights
        raise not_served(cls, remote, reason, "transformers")
    logger.warning(
        "fastload: %s.from_pretrained(%r) is left to transformers: %s",
        cls.__name__,
        pretrained_model_name_or_path,
        reason,
    )
    last_fallback = reason
    return _transformers_own(cls, pretrained_model_name_or_path, args, kwargs)
