"""Parsing JSON text that comes from checkpoint files (an index, ``fastload.tied`` metadata).

Python's parser raises ``RecursionError`` on deeply nested input (``[[[[...]]]]``) and a result
nested a few hundred levels deep breaks later recursive code (printing it, comparing it). What
fastload reads is at most a few levels deep, so anything nested deeper than :data:`MAX_DEPTH` is
refused as ``CheckpointError [json-too-deep]`` (the Rust header parser stops at 128 levels too).
"""

from __future__ import annotations

import json
from typing import Any

from fastload.core.basics.errors import CheckpointError

#: the deepest nesting of arrays and objects accepted
MAX_DEPTH = 64


def loads(text: str | bytes, where: object, **kwargs: Any) -> Any:
    """``json.loads(text, **kwargs)``, refusing input nested deeper than :data:`MAX_DEPTH` as
    ``CheckpointError`` naming ``where``. ``json.JSONDecodeError`` (a ``ValueError``) and
    exceptions of a hook in ``kwargs`` propagate unchanged."""
    try:
        data = json.loads(text, **kwargs)
    except RecursionError:
        data = None
        too_deep = True
    else:
        too_deep = depth(data) > MAX_DEPTH
    if too_deep:
        raise CheckpointError(
            f"{where}: [json-too-deep] JSON nested more than {MAX_DEPTH} levels deep"
        ) from None
    return data


def depth(value: Any) -> int:
    """How deeply lists and dicts nest in ``value`` (a scalar is 0), without recursion."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            item = item.values()
        elif not isinstance(item, list):
            continue
        level += 1
        deepest = max(deepest, level)
        if level > MAX_DEPTH:
            return level  # deep enough to refuse; no need to walk the rest
        stack.extend((child, level) for child in item)
    return deepest
