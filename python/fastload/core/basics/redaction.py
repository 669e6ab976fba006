"""The one redaction of secrets in URLs for every message and log line of the package: the query
(a presigned ``X-Amz-Signature``, an Azure SAS ``sig=``) and the user-info
(``http://user:PASSWORD@host/``, ``s3://KEY:SECRET@bucket/``) of every URL in a text are replaced
by placeholders. The rule is the Rust core's (``fastload._core.redact_urls``), so a message is
redacted the same way whichever side wrote it.

Applied by :class:`fastload.core.basics.errors.FastloadError` to every message (and to the
``filename`` of an I/O error), by a filter on the ``fastload`` logger to every record (and on the
loggers of the integrations, :func:`install`), to every field of a report as it is set
(:class:`RedactedFields`), and to the notes added to exceptions fastload does not make
(:func:`add_note`). The object storage source keeps a store's root URL without its user-info from
the start (``fastload._core.ObjectStore.url``), so every file name made from it is clean; the URL
as given is kept only by the code that fetches.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from fastload import _core

#: a query already hidden, where nothing of a query follows it: kept as it is by :func:`redact`
_HIDDEN_QUERY = re.compile(r"\?<query hidden>(?![\w&=%.~+\-/])")
#: what stands for it while the rest is redacted (no ``?``: no query to hide)
_KEPT = "\x00fastload-query-hidden\x00"


def redact(text: str) -> str:
    """``text`` with the query and the user-info of every URL in it hidden. Idempotent: a text
    redacted already (a message naming an error's message) is returned as it is, its hidden
    queries not hidden again (``?<query hidden> hidden>``)."""
    if "://" not in text:  # the common case: a local path, no URL at all
        return text
    if "?<query hidden>" not in text:
        return _core.redact_urls(text)
    kept = _HIDDEN_QUERY.sub(_KEPT, text.replace(_KEPT, ""))
    return _core.redact_urls(kept).replace(_KEPT, "?<query hidden>")


def redact_value(value: Any) -> Any:
    """``value`` with every string in it redacted (:func:`redact`): a ``str``, and the strings in
    lists, tuples, sets and dicts (keys too), at any depth; anything else as it is."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {redact_value(k): redact_value(v) for k, v in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(redact_value(v) for v in value))
    if isinstance(value, (list, tuple, set, frozenset)):
        return type(value)(redact_value(v) for v in value)
    return value


class RedactedFields:
    """A base for the reports (:class:`~fastload.core.plan.report.LoadReport`,
    :class:`~fastload.reloading.report.ReloadReport`): every value set on a field, at construction
    or later, is stored redacted (:func:`redact_value`), so no field, printed line, ``repr`` or
    ``to_dict`` of a report can show a secret, whatever field is added."""

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, redact_value(value))


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)``, redacted: a note on an exception fastload does not make (a
    ``KeyboardInterrupt``, an error from torch or a serving framework) is not redacted by
    :class:`~fastload.core.basics.errors.FastloadError`."""
    exc.add_note(redact(note))


class RedactingFilter(logging.Filter):
    """Redacts a record's whole message (its arguments formatted in) before any handler sees
    it."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        hidden = redact(message)
        if hidden != message:
            record.msg, record.args = hidden, None
        return True


def install(logger: logging.Logger) -> None:
    """Adds the filter to ``logger`` once (every fastload module logs to ``"fastload"``; an
    integration that logs through its framework's logger installs it there)."""
    if not any(isinstance(f, RedactingFilter) for f in logger.filters):
        logger.addFilter(RedactingFilter())


install(logging.getLogger("fastload"))

__all__ = [
    "RedactedFields",
    "RedactingFilter",
    "add_note",
    "install",
    "redact",
    "redact_value",
]
