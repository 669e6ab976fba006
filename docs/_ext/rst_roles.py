"""A griffe extension for the API reference: fastload's docstrings cross-reference with Sphinx
roles (``:func:`fastload.patch_transformers```, ``:class:`~fastload.core.plan.report.LoadReport```),
which Markdown would print verbatim. Each role becomes inline code of the name it shows (the last
component after ``~``, as Sphinx shows it)."""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:mod|func|class|meth|attr|data|exc|obj|const):`(~?)([^`]+)`")


def _code(match: re.Match[str]) -> str:
    short, target = match.group(1), match.group(2).strip()
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


def _rewrite(obj: griffe.Object) -> None:
    if obj.docstring is not None:
        obj.docstring.value = _ROLE.sub(_code, obj.docstring.value)


class RstRoles(griffe.Extension):
    """Rewrites Sphinx roles in every docstring before it is parsed."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        _rewrite(obj)

    def on_attribute_instance(self, *, attr: griffe.Attribute, **kwargs: Any) -> None:
        # again after griffe_sphinx (listed before this one) made a docstring of a ``#:`` comment
        _rewrite(attr)
