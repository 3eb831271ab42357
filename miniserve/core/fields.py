"""A setting's kind, range and default, and the one check of a value against them (used by
the sampling stages' declarations, the API's own numbers and the server's settings)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from miniserve.core.errors import UserError


class ConfigError(UserError, ValueError):
    """A setting is wrong. `field` names it; the message says what is allowed."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Field:
    kind: type  # int or float
    low: float
    high: float
    default: float
    label: str
    help: str
    low_open: bool = False  # True: `low` itself is not allowed
    choices: tuple = ()  # the only values allowed, when set (within low..high)

    def describe(self) -> str:
        if self.choices:
            return "one of " + ", ".join(f"{c:g}" for c in self.choices)
        left = "(" if self.low_open else "["
        return f"{left}{self.low:g}, {self.high:g}]"


def check_number(name: str, value, spec: Field, where: str = "") -> float | int:
    """The one check of a number against its Field (kind and range), for sampling settings
    and any other numeric field (the API's n, max_tokens, ...); return it as its kind.
    Raises ConfigError naming the field and what is allowed."""
    prefix = f"{where}: " if where else ""
    whole = "a whole number" if spec.kind is int else "a number"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(
            f"{prefix}'{name}' must be {whole} {spec.describe()}, got {value!r}", name
        )
    if spec.kind is int and (isinstance(value, float) and not value.is_integer()):
        raise ConfigError(
            f"{prefix}'{name}' must be a whole number {spec.describe()}, got {value!r}", name
        )
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(
            f"{prefix}'{name}' must be a finite number {spec.describe()}, got {value!r}", name
        )
    too_low = value <= spec.low if spec.low_open else value < spec.low
    if too_low or value > spec.high or (spec.choices and value not in spec.choices):
        where_ = "" if spec.choices else "in "
        raise ConfigError(
            f"{prefix}'{name}' must be {where_}{spec.describe()}, got {value!r}", name
        )
    return spec.kind(value)
