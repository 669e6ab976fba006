"""Mapping checkpoint tensor names onto model tensor names, and the key policies.

A checkpoint name goes through, in order: the caller's ``key_map``; the model family's own
renamings (its hooks' ``renames``, e.g. those registered for the architecture); the legacy
``gamma``/``beta`` -> ``weight``/``bias`` rename; and the base-model prefix, added or stripped so
that a base model's checkpoint loads into the model with a head on it and back. Legacy renames
and prefix changes are only applied when they turn a name the model lacks into one it has.

The policies decide what happens to names left over: *missing* model tensors (``"error"``,
``"warn"``, ``"init"``) and *unexpected* checkpoint tensors (``"error"``, ``"warn"``,
``"ignore"``). Names the model class declares as expected
(``_keys_to_ignore_on_load_missing`` / ``_keys_to_ignore_on_load_unexpected``), and checkpoint
tensors of a layer the model deliberately does not build (an attribute set to ``None``, like a
pooler a model with a head leaves out), are *authorized*: handled silently.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from torch import nn

from fastload.core.basics import json_text
from fastload.core.basics.errors import CheckpointError, RequestError

#: the metadata key under which fastload's saver records the names of tied tensors it stores
#: once (``{alias: canonical name}``)
TIED_KEY = "fastload.tied"

logger = logging.getLogger("fastload")

MISSING_POLICIES = ("error", "warn", "init")
UNEXPECTED_POLICIES = ("error", "warn", "ignore")

KeyMap = Callable[[str], str] | Mapping[str, str]
Rename = Callable[[str], str]

_LEGACY = {"gamma": "weight", "beta": "bias"}


def within(prefix: str, name: str) -> bool:
    """Whether the dotted name ``name`` is ``prefix`` or inside it (``""`` contains every name):
    ``"layers.1"`` contains ``"layers.1.mlp.weight"``, not ``"layers.10.mlp.weight"``."""
    return prefix == "" or name == prefix or name.startswith(prefix + ".")


def resolve_policies(strict: bool, missing: str, unexpected: str) -> tuple[str, str]:
    """Validates the policy values; ``strict=True`` turns both into ``"error"``."""
    if missing not in MISSING_POLICIES:
        raise RequestError(f"missing must be one of {MISSING_POLICIES}, got {missing!r}")
    if unexpected not in UNEXPECTED_POLICIES:
        raise RequestError(f"unexpected must be one of {UNEXPECTED_POLICIES}, got {unexpected!r}")
    if strict:
        return "error", "error"
    return missing, unexpected


def compile_key_map(key_map: KeyMap | None) -> Rename | None:
    """A rename function from a user ``key_map``.

    A callable is used as is (it must return a ``str``). A mapping is ``{regex: replacement}``;
    each pattern is applied in order with :func:`re.sub`, so one name can be changed by several.
    """
    if key_map is None:
        return None
    if callable(key_map):
        fn = key_map

        def checked(name: str) -> str:
            out = fn(name)
            if not isinstance(out, str):
                raise RequestError(f"key_map returned {out!r} for {name!r}; it must return a str")
            return out

        return checked
    if isinstance(key_map, Mapping):
        try:
            rules = [(re.compile(p), r) for p, r in key_map.items()]
        except re.error as e:
            raise RequestError(f"key_map has an invalid regular expression: {e}") from e

        def apply(name: str) -> str:
            for pattern, replacement in rules:
                name = pattern.sub(replacement, name)
            return name

        return apply
    raise RequestError(
        f"key_map must be a callable or a dict of regex -> replacement, got {key_map!r}"
    )


@dataclass
class KeyMapping:
    """The outcome of mapping checkpoint names onto the model's names."""

    # checkpoint name -> model name, for every checkpoint tensor that lands in the model
    to_model: dict[str, str] = field(default_factory=dict)
    # checkpoint names that land nowhere, and the model-side name they were mapped to
    unmatched: dict[str, str] = field(default_factory=dict)

    @property
    def renamed(self) -> dict[str, str]:
        """Checkpoint names whose model name differs."""
        return {k: v for k, v in self.to_model.items() if k != v}


def _legacy(name: str) -> str | None:
    head, _, last = name.rpartition(".")
    if last in _LEGACY:
        return f"{head}.{_LEGACY[last]}" if head else _LEGACY[last]
    return None


