"""Secrets out of log lines: a logging filter that masks gpucloud credentials.

Credentials never reach a log call in gpucloud's own code; what can carry one is a line
written by a library about a request: uvicorn's access log prints the request target, and
the HTTP proxy's browser form is ``?gpucloud_token=…``. The filter masks API keys
(``gpc_…``), node tokens (``gpn_…``), join tokens (``gpj_…``), ``gpucloud_token=`` values
and ``Bearer`` credentials in the message and its arguments.
"""

from __future__ import annotations

import logging
import re

MASK = "[redacted]"
_PATTERNS = (
    re.compile(r"\bgp[cnj]_[A-Za-z0-9_\-]{8,}"),
    re.compile(r"(gpucloud_token=)[^&\s\"']+"),
    re.compile(r"(?i)(bearer[ .])[A-Za-z0-9_\-.~+/=]{8,}"),
)


def redact(text: str) -> str:
    for pattern in _PATTERNS:
        text = pattern.sub(lambda m: (m.group(1) if m.groups() else "") + MASK, text)
    return text


class RedactSecrets(logging.Filter):
    """Masks credentials in a record's message and arguments (in place)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = redact(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(_redacted_arg(a) for a in record.args)
        return True


def _redacted_arg(arg: object) -> object:
    """A string (or an object printed as one, like httpx's URL) with credentials masked;
    numbers and other arguments as they are (``%d`` still needs a number)."""
    if isinstance(arg, int | float) or arg is None:
        return arg
    text = str(arg)
    masked = redact(text)
    return masked if masked != text or isinstance(arg, str) else arg


def install(*logger_names: str) -> None:
    """Add the filter to each named logger once."""
    for name in logger_names:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactSecrets) for f in logger.filters):
            logger.addFilter(RedactSecrets())
