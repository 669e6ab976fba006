"""The one redaction of secrets in URLs for every message and log line of the package: the query
(a presigned ``X-Amz-Signature``, an Azure SAS ``sig=``) and the user-info
(``http://user:PASSWORD@host/``, ``s3://KEY:SECRET@bucket/``) of every URL in a text are replaced
by placeholders. The rule is the Rust core's (``fastload._core.redact_urls``), so a message is
redacted the same way whichever side wrote it.

Applied by :class:`fastload.core.errors.FastloadError` to every message (and to the
``filename`` of an I/O error), and by a filter on the ``fastload`` logger to every record.
"""

from __future__ import annotations

import logging

from fastload import _core


def redact(text: str) -> str:
    """``text`` with the query and the user-info of every URL in it hidden."""
    if "://" not in text:  # the common case: a local path, no URL at all
        return text
    return _core.redact_urls(text)


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
    """Adds the filter to ``logger`` once (every fastload module logs to ``"fastload"``)."""
    if not any(isinstance(f, RedactingFilter) for f in logger.filters):
        logger.addFilter(RedactingFilter())


install(logging.getLogger("fastload"))

__all__ = ["RedactingFilter", "install", "redact"]
