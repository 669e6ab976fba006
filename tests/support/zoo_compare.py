"""One zoo cell: a checkpoint loaded into a class by transformers and by fastload, compared.

:func:`load_pair` loads with transformers' ``from_pretrained`` and with fastload (its direct API,
or transformers' own call under ``fastload.patch_transformers()``), keeping what each returned or
raised; :func:`assert_loads_alike` compares the two: the same error, or the same tensor names,
parameter/buffer roles, dtypes, bitwise values, tie groups, non-persistent buffers, outputs and
loading info (missing, unexpected and mismatched names as transformers lists them).

Where fastload differs from transformers on purpose (README, "Deliberate differences"), the
comparison checks that the difference is exactly the documented one and returns its name, so the
sweep counts it apart from equal cells:

* ``"refuses a checkpoint none of whose names matches"`` (direct API): transformers loads nothing
  and initializes the whole model; fastload raises ``CheckpointError``;
* ``"unplanned conversion <Op>"`` (direct API): transformers reorders stored values with a
  conversion fastload does not plan; fastload raises ``UnsupportedError`` naming it;
* ``"keeps stored values transformers' init overwrites"`` (direct API): transformers' init
  functions write into loaded tensors where its loaded-flag does not reach (Funnel zeroes
  ``word_embeddings`` at ``pad_token_id`` through a view; Zaya sets ``balancing_biases[-1]``);
  fastload keeps what is stored (checked against the saved model, or zeroed rows);
* ``"refuses a tensor nothing initializes"`` (direct API): a tensor the checkpoint lacks and
  nothing initializes (a weight norm's ``original0`` computed on ``meta``) is an
  ``UninitializedTensorError``; transformers returns it uninitialized (NaN here);
* ``"refuses two checkpoint tensors for one model tensor"`` (direct API): transformers loads the
  first in its order; fastload raises ``CheckpointError`` naming both;
* ``"loads each tensor back where it was saved from"`` (direct API): transformers adds the
  base-model prefix to a name the model also has without it, and so swaps two tensors of its own
  save (Pixio's ``layernorm`` and ``pixio.layernorm``); checked against the saved model;
* ``"keeps an integer tensor's dtype"`` (direct API): transformers casts every tensor of a
  module kept in float32 under a float16/bfloat16 ``dtype`` to float32, an integer one too
  (BatchNorm's ``num_batches_tracked`` in Granite Speech's ``conv.norm``);
* ``"keeps the constructor value transformers leaves uninitialized"``: a tensor no init function
  covers is whatever ``torch.empty`` gave in transformers (NaN here: its loads run in
  deterministic mode, which fills fresh memory with NaN); fastload keeps the value ``__init__``
  gave it. Uninitialized memory is no contract, so this one stands under the patch too.

Under the patch every other one must be equal.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tensor_samples import raw_bytes
from tiny_models import model_tensors, outputs_of
from torch import nn
from zoo_models import example_inputs, model_class

import fastload
from fastload.core.model.tying import find_tie_groups

#: the conversions fastload plans as reads (fastload.hf.conversions)
PLANNED_CONVERSIONS = ("MergeModulelist", "Concatenate", "Chunk", "Split")
#: the loading-info entries that hold names
NAME_ENTRIES = ("missing_keys", "unexpected_keys", "mismatched_keys")


@dataclass
class Loaded:
    """What one loader gave: a model and its loading info, or an error."""

    model: nn.Module | None = None
    info: dict[str, Any] = field(default_factory=dict)
    error: BaseException | None = None
    #: under the patch: whether fastload served the call (else transformers' own loader did)
    served: bool = True
    #: whether ``info`` is the loader's (transformers' decision models cannot return it)
    info_known: bool = True


def _bare(error: BaseException) -> BaseException:
    """``error`` without its traceback and chained errors (their frames hold whole models)."""
    error.__context__ = error.__cause__ = None
    return error.with_traceback(None)


def _transformers(cls: type, directory: Path, kwargs: dict[str, Any]) -> Loaded:
    # Deterministic mode fills the memory torch.empty hands out with NaN: a tensor transformers
    # leaves uninitialized shows as NaN instead of passing for a value.
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        return _from_pretrained(cls, directory, kwargs)
    finally:
        torch.use_deterministic_algorithms(deterministic)


def _from_pretrained(cls: type, directory: Path, kwargs: dict[str, Any]) -> Loaded:
    """``cls.from_pretrained`` with its loading info, or its error."""
    try:
        model, info = cls.from_pretrained(directory, output_loading_info=True, **kwargs)
    except Exception as e:  # noqa: BLE001 - compared with the other loader's error
        try:  # a class whose own from_pretrained breaks on output_loading_info (DecisionMixin)
            model = cls.from_pretrained(directory, **kwargs)
        except Exception:  # noqa: BLE001
            return Loaded(error=_bare(e))
        return Loaded(model.eval(), info_known=False)
    return Loaded(model.eval(), info)


def _fastload(cls: type, directory: Path, kwargs: dict[str, Any], patched: bool) -> Loaded:
    if not patched:
        try:
            model, report = fastload.from_pretrained(
                cls, directory, output_loading_info=True, progress=False, **kwargs
            )
        except Exception as e:  # noqa: BLE001 - compared with transformers'
            return Loaded(error=_bare(e))
        return Loaded(model, report.to_dict())
    import fastload.hf.patch as patch

    with fastload.patch_transformers():
        loaded = _from_pretrained(cls, directory, kwargs)
    # each patched call sets it anew: None when the call was left to transformers
    loaded.served = patch.last_report is not None
    return loaded


def load_pair(
    class_name: str, directory: Path, *, patched: bool = False, **kwargs: Any
) -> tuple[Loaded, Loaded]:
    """(fastload's load, transformers' load) of ``directory`` into ``class_name``."""
    cls = model_class(class_name)
    theirs = _transformers(cls, directory, kwargs)
    ours = _fastload(cls, directory, kwargs, patched)
    return ours, theirs


def _ties(model: nn.Module) -> set[frozenset[str]]:
    return {frozenset(g) for g in find_tie_groups(model)}


def _initialized_alike(name: str, ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """What initialization decides regardless of the random stream: constants and zero rows."""
    if theirs.numel() == 0 or not theirs.is_floating_point():
        return
    assert not torch.isnan(ours).any(), f"{name}: left uninitialized"
    flat = theirs.float().flatten()
    if flat.numel() > 1 and bool((flat == flat[0]).all()):
        assert torch.equal(ours, theirs), f"{name}: transformers gives the constant {flat[0]}"
        return
    if theirs.dim() == 2:
        zero_rows = (theirs == 0).all(dim=1)
        assert torch.equal((ours[zero_rows] == 0).all(dim=1), zero_rows[zero_rows]), (
            f"{name}: rows {zero_rows.nonzero().flatten().tolist()} are zero in transformers"
        )


def _uninitialized(tensor: torch.Tensor) -> bool:
    """Whether a tensor is all NaN: memory transformers left uninitialized (filled with NaN
    because its load runs in deterministic mode, :func:`_transformers`)."""
    return tensor.is_floating_point() and tensor.numel() > 0 and bool(tensor.isnan().all())


def _zeroed_rows_only(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    """Whether the tensors differ only in rows transformers zeroed (``ours`` non-zero there)."""
    if ours.dim() != 2 or ours.shape != theirs.shape:
        return False
    differ = (ours != theirs).any(dim=1)
    zero = (theirs == 0).all(dim=1)
    return bool(differ.any()) and bool((zero[differ]).all())


def _names(info: dict[str, Any], entry: str) -> set[Any]:
    return {tuple(x) if isinstance(x, list) else x for x in info.get(entry) or ()}


def assert_info_alike(ours: Loaded, theirs: Loaded, *, whole: bool = False) -> None:
    """The same missing, unexpected and mismatched names (``whole``: every entry of the dict)."""
    entries = sorted(set(ours.info) | set(theirs.info)) if whole else NAME_ENTRIES
    for entry in entries:
        a, e = _names(ours.info, entry), _names(theirs.info, entry)
        assert a == e, (
            f"loading info {entry!r}: only fastload lists {sorted(map(str, a - e))[:8]}, "
            f"only transformers lists {sorted(map(str, e - a))[:8]}"
        )


def _held(tensors: dict[str, torch.Tensor], name: str, prefix: str) -> torch.Tensor | None:
    """The saved model's tensor loaded into model tensor ``name``: the same name, or the name
    with the base-model prefix taken off or put on."""
    dotted = f"{prefix}." if prefix else ""
    for candidate in (name, name.removeprefix(dotted) if dotted else name, dotted + name):
        if candidate in tensors:
            return tensors[candidate]
    return None


def _kept_saved(
    name: str, got: torch.Tensor, expected: torch.Tensor, saved: Any, prefix: str
) -> str | None:
    """The documented difference, if fastload's tensor is the one the saved model held there
    and transformers' is not (``saved``: a builder of the model that wrote the checkpoint): a
    tensor of the saved model transformers put there instead, or values its init overwrote."""
    if saved is None:
        return None
    tensors = model_tensors(saved())
    held = _held(tensors, name, prefix)
    if held is None or held.shape != got.shape or held.dtype.is_floating_point is False:
        return None
    if not torch.equal(got, held.to(got.dtype)) or torch.equal(expected, held.to(expected.dtype)):
        return None
    others = (t for n, t in tensors.items() if t.shape == expected.shape and n != name)
    if any(torch.equal(expected, t.to(expected.dtype)) for t in others):
        return "loads each tensor back where it was saved from"
    return "keeps stored values transformers' init overwrites"


def _same_subclass(name: str, got: torch.Tensor, expected: torch.Tensor) -> bool:
    """For a tensor subclass (torchao's ``Int8Tensor``, ``Float8Tensor``): the same class, the
    same attributes and the same inner tensors bitwise; ``False`` for a plain tensor."""
    flatten = getattr(expected, "__tensor_flatten__", None)
    if flatten is None:
        return False
    assert type(got) is type(expected), f"{name}: {type(got).__name__}, not {type(expected)}"
    inner, attributes = flatten()
    assert got.__tensor_flatten__() == (inner, attributes), f"{name}: attributes differ"
    for part in inner:
        mine, theirs = getattr(got, part), getattr(expected, part)
        assert (mine.dtype, mine.shape) == (theirs.dtype, theirs.shape), f"{name}.{part}"
        assert torch.equal(raw_bytes(mine), raw_bytes(theirs)), f"{name}.{part}"
    return True


def _compare_tensors(
    ours: nn.Module, theirs: nn.Module, missing: set[str], saved: Any = None
) -> list[str]:
    """Names, roles, dtypes, values (bitwise, except tensors both initialize), ties; returns
    the documented differences found."""
    a, e = model_tensors(ours), model_tensors(theirs)
    assert sorted(a) == sorted(e), f"names differ: {sorted(set(a) ^ set(e))[:10]}"
    params = {n for n, _ in ours.named_parameters(remove_duplicate=False)}
    assert params == {n for n, _ in theirs.named_parameters(remove_duplicate=False)}
    # missing, or declared missing by the class (transformers lists neither): both initialize them
    declared = getattr(theirs, "_keys_to_ignore_on_load_missing", None) or ()
    initialized = set(missing) | {n for n in e if any(re.search(p, n) for p in declared)}
    for group in find_tie_groups(theirs):
        if initialized & set(group):
            initialized |= set(group)
    differences = []
    prefix = getattr(theirs, "base_model_prefix", "") or ""
    for name, expected in e.items():
        got = a[name]
        assert got.shape == expected.shape, f"{name}: shape {got.shape} != {expected.shape}"
        if _same_subclass(name, got, expected):
            continue
        if not got.is_floating_point() and expected.dtype == torch.float32:
            # transformers casts every tensor of a module kept in float32 (README: deliberate
            # differences), an integer counter included
            assert torch.equal(got.float(), expected), f"{name}: values differ"
            differences.append("keeps an integer tensor's dtype")
            continue
        assert got.dtype == expected.dtype, f"{name}: dtype {got.dtype} != {expected.dtype}"
        assert got.device.type != "meta", f"{name}: left on meta"
        if _uninitialized(expected):
            # transformers leaves it as torch.empty gave it; fastload keeps the value __init__
            # gave it (README: deliberate differences)
            assert not _uninitialized(got), f"{name}: left uninitialized"
            differences.append("keeps the constructor value transformers leaves uninitialized")
        elif name in initialized:
            _initialized_alike(name, got, expected)
        elif not torch.equal(got, expected):
            kept = _kept_saved(name, got, expected, saved, prefix)
            if kept is None and _zeroed_rows_only(got, expected):
                kept = "keeps stored values transformers' init overwrites"
            if kept is not None:
                differences.append(kept)
                continue
            raise AssertionError(
                f"{name}: values differ (max {(got.double() - expected.double()).abs().max()})"
            )
    assert _ties(ours) == _ties(theirs), "tie groups differ"
    return sorted(set(differences))


def _compare_outputs(ours: nn.Module, theirs: nn.Module) -> None:
    """Outputs of bitwise-equal tensors are compared bitwise, with a rounding-level tolerance
    as a fallback: kernels may round differently by memory alignment (transformers' tensors can
    be views of a mapped shard file at any offset)."""
    inputs = example_inputs(theirs)
    if inputs is None:
        return
    try:
        torch.manual_seed(0)  # forwards that draw random numbers (ViTMAE's masking)
        expected = outputs_of(theirs, inputs)
        torch.manual_seed(0)
        again = outputs_of(theirs, inputs)
    except Exception:  # noqa: BLE001 - transformers' own forward fails: nothing to compare
        return
    if len(again) != len(expected) or not all(map(torch.equal, again, expected)):
        return  # a forward that differs from itself (FastSpeech2-Conformer's): not comparable
    torch.manual_seed(0)
    got = outputs_of(ours, inputs)
    assert len(got) == len(expected)
    for i, (x, y) in enumerate(zip(got, expected, strict=True)):
        if not torch.equal(x, y):
            torch.testing.assert_close(x, y, msg=f"output {i} differs")


def _unplanned_conversion(ours: Loaded) -> str | None:
    """The deliberate difference of fastload's direct API refusing a conversion it does not
    plan (whatever transformers makes of it), if that is the error."""
    if isinstance(ours.error, fastload.UnsupportedError):
        found = re.search(r"needs transformers' (\w+) conversion", str(ours.error))
        if found is not None and found.group(1) not in PLANNED_CONVERSIONS:
            return f"unplanned conversion {found.group(1)}"
    return None


def _documented_refusal(ours: Loaded, theirs: Loaded) -> str | None:
    """The deliberate difference fastload's direct API refusing a load where transformers
    loads is, if it is one."""
    text = str(ours.error)
    if _unplanned_conversion(ours) is not None:
        return _unplanned_conversion(ours)
    if isinstance(ours.error, fastload.CheckpointError) and "none of its" in text:
        assert theirs.model is not None
        # what transformers loaded: neither missing nor missing by the class's own declaration
        declared = getattr(theirs.model, "_keys_to_ignore_on_load_missing", None) or ()
        loaded = {
            k
            for k in set(theirs.model.state_dict()) - _names(theirs.info, "missing_keys")
            if not any(re.search(p, k) for p in declared)
        }
        assert not loaded, f"fastload refuses, but transformers loads {sorted(loaded)[:8]}"
        return "refuses a checkpoint none of whose names matches"
    # (getattr: the sweep also runs against fastload versions before this error class)
    if isinstance(ours.error, getattr(fastload, "UninitializedTensorError", ())):
        assert theirs.model is not None
        name = text.split(":", 1)[0]
        assert _uninitialized(model_tensors(theirs.model)[name]), f"transformers initializes {name}"
        return "refuses a tensor nothing initializes"
    if isinstance(ours.error, fastload.CheckpointError) and "both map to model tensor" in text:
        return "refuses two checkpoint tensors for one model tensor"
    return None


def assert_loads_alike(
    ours: Loaded, theirs: Loaded, *, patched: bool = False, saved: Any = None
) -> list[str]:
    """Both raise the same error, or both load the same model; returns the documented
    differences (none under the patch). ``saved`` builds the model that wrote the checkpoint,
    where it is of the loaded class: a tensor transformers does not load back where it was saved
    from is checked against it."""
    if theirs.error is not None:
        assert ours.error is not None, (
            f"transformers raises {type(theirs.error).__name__}: {str(theirs.error)[:300]}; "
            "fastload loads"
        )
        if isinstance(ours.error, type(theirs.error)):
            return []
        documented = None if patched else _unplanned_conversion(ours)
        assert documented is not None, (
            f"transformers raises {type(theirs.error).__name__}: {str(theirs.error)[:200]}; "
            f"fastload raises {type(ours.error).__name__}: {str(ours.error)[:200]}"
        )
        return [documented]
    if ours.error is not None:
        documented = None if patched else _documented_refusal(ours, theirs)
        if documented is None:
            raise ours.error
        return [documented]
    assert ours.model is not None and theirs.model is not None
    known = theirs if theirs.info_known else ours  # what both initialized
    missing = _names(known.info, "missing_keys")
    differences = _compare_tensors(ours.model, theirs.model, missing, None if patched else saved)
    if theirs.info_known:
        assert_info_alike(ours, theirs, whole=patched)
    if patched:
        contract = [d for d in differences if "uninitialized" not in d]
        assert not contract, f"under the patch: {contract}"
    if not differences and not known.info.get("missing_keys"):
        _compare_outputs(ours.model, theirs.model)
    return differences
