"""Which transformers class to build: a class given, an Auto class, or ``config.json``'s
``architectures``; and the config to build it from.

``architectures`` comes from a file, so it is resolved only to a transformers ``PreTrainedModel``
subclass (never to any attribute the file names, such as ``Trainer``); code of the repository
(``auto_map``) runs only with ``trust_remote_code=True``, as in transformers.
"""

from __future__ import annotations

import copy
import logging
import os
import sys
from pathlib import Path
from typing import Any

from fastload.core.basics import json_text
from fastload.core.basics.errors import CheckpointError, UnsupportedError
from fastload.families import is_transformers_model

logger = logging.getLogger("fastload")


def is_auto_class(obj: Any) -> bool:
    """Whether ``obj`` is a transformers Auto model class (``AutoModelForCausalLM``...)."""
    factory = sys.modules.get("transformers.models.auto.auto_factory")
    return (
        factory is not None
        and isinstance(obj, type)
        and issubclass(obj, factory._BaseAutoModelClass)
    )


def _config_error(where: Path | str, error: Exception) -> Exception:
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if "trust_remote_code" in str(error):
        return UnsupportedError(
            f"{where}: the config needs code from the repository; pass trust_remote_code=True "
            f"to run it ({text})"
        )
    return CheckpointError(
        f"{where}: cannot read the model config ({type(error).__name__}: {text})"
    )


def load_config(
    config_class: Any,
    source: str | os.PathLike[str],
    kwargs: dict[str, Any],
    **options: Any,
) -> tuple[Any, dict[str, Any]]:
    """``config_class.from_pretrained(source, return_unused_kwargs=True, **kwargs)``: the config
    with the overrides that are config attributes, and the rest (``__init__`` arguments)."""
    where = Path(os.fspath(source))
    if where.is_dir() and not (where / "config.json").is_file():
        raise CheckpointError(f"{where}: no config.json to build the model from; pass config=")
    try:
        cfg, unused = config_class.from_pretrained(
            os.fspath(source), return_unused_kwargs=True, **options, **kwargs
        )
    except Exception as e:  # an untrusted file: any failure to read it is a bad config
        raise _config_error(where / "config.json" if where.is_dir() else where, e) from e
    return cfg, unused


def resolve_class(
    model: Any,
    config: Any,
    source: str | os.PathLike[str],
    kwargs: dict[str, Any],
    *,
    trust_remote_code: bool,
    code_revision: str | None,
) -> tuple[type, Any, dict[str, Any]]:
    """The model class, its config and the ``__init__`` keyword arguments, for ``model`` a
    transformers class, an Auto class or ``None`` (``architectures``). ``config`` is a config
    object, a path, or ``None`` (``source``'s ``config.json``)."""
    named = config if isinstance(config, (str, os.PathLike)) else source
    where = Path(os.fspath(named)) if isinstance(named, (str, os.PathLike)) else Path("config")
    if model is None:
        model = _architecture_class(config, where, source, trust_remote_code, code_revision)
    if is_transformers_model(model):
        config_class = model.config_class
        if config is None or isinstance(config, (str, os.PathLike)):
            cfg, init_kwargs = load_config(config_class, config or source, kwargs)
        else:
            cfg, init_kwargs = copy.deepcopy(config), dict(kwargs)
        return model, cfg, init_kwargs
    from transformers import AutoConfig

    if config is None or isinstance(config, (str, os.PathLike)):
        remote = {"trust_remote_code": trust_remote_code, "code_revision": code_revision}
        cfg, init_kwargs = load_config(AutoConfig, config or source, kwargs, **remote)
    else:
        cfg, init_kwargs = copy.deepcopy(config), dict(kwargs)
    cls = _auto_class(model, cfg, where, source, trust_remote_code, code_revision)
    if getattr(cls, "config_class", None) is not None and not isinstance(cfg, cls.config_class):
        # an Auto class mapping a composite config to its text model (as transformers does)
        text = getattr(cfg, "get_text_config", None)
        if callable(text) and isinstance(text(), cls.config_class):
            cfg = text()
    return cls, cfg, init_kwargs


def _remote_class(
    class_ref: str, source: str | os.PathLike[str], trust: bool, code_revision: str | None
) -> type:
    if not trust:
        raise UnsupportedError(
            f"{source}: the model class {class_ref!r} is code from the repository (auto_map); "
            "pass trust_remote_code=True to run it"
        )
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    cls: type = get_class_from_dynamic_module(
        class_ref, os.fspath(source), code_revision=code_revision
    )
    return cls


def _auto_class(
    auto: Any,
    cfg: Any,
    where: Path,
    source: str | os.PathLike[str],
    trust: bool,
    code_revision: str | None,
) -> type:
    auto_map = getattr(cfg, "auto_map", None) or {}
    mapping = auto._model_mapping
    has_local = type(cfg) in mapping
    if auto.__name__ in auto_map and (trust or not has_local):
        return _remote_class(auto_map[auto.__name__], source, trust, code_revision)
    if not has_local:
        raise UnsupportedError(
            f"{where}: {auto.__name__} has no model class for the config "
            f"{type(cfg).__name__} (model_type {getattr(cfg, 'model_type', None)!r})"
        )
    from transformers.models.auto.auto_factory import _get_model_class

    cls: type = _get_model_class(cfg, mapping)
    return cls


def _architectures(config: Any, where: Path) -> tuple[str, dict[str, Any]]:
    """``architectures[0]`` and ``auto_map`` of a config object or ``config.json``."""
    if config is not None and not isinstance(config, (str, os.PathLike)):
        data = {k: getattr(config, k, None) for k in ("architectures", "auto_map")}
    else:
        path = where / "config.json" if where.is_dir() else where
        try:
            if path.exists() and not path.is_file():  # a FIFO would block the read
                raise OSError("not a regular file [not-regular-file]")
            data = json_text.loads(path.read_text(encoding="utf-8"), path)  # depth-checked
        except (OSError, ValueError) as e:
            raise CheckpointError(
                f"{path}: cannot tell the model class (no readable 'architectures' entry: {e}); "
                "pass the model class (or an Auto class) to from_pretrained"
            ) from e
        where = path
    architectures = data.get("architectures") if isinstance(data, dict) else None
    if not isinstance(architectures, (list, tuple)) or not architectures:
        raise CheckpointError(
            f"{where}: cannot tell the model class (no 'architectures' entry); pass the model "
            "class (or an Auto class) to from_pretrained"
        )
    name = architectures[0]
    if not isinstance(name, str):
        raise CheckpointError(f"{where}: 'architectures' names {name!r}, not a class name")
    auto_map = data.get("auto_map")
    return name, auto_map if isinstance(auto_map, dict) else {}


def _architecture_class(
    config: Any,
    where: Path,
    source: str | os.PathLike[str],
    trust: bool,
    code_revision: str | None,
) -> type:
    name, auto_map = _architectures(config, where)
    for class_ref in auto_map.values():
        ref = class_ref[0] if isinstance(class_ref, (list, tuple)) else class_ref
        if isinstance(ref, str) and ref.rpartition(".")[2] == name:
            return _remote_class(ref, source, trust, code_revision)
    import transformers

    try:
        cls = getattr(transformers, name, None)
    except Exception:  # transformers' lazy module raises for names it cannot import
        cls = None
    if not isinstance(cls, type) or not is_transformers_model(cls):
        raise UnsupportedError(
            f"{where}: 'architectures' names {name!r}, which is not a transformers model class "
            "(a PreTrainedModel subclass); pass the model class to from_pretrained"
        )
    return cls
