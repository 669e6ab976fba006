"""Every option of a load, as one typed, frozen record validated once at the entry.

:meth:`LoadOptions.create` takes the options a caller gave (by name, as
:func:`fastload.from_pretrained` spells them), checks each one and the ways they combine, and
fills in the defaults. Downstream code reads parsed values (a ``torch.device``, a dtype, resolved
policies) and never re-validates. ``given`` records which options the caller passed, so a layer
that maps other spellings onto these (another library's name for an option, an ambient device)
can tell an explicit default from an omitted option.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from fastload.core.basics.arguments import check_bool, check_folder, check_names
from fastload.core.basics.dtypes import conversion_dtype
from fastload.core.basics.engine import READ_MODES
from fastload.core.basics.errors import RequestError, UnsupportedError
from fastload.core.basics.threads import check_threads
from fastload.core.devices.checks import parse_device
from fastload.core.memory.sharing import check_mmap_mode
from fastload.core.memory.staging import StagingPool
from fastload.core.model import keys as keymod
from fastload.core.store.store_config import check_storage_options

__all__ = ["DEFAULTS", "LoadOptions", "OPTION_NAMES", "split_load_options"]

#: the flags: ``True`` or ``False`` only (truthiness would turn ``allow_pickle="no"`` on)
_FLAGS = (
    "strict",
    "ignore_mismatched_sizes",
    "progress",
    "gradient_checkpointing",
    "allow_pickle",
    "read_ahead",
)


@dataclass(frozen=True)
class LoadOptions:
    """The options of one load, parsed (see :func:`fastload.from_pretrained` for each).

    Build it with :meth:`create`; the fields hold validated values:
    """

    #: every tensor's device (unless ``device_map``)
    device: torch.device = torch.device("cpu")
    #: ``"auto"`` (decided with the model family's hooks), ``None`` (each tensor's stored dtype)
    #: or a floating dtype to convert to
    dtype: torch.dtype | str | None = "auto"
    #: the policies, after ``strict``
    missing: str = "warn"
    unexpected: str = "warn"
    ignore_mismatched_sizes: bool = False
    #: the caller's ``key_map`` compiled to one rename function
    key_map: keymod.Rename | None = None
    progress: bool = True
    gradient_checkpointing: bool = False
    read_mode: str = "pread"
    mmap: str = "auto"
    threads: int | None = None
    #: as given: resolved against the model
    #: (:func:`fastload.core.devices.resolution.resolve_device_map`)
    device_map: Any = None
    max_memory: dict[Any, int | str] | None = None
    no_split_module_classes: list[str] | None = None
    tp_plan: str | dict[str, str] | None = None
    process_group: Any = None
    allow_pickle: bool = False
    #: the staging pool's size (validated; its buffers are allocated on first use)
    staging: StagingPool = field(default_factory=StagingPool)
    offload_folder: str | None = None
    #: ``False``: no read-ahead thread beside the skeleton build
    read_ahead: bool = True
    #: options of the object store a URL checkpoint is read from, as strings
    #: (:mod:`fastload.core.store.store_config`); ``None`` for the defaults
    storage_options: Mapping[str, str] | None = None
    #: the options the caller passed, as passed (by name)
    given: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}), repr=False)

    @classmethod
    def create(cls, where: str = "from_pretrained", **given: Any) -> LoadOptions:
        """The options for the values in ``given`` (others take their defaults).

        Raises:
            TypeError: an unknown option, or a flag that is not ``True``/``False``, naming it.
            RequestError: a value that cannot be used, or options that do not combine.
            UnsupportedError: ``device_map`` with ``tp_plan``.
        """
        unknown = sorted(set(given) - set(OPTION_NAMES))
        if unknown:
            raise TypeError(f"{where}: unknown load options {unknown}")
        for name in _FLAGS:
            if name in given:
                check_bool(given[name], name, where=where)

        def get(name: str) -> Any:
            return given.get(name, DEFAULTS[name])

        device = parse_device(get("device"), where=where, allow_meta=True)
        missing, unexpected = keymod.resolve_policies(
            get("strict"), get("missing"), get("unexpected")
        )
        read_mode = get("read_mode")
        if read_mode not in READ_MODES:
            raise RequestError(f"read_mode must be one of {READ_MODES}, got {read_mode!r}")
        mmap = get("mmap")
        check_mmap_mode(mmap)
        device_map, max_memory = get("device_map"), get("max_memory")
        if max_memory is not None and device_map is None:
            device_map = "auto"  # budgets alone ask for a planned placement, as with accelerate
        tp_plan, process_group = get("tp_plan"), get("process_group")
        if device_map is not None and device != torch.device("cpu"):
            raise RequestError(f"pass either device ({device}) or device_map, not both")
        if device_map is not None and tp_plan is not None:
            raise UnsupportedError(
                "device_map and tp_plan cannot be combined; use device= with tp_plan"
            )
        if process_group is not None and device_map is not None:
            raise UnsupportedError(
                "process_group (a collective load) and device_map cannot be combined; use device="
            )
        if device.type == "meta":
            raise RequestError(f"{where}: device 'meta' holds no data to load into")
        return cls(
            device=device,
            dtype=_requested_dtype(get("dtype")),
            missing=missing,
            unexpected=unexpected,
            ignore_mismatched_sizes=get("ignore_mismatched_sizes"),
            key_map=keymod.compile_key_map(get("key_map")),
            progress=get("progress"),
            gradient_checkpointing=get("gradient_checkpointing"),
            read_mode=read_mode,
            mmap=mmap,
            # here, not only where copies start: a load of views copies nothing
            threads=check_threads(get("threads")),
            device_map=device_map,
            max_memory=max_memory,
            no_split_module_classes=check_names(
                get("no_split_module_classes"), "no_split_module_classes", where=where
            ),
            tp_plan=tp_plan,
            process_group=process_group,
            allow_pickle=get("allow_pickle"),
            staging=StagingPool.sized(get("staging_bytes")),
            offload_folder=check_folder(get("offload_folder"), "offload_folder", where=where),
            read_ahead=get("read_ahead"),
            storage_options=check_storage_options(get("storage_options"), where),
            given=MappingProxyType(dict(given)),
        )

    def with_defaults(self, where: str = "from_pretrained", **values: Any) -> LoadOptions:
        """These options, with ``values`` for the options the caller did not pass (validated as
        in :meth:`create`): how another spelling of an option (a caller's own name for it) or
        the surroundings (an ambient device) fill in what the caller left out."""
        raw = {k: v for k, v in values.items() if k not in self.given}
        if not raw:
            return self
        return LoadOptions.create(where, **self.given, **raw)

    @property
    def collective(self) -> bool:
        """Whether the ranks of a process group load together, each reading its part of the
        checkpoint (:mod:`fastload.distributed.collective`): with ``process_group``, and with
        ``tp_plan``."""
        return self.process_group is not None or self.tp_plan is not None

    @property
    def views_possible(self) -> bool:
        """Whether tensors may become views of the files' mappings: whole tensors on the CPU
        in their stored dtype (the rest of the rule is per file,
        :mod:`fastload.core.memory.sharing`)."""
        return (
            self.device.type == "cpu"
            and self.device_map is None
            and not self.collective
            and self.mmap != "copy"
        )


def _requested_dtype(dtype: Any) -> torch.dtype | str | None:
    """The requested dtype, ``"auto"`` (decided with the model's hooks) or ``None``
    (``"stored"``: each tensor's stored dtype)."""
    if isinstance(dtype, str) and dtype in ("auto", "stored"):
        return None if dtype == "stored" else "auto"
    return conversion_dtype(dtype)


#: every option :meth:`LoadOptions.create` takes, as the public entry spells it, with the value
#: it has when not given (the one table of defaults: ``from_pretrained``'s signature shows it)
DEFAULTS: dict[str, Any] = {
    "device": "cpu",
    "dtype": "auto",
    "strict": False,
    "missing": "warn",
    "unexpected": "warn",
    "ignore_mismatched_sizes": False,
    "key_map": None,
    "progress": True,
    "gradient_checkpointing": False,
    "read_mode": "pread",
    "mmap": "auto",
    "threads": None,
    "device_map": None,
    "max_memory": None,
    "no_split_module_classes": None,
    "tp_plan": None,
    "process_group": None,
    "allow_pickle": False,
    "staging_bytes": None,
    "offload_folder": None,
    "read_ahead": True,
    "storage_options": None,
}
OPTION_NAMES = tuple(DEFAULTS)


def split_load_options(kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``kwargs`` split into (load options, everything else)."""
    options = {k: v for k, v in kwargs.items() if k in OPTION_NAMES}
    rest = {k: v for k, v in kwargs.items() if k not in OPTION_NAMES}
    return options, rest
