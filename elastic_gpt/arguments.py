"""Command-line flag values: number types, so a value out of range is refused by argparse with the
flag's name (`elastic-gpt plan: error: argument --gpus: 0 is not a positive integer`) instead of
being taken as "unset" or planned with; and writing the file a flag names, so a path that cannot
be written is one line naming the flag, and a half-written file is never left behind."""

from __future__ import annotations

import argparse
import math
import os
import tempfile


def _number(kind, text: str, what: str, ok) -> float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if not (math.isfinite(value) and ok(value)):
        raise argparse.ArgumentTypeError(f"{text} is not {what}")
    return value


def positive_int(text: str) -> int:
    return _number(int, text, "a positive integer", lambda v: v >= 1)


def non_negative_int(text: str) -> int:
    return _number(int, text, "an integer >= 0", lambda v: v >= 0)


def positive_float(text: str) -> float:
    return _number(float, text, "a number > 0", lambda v: v > 0)


def non_negative_float(text: str) -> float:
    return _number(float, text, "a number >= 0", lambda v: v >= 0)


def fraction(text: str) -> float:
    """A share of something: 0 < value <= 1."""
    return _number(float, text, "a number in (0, 1]", lambda v: 0 < v <= 1)


def margin(text: str) -> float:
    """A safety margin: 0 <= value < 1."""
    return _number(float, text, "a number in [0, 1)", lambda v: 0 <= v < 1)


def write_output_file(path: str, text: str, flag: str) -> None:
    """Write `text` to `path` whole or not at all (a temporary file in the same folder, renamed);
    an unwritable path is a ValueError naming `flag`."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path} is a folder; name a file in it, e.g. {flag} "
                         f"{os.path.join(path, 'config.yaml')}")
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=os.path.basename(path))
    except OSError as e:
        raise ValueError(f"{flag} {path} cannot be written ({e.strerror or e}: {folder}); choose "
                         "a path in an existing, writable folder") from None
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as e:
        os.unlink(tmp)
        raise ValueError(f"{flag} {path} cannot be written ({e.strerror or e}); choose a path in "
                         "an existing, writable folder") from None
