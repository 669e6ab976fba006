"""A diffusers pipeline read in one pass: ``DiffusionPipeline.from_pretrained`` under the patch.

diffusers loads a pipeline's components one after another (``load_sub_model``), each through its
class's ``from_pretrained``, which the patch serves (:mod:`fastload.diffusion.patch`; text
encoders through the transformers patch). Left at that, the disk would idle while each
component's skeleton is built, and each would draw a bar of its own. Instead, before diffusers
starts, this module finds the weight files of every component as diffusers will pick them
(``model_index.json``, each component's folder, the variant where that folder has it,
``use_safetensors``) and opens one :class:`~fastload.core.reads.session.LoadSession` over all of
them, in the order diffusers loads them:

* one read-ahead of the whole pipeline starts at once, within the memory the process may use (the
  files that fit the read-ahead room of :func:`~fastload.core.memory.budget.memory_budget`, in
  order), and each component's load takes its files' mappings from it;
* one progress bar over the bytes of the pipeline, in place of diffusers' bar over components
  (shown where diffusers would show its own: its progress bars on, rank 0).

What is not found here (a component in a layout diffusers reads but fastload does not look for, a
pipeline from a model id not downloaded yet, a component passed in) is simply not part of the
session: its load reads its own files, as without it. The pipeline is diffusers' own either way.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from fastload.core.basics.errors import FastloadError
from fastload.core.reads.session import LoadSession

__all__ = ["install", "one_pass", "pipeline_files", "uninstall"]

logger = logging.getLogger("fastload")

_original: Any = None  # DiffusionPipeline's own from_pretrained (a classmethod), while patched

#: options whose given value makes every component diffusers' own (nothing to read ahead)
_NOT_SERVED = ("quantization_config", "dduf_file", "use_flashpack", "use_onnx", "from_flax")


def install() -> None:
    """Routes ``DiffusionPipeline.from_pretrained`` through :func:`one_pass` (the caller holds
    the patch's lock)."""
    global _original
    from diffusers import DiffusionPipeline

    if _original is None:
        _original = DiffusionPipeline.__dict__["from_pretrained"]
        DiffusionPipeline.from_pretrained = classmethod(_from_pretrained)  # type: ignore[assignment]


def uninstall() -> None:
    """Puts diffusers' own ``DiffusionPipeline.from_pretrained`` back."""
    global _original
    from diffusers import DiffusionPipeline

    if _original is not None:
        DiffusionPipeline.from_pretrained = _original  # type: ignore[method-assign]
        _original = None


def _from_pretrained(cls: type, pretrained_model_name_or_path: Any, **kwargs: Any) -> Any:
    original = _original
    if original is None:  # unpatched meanwhile
        return cls.from_pretrained(pretrained_model_name_or_path, **kwargs)  # type: ignore[attr-defined]
    with one_pass(cls, pretrained_model_name_or_path, kwargs):
        return original.__func__(cls, pretrained_model_name_or_path, **kwargs)


@contextmanager
def one_pass(cls: type, name: Any, kwargs: dict[str, Any]) -> Iterator[LoadSession | None]:
    """The session the components of pipeline ``name`` (a local directory) load in, with
    diffusers' own bar over components hidden while fastload's bar over bytes is shown; no
    session (``None``) where there is nothing to read ahead."""
    components = _component_files(name, kwargs)
    files = [f for _, found in components for f in found]
    if not files:
        yield None
        return
    from diffusers.utils import logging as diffusers_logging

    shown = diffusers_logging.is_progress_bar_enabled() and _rank_zero()
    label = getattr(cls, "__name__", "pipeline")
    if label == "DiffusionPipeline":
        label = _class_name(Path(os.fspath(name))) or label
    dtypes = _load_dtypes(components, kwargs)
    with LoadSession(files, progress=shown, desc=f"fastload: {label}", dtypes=dtypes) as session:
        hide = session.drawn and diffusers_logging.is_progress_bar_enabled()
        if hide:
            diffusers_logging.disable_progress_bar()
        try:
            yield session
        finally:
            if hide:
                diffusers_logging.enable_progress_bar()


def pipeline_files(name: Any, kwargs: dict[str, Any]) -> list[Path]:
    """The safetensors files of the components of the pipeline in directory ``name`` that
    diffusers will load with ``kwargs``, in the order it loads them; ``[]`` for anything else."""
    return [f for _, found in _component_files(name, kwargs) for f in found]


def _load_dtypes(
    components: list[tuple[str, list[Path]]], kwargs: dict[str, Any]
) -> dict[str | os.PathLike[str], torch.dtype]:
    """The dtype each file's load will ask for, where diffusers' call says it: ``dtype`` (or
    ``torch_dtype``), one for all components or a dict by component (``"default"``: the rest,
    float32 where absent), as diffusers hands it to each component. The session maps ahead the
    files stored in it, whose tensors will be views; nothing is said for loads onto a device
    (``device_map``) or left to diffusers (``low_cpu_mem_usage=False``), whose tensors are not."""
    given = kwargs.get("dtype", kwargs.get("torch_dtype"))
    if given is None or kwargs.get("device_map") is not None:
        return {}
    if kwargs.get("low_cpu_mem_usage") is False:
        return {}
    out: dict[str | os.PathLike[str], torch.dtype] = {}
    for component, found in components:
        want = (
            given.get(component, given.get("default", torch.float32))
            if isinstance(given, dict)
            else given
        )
        if isinstance(want, torch.dtype):
            out.update(dict.fromkeys(found, want))
    return out


def _component_files(name: Any, kwargs: dict[str, Any]) -> list[tuple[str, list[Path]]]:
    """:func:`pipeline_files` by component: ``(component, its files)`` in the order of their
    names, the order they load in under the patch."""
    if not isinstance(name, (str, os.PathLike)) or any(kwargs.get(k) for k in _NOT_SERVED):
        return []
    if kwargs.get("use_safetensors") is False or kwargs.get("custom_pipeline") is not None:
        return []
    root = Path(os.fspath(name))
    try:
        config = json.loads((root / "model_index.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []  # a model id, or not a pipeline: diffusers says what it is
    if not isinstance(config, dict):
        return []
    from diffusers.pipelines.pipeline_loading_utils import _identify_model_variants

    variant = kwargs.get("variant")
    try:
        variants = _identify_model_variants(folder=os.fspath(root), variant=variant, config=config)
    except (OSError, IndexError):
        return []
    out: list[tuple[str, list[Path]]] = []
    seen: set[Path] = set()
    # the order the components load in under the patch: their names'
    # (fastload.diffusion.remote_pipeline; diffusers alone iterates a set)
    for component, value in sorted(config.items()):
        if component.startswith("_") or not isinstance(value, (list, tuple)) or len(value) != 2:
            continue
        if value[0] is None or component in kwargs or not (root / component).is_dir():
            continue
        found = [
            f for f in _weights(root, component, variants.get(component), kwargs) if f not in seen
        ]
        seen.update(found)
        if found:
            out.append((component, found))
    return out


def _weights(root: Path, component: str, variant: str | None, kwargs: dict[str, Any]) -> list[Path]:
    """The safetensors files of one component (a diffusers model's names, then a transformers
    model's), as its loader will pick them; ``[]`` where it has none (a scheduler, a tokenizer)."""
    from fastload.diffusion import files as filesmod
    from fastload.hf import hub as hubmod

    use = kwargs.get("use_safetensors")
    weights: Path | None = None
    for find in (
        lambda: filesmod.resolve(root, hub={}, subfolder=component, variant=variant).weights,
        lambda: (
            hubmod.resolve_checkpoint(
                root, hub={}, subfolder=component, variant=variant, use_safetensors=use
            ).weights
        ),
    ):
        try:
            weights = find()
        except (FastloadError, OSError, ValueError):
            continue
        break
    if weights is None:
        return []
    from fastload.core.checkpoint.files import resolve

    try:  # the files of a single file, an index, or a directory (the core's own choice there)
        found = resolve(weights)
    except (FastloadError, OSError, ValueError):
        return []  # pickle weights, a broken index: their loader reads or reports them
    return [f for f in found.files if f.name.endswith(".safetensors")]


def _class_name(root: Path) -> str | None:
    try:
        name = json.loads((root / "model_index.json").read_text(encoding="utf-8"))["_class_name"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return name if isinstance(name, str) else None


def _rank_zero() -> bool:
    """Whether this process draws bars, as diffusers decides (rank 0 of a distributed run)."""
    try:
        import torch.distributed as dist

        return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    except (ImportError, RuntimeError):
        return True
