"""Masking secrets in everything that leaves the process: params, tags, artifacts, printed lines
and log records. URL passwords, signed-URL signatures, tokens and the values of secret-looking
environment variables become `***`.

`install_redaction` patches sys.stdout/sys.stderr process-wide; the driver calls it once at start.
This module knows nothing of MLflow, Ray or the model: only text.
"""

from __future__ import annotations

import io
import logging
import os
import re
import sys

MASK = "***"
# Names of things that hold secrets: env vars, query parameters, `key=value` text, config keys.
# `token(?![a-z])` keeps tokenizer / tokens_per_s / num_tokens readable.
_SECRET_NAME = (r"(?:secret|passw(?:or)?d|token(?![a-z])|credential|signature|(?<![a-z])sig"
                r"(?![a-z])|api[_-]?key|access[_-]?key|private[_-]?key|account[_-]?key"
                r"|session[_-]?key|authorization)")
_SECRET_NAME_RE = re.compile(_SECRET_NAME, re.I)
# scheme://user:password@host -> scheme://user:***@host
_URL_PASSWORD = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://[^/\s:@'\"]*):([^/\s@'\"]+)@")
# scheme://<long token>@host (GitHub-style token as the user name) -> scheme://***@host
_URL_TOKEN_USER = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)([^/\s:@'\"]{20,})@")
# ?X-Amz-Signature=...&sig=...&token=... in query strings
_QUERY_SECRET = re.compile(r"(?i)([?&;][\w.-]*" + _SECRET_NAME + r"[\w.-]*=)[^&#\s'\"]+")
# AWS_SECRET_ACCESS_KEY=..., "password": "...", token: ... in free text
_KV_SECRET = re.compile(r"(?i)(\b[\w.-]*" + _SECRET_NAME + r"[\w.-]*['\"]?\s*[=:]\s*['\"]?)"
                        r"(?!\*\*\*|bearer\b|basic\b)([^\s'\",;&}]{4,})")
# Authorization: Bearer xxx / Basic xxx
_AUTH_HEADER = re.compile(r"(?i)\b(bearer|basic)\s+[a-z0-9._~+/=-]{8,}")
# Well-known credential shapes, wherever they appear.
_KNOWN_SHAPES = re.compile(
    r"\b(?:(?:AKIA|ASIA)[A-Z0-9]{16}|gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{30,}"
    r"|hf_[A-Za-z0-9]{30,}|xox[abposr]-[A-Za-z0-9-]{10,}|AIza[0-9A-Za-z_-]{35}"
    r"|sk-[A-Za-z0-9_-]{20,})\b")
# Secret values shorter than this are not masked by value (too many false hits on short words);
# the structural patterns above still mask them where they appear as key=value or in URLs.
_MIN_SECRET_VALUE_LEN = 8
_registered_secrets: set[str] = set()


def register_secret(value: str | None) -> None:
    """Mask this exact value wherever it appears from now on (e.g. a password found in a URL)."""
    if value and len(value) >= _MIN_SECRET_VALUE_LEN:
        _registered_secrets.add(value)


def env_secret_values(environ=None) -> set[str]:
    """Values of environment variables whose names look secret (AWS_SECRET_ACCESS_KEY, ...)."""
    environ = os.environ if environ is None else environ
    return {v for k, v in environ.items()
            if len(v) >= _MIN_SECRET_VALUE_LEN and _SECRET_NAME_RE.search(k)
            and v.lower() not in ("true", "false")}


def redact(value) -> str:
    """Mask every credential in a string: URL passwords and tokens, signed-URL signatures,
    `secret=...` pairs, bearer tokens, known key shapes and known secret values."""
    text = str(value)
    literals = _registered_secrets | env_secret_values()
    for secret in sorted(literals, key=len, reverse=True):
        if secret in text:
            text = text.replace(secret, MASK)
    text = _URL_PASSWORD.sub(r"\1:" + MASK + "@", text)
    text = _URL_TOKEN_USER.sub(r"\1" + MASK + "@", text)
    text = _QUERY_SECRET.sub(r"\1" + MASK, text)
    text = _AUTH_HEADER.sub(r"\1 " + MASK, text)
    text = _KV_SECRET.sub(r"\1" + MASK, text)
    return _KNOWN_SHAPES.sub(MASK, text)


def register_secrets_in(obj) -> None:
    """Register the secret parts of every URL in a (nested) config, so they are masked even
    where they later appear without their URL around them (e.g. URL-decoded in an error)."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if isinstance(v, str) and _SECRET_NAME_RE.search(str(k)):
                register_secret(v)
            register_secrets_in(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            register_secrets_in(v)
    elif isinstance(obj, str):
        for m in _URL_PASSWORD.finditer(obj):
            register_secret(m.group(2))
        for m in _URL_TOKEN_USER.finditer(obj):
            register_secret(m.group(2))
        for m in _QUERY_SECRET.finditer(obj):
            register_secret(obj[m.end():].split("&")[0].split("#")[0])


def redact_obj(obj):
    """Redact every string in a nested dict/list; values under secret-looking keys become ***."""
    if isinstance(obj, dict):
        return {k: (MASK if isinstance(v, str) and v and _SECRET_NAME_RE.search(str(k))
                    else redact_obj(v)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [redact_obj(v) for v in obj]
    return redact(obj) if isinstance(obj, str) else obj


def redacted_params(flat: dict) -> dict:
    return {k: (MASK if _SECRET_NAME_RE.search(k) else redact(v) if isinstance(v, str) else v)
            for k, v in flat.items()}


class _RedactingStream(io.TextIOBase):
    """A text stream that masks secrets in everything written through it."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, s) -> int:
        self._stream.write(redact(s))
        return len(s)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        self._stream.flush()

    def __getattr__(self, name):  # fileno, isatty, encoding, buffer, ...
        return getattr(self._stream, name)


def install_redaction(config: dict | None = None) -> None:
    """Mask secrets in this process's printed output and log records from now on: wraps
    sys.stdout/sys.stderr (which is also where Ray echoes worker output on the driver) and every
    logging handler that writes to them. Registers the credentials found in `config`. Idempotent."""
    if config is not None:
        register_secrets_in(config)
    originals = {}
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _RedactingStream):
            originals[id(stream)] = wrapped = _RedactingStream(stream)
            setattr(sys, name, wrapped)
    loggers = [logging.getLogger()] + [lg for lg in logging.Logger.manager.loggerDict.values()
                                       if isinstance(lg, logging.Logger)]
    for logger in loggers:
        for handler in logger.handlers:
            stream = getattr(handler, "stream", None)
            if isinstance(handler, logging.StreamHandler) and id(stream) in originals:
                handler.setStream(originals[id(stream)])

