"""A config field's declared type as its check: a YAML or override value judged against the
resolved type hint of its field (int, float, bool, str, `Literal` for closed sets, `X | None` for
optional fields, `list[...]`, `dict`, `Annotated[..., Range]` for bounds), with the one-line
error that names the key and what it accepts (C6 clear errors). Knows nothing of the sections."""

from __future__ import annotations

import math
import types
from typing import Annotated, Literal, NamedTuple, Union, get_args, get_origin


class Range(NamedTuple):
    """Bounds of a number field: low <= value, and value < high when high is given."""

    low: float
    high: float | None = None

    def holds(self, value: float) -> bool:
        return value >= self.low and (self.high is None or value < self.high)

    def __str__(self) -> str:
        if self.high is None:
            return f"at least {self.low:g}"
        return f"in [{self.low:g}, {self.high:g})"


AtLeastOne = Annotated[int, Range(1)]


def coerce(dotted: str, value, tp):
    """YAML already typed the value; check it against the field's type and return it as stored."""
    if value is None:
        if _allows_none(tp):
            return None
        raise ValueError(f"{dotted} cannot be empty")
    try:
        return _as_type(dotted, value, tp)
    except _Mismatch as e:
        raise ValueError(f"{dotted}={value!r} must be {one_of(e.args[0])}") from None


class _Mismatch(Exception):
    """The value is not of this type; args[0] lists what would be (e.g. ["true", "false"])."""


def _allows_none(tp) -> bool:
    return tp is type(None) or (_is_union(tp) and any(_allows_none(a) for a in get_args(tp)))


def _is_union(tp) -> bool:
    return get_origin(tp) in (Union, types.UnionType)


def _as_type(dotted: str, value, tp):
    """`value` as a `tp`, or _Mismatch with the words for what `tp` accepts."""
    origin = get_origin(tp)
    if origin is Annotated:
        inner, *meta = get_args(tp)
        value = _as_type(dotted, value, inner)
        for bound in meta:
            if isinstance(bound, Range) and not bound.holds(value):
                raise ValueError(f"{dotted}={value!r} must be {bound}")
        return value
    if _is_union(tp):
        accepted: list[str] = []
        for member in get_args(tp):
            if member is type(None):
                continue
            try:
                return _as_type(dotted, value, member)
            except _Mismatch as e:
                accepted += e.args[0]
        raise _Mismatch(accepted)
    if origin is Literal:
        choices = get_args(tp)
        if isinstance(value, bool) and ("on" if value else "off") in choices:
            value = "on" if value else "off"  # YAML 1.1 reads a bare on/off as a boolean
        # Compare the type too: YAML's `true` must not pass as 1, nor 1 as "1".
        if any(type(value) is type(c) and value == c for c in choices):
            return value
        raise _Mismatch([str(c) for c in choices])
    if origin is list:
        if not isinstance(value, list):
            raise _Mismatch(["a list"])
        (item,) = get_args(tp)
        return [_as_type(f"{dotted}[{i}]", v, item) for i, v in enumerate(value)]
    if tp is dict:
        if not isinstance(value, dict):
            raise _Mismatch(["a mapping"])
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _Mismatch(["true", "false"])
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _Mismatch(["an integer"])
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-4" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _Mismatch(["a number"])
        if not math.isfinite(value):  # NaN passes every `<=` check below, so refuse it here
            raise _Mismatch(["a finite number"])
        return float(value)
    if tp is str:
        if not isinstance(value, (str, int, float)):
            raise _Mismatch(["a string"])
        return str(value)
    raise TypeError(f"config field {dotted} has a type coerce does not know: {tp!r}")


def one_of(words: list[str]) -> str:
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"