def _with_prefix(name: str, prefix: str | None, model_keys: set[str]) -> str | None:
    """``name`` with the base-model prefix stripped or added, if that makes it a model name."""
    if not prefix:
        return None
    dotted = prefix + "."
    if name.startswith(dotted) and name[len(dotted) :] in model_keys:
        return name[len(dotted) :]
    if dotted + name in model_keys:
        return dotted + name
    return None


def adjust(name: str, prefix: str | None, model_keys: set[str]) -> str:
    """The base-model prefix change, then the legacy rename, that makes ``name`` a model name
    (``name`` itself if none does)."""
    for candidate in (name, _legacy(name)):
        if candidate is None:
            continue
        if candidate in model_keys:
            return candidate
        prefixed = _with_prefix(candidate, prefix, model_keys)
        if prefixed is not None:
            return prefixed
    return name


@dataclass(frozen=True)
class KeyRules:
    """How checkpoint names become model names in one load (see the module docstring for the
    order): the model's base-model prefix, the caller's ``key_map``, the model family's
    ``renames`` (or a builder of them, called only when some name does not match directly),
    the non-persistent buffers the model ``computed`` itself, the family's
    ``collision_order`` (see :func:`map_keys`), and the family's own ``resolve`` step, which
    replaces the prefix change and the legacy rename where the family has one."""

    base_model_prefix: str | None = None
    key_map: Rename | None = None
    renames: Sequence[Rename] | Callable[[], Sequence[Rename]] = ()
    #: the checkpoint, named in messages
    source: str = "checkpoint"
    computed: Collection[str] = ()
    collision_order: Callable[[str], object] | None = None
    #: the family's own last step instead of the prefix change and legacy rename: (name after
    #: the renames, stored name, model names) -> model-side name
    resolve: Callable[[str, str, set[str]], str] | None = None

    def rename(self, name: str) -> str:
        """``name`` after the caller's ``key_map``."""
        return self.key_map(name) if self.key_map is not None else name


def map_keys(
    checkpoint_keys: Iterable[str], model_keys: set[str], rules: KeyRules = KeyRules()
) -> KeyMapping:
    """Maps every checkpoint name onto a model name under ``rules``.

    ``rules.renames`` may be a callable that builds them: it is called only when some name does
    not match a model name (or one of the ``computed`` buffers the model fills itself) directly.
    The base-model prefix is added to a name that is a model name already when the checkpoint
    is one of the base model's (none of its names has the prefix) and the model holds the base
    model under the prefix.
    Two checkpoint tensors landing on the same model name is a ``CheckpointError`` naming both;
    with ``rules.collision_order`` (a sort key of checkpoint names) the first of them in that
    order lands there instead, and the other is dropped (neither matched nor unexpected).
    """
    base_model_prefix, key_map, renames = rules.base_model_prefix, rules.key_map, rules.renames
    source, computed, collision_order = rules.source, rules.computed, rules.collision_order
    checkpoint_keys = list(checkpoint_keys)
    if callable(renames):
        # Building an architecture's registered renames is costly (it may compile about
        # a thousand regexes); a checkpoint whose names all match the model needs none of them.
        known = model_keys.union(computed)
        direct = all((key_map(k) if key_map is not None else k) in known for k in checkpoint_keys)
        renames = () if direct else renames()
    out = KeyMapping()
    owner: dict[str, str] = {}
    if collision_order is not None:
        checkpoint_keys.sort(key=collision_order)
    named = []
    for original in checkpoint_keys:
        mapped = name = key_map(original) if key_map is not None else original
        for rename in renames:
            name = rename(name)
        named.append((original, mapped, name))
    # A checkpoint of the base model (none of its names carries the prefix) into a model holding
    # the base model under the prefix: every name is one of the base model's, also where a head
    # layer has the same name (Pixio's `layernorm` beside `pixio.layernorm`).
    dotted = f"{base_model_prefix}." if base_model_prefix else ""
    base_checkpoint = (
        bool(dotted)
        and rules.resolve is None
        and not any(name.startswith(dotted) for _, _, name in named)
        and any(key.startswith(dotted) for key in model_keys)
    )
    for original, mapped, name in named:
        if rules.resolve is not None:
            name = rules.resolve(name, original, model_keys)
        elif base_checkpoint and dotted + name in model_keys:
            name = dotted + name
        elif name not in model_keys:
            name = adjust(name, base_model_prefix, model_keys)
        if name not in model_keys and mapped in model_keys:
            # A registered rename broad enough to hit a name the model already has (one
            # renaming `.norm.` to `.kv_norm.` also hits `model.norm.weight`): the name is kept.
            name = mapped
        if name not in model_keys:
            out.unmatched[original] = name
            continue
        if name in owner and collision_order is not None:
            logger.debug(
                "%s: %r also maps to %r, loaded from %r", source, original, name, owner[name]
            )
            continue
        if name in owner:
            raise CheckpointError(
                f"{source}: tensors {owner[name]!r} and {original!r} both map to model tensor "
                f"{name!r}"
            )
        owner[name] = original
        out.to_model[original] = name
    return out


