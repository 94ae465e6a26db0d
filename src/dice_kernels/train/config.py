"""Typed run configs: nested dataclasses loaded from TOML, `--set a.b=value` overrides parsed to each field's type,
unknown keys rejected by name, validation in `__post_init__`. The sections every trainer shares live here; a stage
composes them into its own root config (sft.SFTConfig, rl...), so each setting has one typed place."""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

T = TypeVar("T")


class ConfigError(ValueError):
    """A config file or override this program cannot use; the message names the key or file."""


# --------------------------------------------------------------------------- shared sections


@dataclass
class ModelSection:
    """Where the weights come from: a Hugging Face checkpoint directory, or random init of a named shape
    ("tiny", or the SDAR shapes "1.7B", "4B", "8B" for benchmarks) with a tokenizer directory."""

    checkpoint: str = ""  # HF directory (config.json, safetensors, tokenizer files)
    shape: str = ""  # random init instead of a checkpoint
    tokenizer: str = ""  # tokenizer directory; default: the checkpoint directory
    seed: int = 0  # random init only

    def __post_init__(self) -> None:
        if bool(self.checkpoint) == bool(self.shape):
            raise ConfigError("model: set exactly one of model.checkpoint (a Hugging Face directory) or model.shape "
                              "(random init: tiny, 1.7B, 4B, 8B)")
        if self.shape and not self.tokenizer:
            raise ConfigError("model.shape needs model.tokenizer (a directory with tokenizer.json)")

    @property
    def tokenizer_dir(self) -> str:
        return self.tokenizer or self.checkpoint


@dataclass
class OptimConfig:
    """AdamW with linear warm-up, then a constant (DICE) or cosine learning rate; global-norm gradient clipping."""

    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    warmup_fraction: float = 0.03  # of the total optimizer steps (DICE: 3 %)
    schedule: Literal["constant", "cosine"] = "constant"
    min_lr_fraction: float = 0.0  # cosine only: the final lr as a fraction of lr
    grad_clip: float = 1.0  # max global grad norm; 0 = off

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ConfigError(f"optim.lr must be > 0, got {self.lr}")
        if not 0 <= self.warmup_fraction < 1:
            raise ConfigError(f"optim.warmup_fraction must be in [0, 1), got {self.warmup_fraction}")
        if self.grad_clip < 0:
            raise ConfigError(f"optim.grad_clip must be >= 0, got {self.grad_clip}")


@dataclass
class ParallelConfig:
    """How one step runs: FSDP2 over all ranks (always, also for one process), mixed precision, activation
    checkpointing, and the attention kernel."""

    mixed_precision: Literal["auto", "bfloat16", "float32"] = "auto"  # auto: bf16 on CUDA, fp32 on CPU
    activation_checkpointing: bool = False  # recompute each decoder layer in backward
    attention: Literal["auto", "flex", "dense"] = "auto"  # auto: flex on CUDA, dense on CPU (no CPU flex backward)


@dataclass
class CheckpointConfig:
    """Resumable states (torch.distributed.checkpoint) under <out_dir>/checkpoints, HF exports under
    <out_dir>/export/step-N and <out_dir>/final."""

    every_steps: int = 200  # resumable save interval; 0 = only at the end
    keep: int = 2  # resumable states kept (older ones are deleted)
    export_every_steps: int = 0  # periodic HF export; 0 = only the final one
    export_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    at_end: bool = True  # a resumable state and the final export when training ends (off: throughput runs)

    def __post_init__(self) -> None:
        if self.every_steps < 0 or self.export_every_steps < 0 or self.keep < 1:
            raise ConfigError("checkpoint.every_steps and export_every_steps must be >= 0, checkpoint.keep >= 1")


@dataclass
class MetricsConfig:
    """metrics.jsonl always; TensorBoard and W&B optional; a loss-curve PNG at the end."""

    log_every: int = 1
    progress: bool = True  # rich progress bar on a terminal (else, and in logs, a line per log_every steps)
    tensorboard: bool = True  # needs the `tensorboard` package; skipped with a note when absent
    wandb_project: str = ""  # "" = off; needs the `wandb` package
    plot: bool = True  # loss_curve.png (needs matplotlib)

    def __post_init__(self) -> None:
        if self.log_every < 1:
            raise ConfigError(f"metrics.log_every must be >= 1, got {self.log_every}")


@dataclass
class DebugConfig:
    """Fault injection for tests of resumption."""

    sigkill_after_step: int = 0  # the process kills itself (SIGKILL, as a crash would) after this step; 0 = off


# --------------------------------------------------------------------------- loading


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


CONFIGS = Path(__file__).parent / "configs"


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
