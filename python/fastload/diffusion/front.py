"""A diffusers model's load, from a class and a name to the core loader.

1. diffusers' options are sorted out (:mod:`fastload.diffusion.options`): hub arguments, the
   fastload options they map onto, config overrides; an option fastload does not serve is
   refused here, before anything is read;
2. the model's folder and weights are found (:mod:`fastload.diffusion.files`: a local directory
   or a model id, ``subfolder``, ``variant``, sharded or not);
3. the config is read by the class itself (``cls.load_config``) and the skeleton is built the way
   diffusers builds it (``cls.from_config`` with diffusers' ``no_init_weights``, parameters on
   ``meta``, under the dtype of the load);
4. the core loader (:func:`fastload.core.loading.load`) does the rest with diffusers' hooks
   (:mod:`fastload.diffusion.hooks`): every tensor allocated once on its device and dtype and
   filled by the engine.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from fastload.core.basics.errors import CheckpointError, FastloadError, RequestError, also_as
from fastload.core.loading import load
from fastload.core.model.skeleton import build_skeleton
from fastload.core.plan.load_options import LoadOptions
from fastload.core.plan.report import LoadReport
from fastload.core.plan.steps import LoadSteps
from fastload.core.plan.target import Target
from fastload.diffusion import files as filesmod
from fastload.diffusion.hooks import DiffusersHooks
from fastload.diffusion.options import split_options
from fastload.diffusion.remote import located
from fastload.distributed.steps import RANK_STEPS
from fastload.reloading.record import Remember
from fastload.training.gradient_checkpointing import gradient_checkpointing_enable

__all__ = ["load_diffusers"]

#: what fastload.distributed and fastload.training add to a load (the core imports neither)
# the record a reload needs; no model id resolver: a diffusers model is reloaded from its files
LOAD_STEPS = LoadSteps(RANK_STEPS, gradient_checkpointing_enable, Remember())

#: the fastload options that say how missing and unused tensors are reported; without them,
#: diffusers' warnings say it (fastload's own policies then neither raise nor warn)
_POLICIES = ("missing", "unexpected", "strict")


def load_diffusers(
    cls: type,
    path: str | os.PathLike[str] | None,
    *,
    config: Any,
    state_dict: Mapping[str, torch.Tensor] | None,
    given: dict[str, Any],
    kwargs: dict[str, Any],
) -> tuple[nn.Module, LoadReport]:
    """Loads diffusers model class ``cls`` from ``path`` (a local directory or a model id);
    ``given`` are the fastload options the caller passed
    (:class:`~fastload.core.plan.load_options.LoadOptions`), ``kwargs`` diffusers' options
    (:mod:`fastload.diffusion.options`) and config overrides. ``config``: a config dict to
    build the model from instead of the folder's ``config.json``; ``state_dict`` (with
    ``config`` and no ``path``): the tensors to load instead of files, copied into the model's
    own tensors (allocated once, converted as diffusers converts a file's)."""
    start = time.perf_counter()
    if config is not None and not isinstance(config, Mapping):
        raise RequestError(f"config must be a diffusers config dict, got {type(config).__name__}")
    if state_dict is not None:
        if path is not None:
            raise RequestError(f"{cls.__name__}: pass either a path or state_dict=, not both")
        if config is None:
            raise RequestError(f"{cls.__name__}: state_dict= needs config= to build the model")
    elif path is None:
        raise RequestError(
            f"{cls.__name__}: from_pretrained needs a directory, a model id or a URL"
        )
    kwargs = dict(kwargs)
    opts = split_options(kwargs)
    options = LoadOptions.create("from_pretrained", **given).with_defaults(**opts.core)
    if not set(_POLICIES) & set(given):
        options = dataclasses.replace(options, missing="init", unexpected="ignore")
    if state_dict is not None:  # the model built from config=, its tensors from the dict
        # options that say where files are have nothing to act on: refused, not ignored
        located_by = [*opts.hub, *(["subfolder"] if opts.subfolder else [])]
        located_by += ["variant"] if opts.variant is not None else []
        located_by += ["use_safetensors"] if opts.use_safetensors is not None else []
        if located_by:
            raise RequestError(
                f"{cls.__name__}: {', '.join(located_by)} locate checkpoint files, and "
                "state_dict= loads the tensors given: pass a path instead, or drop them"
            )
        cls, cfg, unused = _config(cls, None, config, kwargs)
        warn = not set(_POLICIES) & set(given)
        hooks = DiffusersHooks(name_or_path=None, sharded=False, warn=warn)
        target = Target(build=_builder(cls, cfg, unused, None), hooks=hooks)
        seconds = {"resolve": time.perf_counter() - start}
        return load(target, state_dict, options, steps=LOAD_STEPS, seconds=seconds)
    # a local folder or model id, or a URL (fastload.diffusion.remote): its config read here
    with located(path, options, opts) as found:
        cls, cfg, unused = _config(cls, found.files.folder, config, kwargs)
    hooks = DiffusersHooks(
        name_or_path=found.name,
        sharded=found.files.sharded,
        warn=not set(_POLICIES) & set(given),
    )
    target = Target(build=_builder(cls, cfg, unused, found.shown), hooks=hooks)
    seconds = {"resolve": time.perf_counter() - start}
    return load(target, found.files.weights, found.options, steps=LOAD_STEPS, seconds=seconds)


def _config(
    cls: type, folder: Any, config: Mapping[str, Any] | None, kwargs: dict[str, Any]
) -> tuple[type, dict[str, Any], dict[str, Any]]:
    """The class (a legacy class remapped as diffusers remaps it), the config and the keyword
    arguments left for ``from_config`` (config overrides, ``__init__`` arguments)."""
    if config is not None:
        cfg, unused = dict(config), dict(kwargs)
    else:
        config_file = folder / filesmod.CONFIG_NAME
        if not config_file.is_file():
            raise CheckpointError(
                f"{folder}: no {filesmod.CONFIG_NAME} there; a diffusers model is built from it"
            )
        try:
            cfg, unused = cls.load_config(  # type: ignore[attr-defined]
                os.fspath(folder), return_unused_kwargs=True, **kwargs
            )
        except FastloadError:
            raise
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{config_file}: not a diffusers config ({e})") from e
    from diffusers.models.modeling_utils import LegacyModelMixin

    if isinstance(cls, type) and issubclass(cls, LegacyModelMixin):
        from diffusers.models.model_loading_utils import _fetch_remapped_cls_from_config

        cls = _fetch_remapped_cls_from_config(cfg, cls)
    return cls, cfg, unused


def _builder(cls: type, cfg: dict[str, Any], unused: dict[str, Any], folder: Any) -> Any:
    """The skeleton's build, as diffusers builds its model: ``cls.from_config`` with its weight
    initialization off (``no_init_weights``), under the dtype of the load."""
    from diffusers.models.modeling_utils import no_init_weights

    def build(dtype: torch.dtype | None) -> nn.Module:
        try:
            return build_skeleton(
                lambda: cls.from_config(cfg, **unused),  # type: ignore[attr-defined]
                dtype=dtype,
                contexts=[no_init_weights],
            )
        except FastloadError:
            raise
        except TypeError:
            if unused:  # the caller's own keyword arguments: a wrong argument
                raise
            raise _bad_config(cls, folder) from None
        except Exception:
            raise _bad_config(cls, folder) from None

    return build


def _bad_config(cls: type, folder: Any) -> CheckpointError:
    """A ``CheckpointError`` naming the config a model cannot be built from, that is also the
    error the model's code raised (diffusers lets that one through)."""
    import sys

    error = sys.exc_info()[1]
    assert error is not None
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    error_class = also_as(CheckpointError, error)
    where = "config=" if folder is None else folder / filesmod.CONFIG_NAME
    return error_class(
        f"{where}: {cls.__name__} cannot be built from this config ({type(error).__name__}: {text})"
    )
