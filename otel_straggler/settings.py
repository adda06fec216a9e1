"""The settings machinery both halves share: a table row per setting (default, bounds, env var,
flag) and one resolver. Flags win over `OTEL_STRAGGLER_*` env vars, which win over defaults.
A bad value fails with one line that names the flag or env var and the bound."""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional


class ConfigError(ValueError):
    """A setting is out of bounds or unparsable; the message is one line for the user."""


def parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


parse_bool.__name__ = "bool"


@dataclass(frozen=True)
class Setting:
    name: str
    kind: Callable[[str], Any]
    default: Any
    help: str
    minimum: Optional[float] = None
    maximum: Optional[float] = None
    choices: Optional[tuple[str, ...]] = None
    off: Optional[float] = None  # a value allowed outside the bounds: it turns the feature off

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env_var(self) -> str:
        return "OTEL_STRAGGLER_" + self.name.upper()

    def check(self, value: Any, where: str) -> None:
        if self.choices is not None and value not in self.choices:
            raise ConfigError(f"{where}: must be one of {', '.join(self.choices)}, got {value!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{where}: must be a finite number, got {value}")
        if self.off is not None and value == self.off:
            return
        off = "" if self.off is None else f" or {self.off:g} (off)"
        if self.minimum is not None and value < self.minimum:
            raise ConfigError(f"{where}: must be >= {self.minimum:g}{off}, got {value:g}")
        if self.maximum is not None and value > self.maximum:
            raise ConfigError(f"{where}: must be <= {self.maximum:g}{off}, got {value:g}")

    def parse(self, raw: Any, where: str) -> Any:
        try:
            value = self.kind(raw) if isinstance(raw, str) else raw
        except ValueError:
            raise ConfigError(f"{where}: expected {self.kind.__name__}, got {raw!r}") from None
        self.check(value, where)
        return value


def add_arguments(parser: argparse.ArgumentParser, settings: Iterable[Setting]) -> None:
    """One flag per setting, defaulting to None so an unset flag falls back to env, then default."""
    for setting in settings:
        parser.add_argument(
            setting.flag, dest=setting.name, default=None, metavar=setting.kind.__name__.upper(),
            help=f"{setting.help} (env {setting.env_var}, default {setting.default!r})",
        )


def resolve(
    settings: Iterable[Setting],
    explicit: Optional[Mapping[str, Any]],
    environ: Mapping[str, str],
) -> dict[str, Any]:
    """Values given explicitly (flags, arguments) or by env, validated; unset ones are left out."""
    values: dict[str, Any] = {}
    for setting in settings:
        raw = explicit.get(setting.name) if explicit else None
        where = setting.flag
        if raw is None and setting.env_var in environ:
            raw, where = environ[setting.env_var], setting.env_var
        if raw is not None:
            values[setting.name] = setting.parse(raw, where)
    return values
