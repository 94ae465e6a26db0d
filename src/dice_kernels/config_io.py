"""Typed configs from TOML, for every stage: nested dataclasses loaded from a file (`load`, `from_dict`), `--set
a.b=value` overrides parsed to each field's type (`apply_override`), unknown keys rejected by name, validation in
each dataclass's `__post_init__` (raising `ConfigError`), the full config written back as TOML (`to_toml`,
`save`), and the shipped configs found by name (`config_path`)."""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

T = TypeVar("T")


class ConfigError(ValueError):
    """A config file or override this program cannot use; the message names the key or file."""


def load_toml(path: Path) -> dict:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    try:
        return tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML ({e})") from None


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_optional(tp: Any) -> bool:
    return get_origin(tp) in (Union, types.UnionType) and type(None) in get_args(tp)


def _coerce(value: Any, tp: Any, key: str, from_text: bool) -> Any:
    """`value` (a TOML value, or the text of a --set override) as type `tp`; ConfigError naming `key` if not."""
    if _is_optional(tp):
        if value is None or (from_text and str(value).lower() in ("none", "null")):
            return None
        inner = [a for a in get_args(tp) if a is not type(None)]
        return _coerce(value, inner[0], key, from_text)
    origin = get_origin(tp)
    if origin is Literal:
        choices = get_args(tp)
        if value not in choices:
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(repr, choices))}")
        return value
    if origin in (tuple, list):
        if from_text and isinstance(value, str):
            value = [v.strip() for v in value.strip("[]()").split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        args = get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(f"{key}: expected {len(args)} values, got {len(value)}")
            return tuple(_coerce(v, a, key, from_text) for v, a in zip(value, args))
        item = args[0] if args else Any
        return origin(_coerce(v, item, key, from_text) for v in value)
    if tp is bool:
        if from_text and isinstance(value, str):
            lowered = value.lower()
            if lowered in ("true", "1", "yes", "on"):
                return True
            if lowered in ("false", "0", "no", "off"):
                return False
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp in (int, float):
        if from_text and isinstance(value, str):
            try:
                value = int(value) if tp is int else float(value)
            except ValueError:
                raise ConfigError(f"{key}: expected {tp.__name__}, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (tp is int and not isinstance(value, int)):
            raise ConfigError(f"{key}: expected {tp.__name__}, got {value!r}")
        return tp(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    return value


def _section_default(cls: type, name: str) -> Any:
    """The default of section `name` when its factory is not just the section's class (e.g. RL's
    `OptimConfig(lr=1e-6)`): keys the file leaves out keep *those* defaults."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    factory = f.default_factory
    return factory() if factory is not dataclasses.MISSING and factory is not _hints(cls)[name] else None


def from_dict(cls: type[T], data: dict, prefix: str = "", base: T | None = None) -> T:
    """Build dataclass `cls` from a nested dict (over `base`, if given); an unknown key is an error that names it
    and the valid keys."""
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    values = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in hints:
            raise ConfigError(f"unknown config key {path!r}; valid keys{' in ' + prefix[:-1] if prefix else ''}: "
                              f"{', '.join(names)}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise ConfigError(f"{path} is a section ([{path}]), not a value")
            section_base = getattr(base, key) if base is not None else _section_default(cls, key)
            values[key] = from_dict(tp, value, prefix=f"{path}.", base=section_base)
        else:
            values[key] = _coerce(value, tp, path, from_text=False)
    try:
        return dataclasses.replace(base, **values) if base is not None else cls(**values)
    except TypeError as e:
        raise ConfigError(f"{prefix or 'config'}: {e}") from None


def apply_override(data: dict, cls: type, override: str) -> None:
    """Apply `a.b=value` to the nested dict `data`, the value parsed to field a.b's type of `cls`."""
    path, sep, raw = override.partition("=")
    if not sep or not path.strip():
        raise ConfigError(f"--set {override!r}: expected KEY=VALUE, e.g. optim.lr=2e-5")
    keys = path.strip().split(".")
    node, tp = data, cls
    for i, key in enumerate(keys):
        hints = _hints(tp) if dataclasses.is_dataclass(tp) else {}
        where = ".".join(keys[:i])
        if key not in hints:
            valid = ", ".join(f.name for f in dataclasses.fields(tp)) if dataclasses.is_dataclass(tp) else "none"
            raise ConfigError(f"unknown config key {'.'.join(keys[:i + 1])!r} in --set; valid keys"
                              f"{' in ' + where if where else ''}: {valid}")
        tp = hints[key]
        if i < len(keys) - 1:
            if not dataclasses.is_dataclass(tp):
                raise ConfigError(f"--set {path}: {'.'.join(keys[:i + 1])} is a value, not a section")
            node = node.setdefault(key, {})
        elif dataclasses.is_dataclass(tp):
            raise ConfigError(f"--set {path}: {path} is a section; set one of its keys ({path}.KEY=VALUE)")
        else:
            node[key] = _coerce(raw.strip(), tp, path, from_text=True)


def load(cls: type[T], path: Path | None, overrides: list[str] | tuple[str, ...] = ()) -> T:
    """A `cls` config from a TOML file (None: the defaults) with `--set` overrides applied in order."""
    data = load_toml(path) if path is not None else {}
    for override in overrides:
        apply_override(data, cls, override)
    try:
        return from_dict(cls, data)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}" if path is not None else str(e)) from None


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if value is None:
        raise ValueError("TOML has no null")
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def to_toml(cfg: Any) -> str:
    """The full config as TOML (every key, defaults included); loading it back gives an equal config.
    None values are left out (a missing key takes the default, which is None for every optional field)."""
    data = to_dict(cfg)
    top = [f"{k} = {_toml_value(v)}" for k, v in data.items() if not isinstance(v, dict) and v is not None]
    sections = []
    for name, section in data.items():
        if isinstance(section, dict):
            lines = [f"{k} = {_toml_value(v)}" for k, v in section.items() if v is not None]
            sections.append(f"[{name}]\n" + "\n".join(lines))
    return "\n".join(top) + ("\n\n" if top else "") + "\n\n".join(sections) + "\n"


def save(cfg: Any, out_dir: Path) -> Path:
    """Write the full config to <out_dir>/config.toml (atomically) and return its path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "config.toml"
    tmp = path.with_suffix(".toml.tmp")
    tmp.write_text(to_toml(cfg))
    tmp.replace(path)
    return path


CONFIGS = Path(__file__).parent / "train" / "configs"  # the shipped run configs, configs/<stage>/<name>.toml


def config_path(stage: str, name: str) -> Path:
    """A config file: `name` itself when it is a file, else the shipped configs/<stage>/<name>.toml."""
    path = Path(name)
    if path.is_file():
        return path
    shipped = CONFIGS / stage / f"{path.name.removesuffix('.toml')}.toml"
    if shipped.is_file():
        return shipped
    names = ", ".join(sorted(p.stem for p in (CONFIGS / stage).glob("*.toml")))
    raise ConfigError(f"{name}: no such config file, and no shipped {stage} config of that name (shipped: {names})")