def recorded_aliases(records: Iterable[tuple[str, object]]) -> dict[str, str]:
    """The ``{alias: canonical}`` tables fastload's saver records under the ``fastload.tied``
    metadata key, merged. Each record is ``(where, value)``: the JSON text of a file's metadata
    entry, or the object in an index's metadata. The key is only a hint for tensors the checkpoint
    lacks, so a malformed record is ignored with a warning rather than failing the load; one
    nested deeper than any such table (a JSON bomb) is refused as ``CheckpointError``."""
    aliases: dict[str, str] = {}
    for where, value in records:
        try:
            if isinstance(value, str):
                table = json_text.loads(value, f"{where}: metadata {TIED_KEY!r}")
            else:
                table = value
        except ValueError as e:
            if isinstance(e, CheckpointError):
                raise
            table = None
        valid = isinstance(table, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in table.items()
        )
        if not valid:
            logger.warning(
                "%s: metadata %r is not a JSON object of alias -> canonical tensor names; ignored",
                where,
                TIED_KEY,
            )
            continue
        aliases.update(table)  # type: ignore[arg-type]
    return aliases


def compile_patterns(patterns: Iterable[str] | None) -> re.Pattern[str] | None:
    """One regex searching for any of ``patterns`` (searched, not matched), or ``None``."""
    patterns = [p for p in (patterns or ()) if p]
    if not patterns:
        return None
    return re.compile("|".join(f"(?:{p})" for p in patterns))


def declined_layer(model: nn.Module, name: str) -> bool:
    """Whether ``name`` lies under an attribute the model set to ``None``.

    Such a layer is one the model chose not to build (a model built without its pooler sets
    ``pooler = None``), so a checkpoint that still carries its weights is expected.
    """
    module: nn.Module = model
    for part in name.split(".")[:-1]:
        if part in module._modules:
            child = module._modules[part]
            if child is None:
                return True
            module = child
            continue
        if part in module._parameters or part in module._buffers:
            return False
        if part in module.__dict__ and module.__dict__[part] is None:
            return True
        return False
    return False


@dataclass
class Authorization:
    """The names a model class declares as expected to be missing or unexpected."""

    missing: re.Pattern[str] | None = None
    unexpected: re.Pattern[str] | None = None

    def missing_ok(self, name: str) -> bool:
        return self.missing is not None and self.missing.search(name) is not None

    def unexpected_declared(self, name: str, mapped: str) -> bool:
        """Whether the model class declares checkpoint tensor ``name`` (model-side ``mapped``)
        as expected to be unused. The patterns are searched in the model-side name (a
        pattern ``^tracker_model.`` does not cover ``tracker_model.mask_decoder.*`` when the
        renames turn it into ``mask_decoder.*``)."""
        return self.unexpected is not None and self.unexpected.search(mapped) is not None

    def unexpected_ok(self, model: nn.Module, name: str, mapped: str, prefix: str | None) -> bool:
        """Whether checkpoint tensor ``name`` (model-side ``mapped``) is expected to be unused:
        declared so, or a tensor of a layer the model does not build."""
        return self.unexpected_declared(name, mapped) or declined(model, mapped, prefix)


def declined(model: nn.Module, mapped: str, prefix: str | None) -> bool:
    """Whether model-side name ``mapped`` lies in a layer the model does not build, with or
    without the base-model prefix (:func:`declined_layer`)."""
    candidates = [mapped]
    if prefix:
        candidates.append(f"{prefix}.{mapped}")
    return any(declined_layer(model, c) for c in candidates)


def format_names(names: Sequence[str], limit: int = 20) -> str:
    """A short, readable list of names for messages."""
    shown = ", ".join(names[:limit])
    more = len(names) - limit
    return shown + (f", ... ({more} more)" if more > 0 else "")
