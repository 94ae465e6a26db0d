"""`ModelConfig`: the shape of an SDAR/Qwen3 decoder plus the two block-diffusion settings (block size, mask id),
read from and written back to a Hugging Face `config.json` dict. Checkpoint files themselves live in checkpoint.py."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

import torch

from dice_kernels.config_io import ConfigError  # also for a config.json this model cannot represent

SDAR_MASK_TOKEN_ID = 151669  # SDAR's mask token; its *string* differs between tokenizer files, so use the id
DEFAULT_BLOCK_SIZE = 4
MODEL_TYPES = ("sdar", "qwen3")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float = 1e6
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 40960
    block_size: int = DEFAULT_BLOCK_SIZE
    mask_token_id: int | None = SDAR_MASK_TOKEN_ID  # None: no mask token known (a plain Qwen3 checkpoint)
    dtype: str = "bfloat16"  # the checkpoint's stored dtype ("torch_dtype"); loading may override it
    # Every other config.json key, written back unchanged on save so a round trip loses nothing.
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                              f"num_key_value_heads ({self.num_key_value_heads})")
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(f"mask_token_id {self.mask_token_id} is outside the vocabulary (size {self.vocab_size})")
        if self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}")
        if self.dtype not in _DTYPES:
            raise ConfigError(f"dtype {self.dtype!r} is not one of {sorted(_DTYPES)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @classmethod
    def from_hf(cls, hf: dict, mask_token_id: int | None = None) -> ModelConfig:
        """From a config.json dict (model_type sdar or qwen3, transformers 4.x or 5.x spelling).

        Without a mask_token_id in the config: `mask_token_id` (the caller found it in the tokenizer files), else
        SDAR's 151669 where the vocabulary has room for it, else None.
        """
        hf = dict(hf)
        model_type = hf.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ConfigError(f"model_type {model_type!r} is not supported (expected one of {MODEL_TYPES})")
        for key, ok in (("hidden_act", "silu"), ("attention_bias", False), ("use_sliding_window", False)):
            if hf.get(key, ok) != ok:
                raise ConfigError(f"{key}={hf[key]!r} is not supported (SDAR/Qwen3 use {ok!r})")
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ConfigError(f"RoPE scaling {rope!r} is not supported (only the default RoPE)")
        if "rope_theta" in rope:  # transformers 5 keeps theta inside rope_parameters
            hf.setdefault("rope_theta", rope["rope_theta"])
        dtype = hf.get("torch_dtype") or hf.get("dtype") or "bfloat16"
        known = {f.name for f in fields(cls)} - {"extra", "dtype"}
        values = {k: hf.pop(k) for k in list(hf) if k in known and hf[k] is not None}
        for key in ("torch_dtype", "dtype"):
            hf.pop(key, None)
        values.setdefault("head_dim", values["hidden_size"] // values["num_attention_heads"])
        values.setdefault("num_key_value_heads", values["num_attention_heads"])
        values.setdefault("block_size", DEFAULT_BLOCK_SIZE)
        if mask_token_id is None and SDAR_MASK_TOKEN_ID < values["vocab_size"]:
            mask_token_id = SDAR_MASK_TOKEN_ID
        values.setdefault("mask_token_id", mask_token_id)
        return cls(**values, dtype=dtype, extra=hf)

    def to_hf(self) -> dict:
        """The config.json dict; SDAR's model_type/architectures unless the extras say otherwise."""
        out = {"model_type": "sdar", "architectures": ["SDARForCausalLM"], "hidden_act": "silu",
               "attention_bias": False, **self.extra}
        out.update({k: v for k, v in asdict(self).items() if k not in ("extra", "dtype")})
        out["torch_dtype"] = self.dtype
        out.pop("rope_parameters", None)  # theta is written at top level; keep one source of truth
        return out


def _shape(hidden: int, inter: int, layers: int, heads: int, kv: int, tied: bool) -> ModelConfig:
    return ModelConfig(vocab_size=151936, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv, head_dim=128, tie_word_embeddings=tied)


# A small random model for CPU runs (CI, first contact); its vocabulary is the tokenizer's (tiny_config).
TINY_SHAPE = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, rope_theta=1e4, tie_word_embeddings=True)


def tiny_config(tokenizer_size: int, mask_token_id: int | None) -> ModelConfig:
    """The tiny shape over a tokenizer of `tokenizer_size` ids: its mask token (or the first id past the
    vocabulary, SDAR's convention), the vocabulary rounded up to a multiple of 64, float32."""
    mask = mask_token_id if mask_token_id is not None else tokenizer_size
    vocab = -(-max(tokenizer_size, mask + 1) // 64) * 64
    return ModelConfig(vocab_size=vocab, mask_token_id=mask, dtype="float32", **TINY_SHAPE)


# Published SDAR shapes, for benchmarks with random weights.
SDAR_SHAPES = {
    "1.7B": _shape(2048, 6144, 28, 16, 8, tied=True),
    "4B": _shape(2560, 9728, 36, 32, 8, tied=False),
    "8B": _shape(4096, 12288, 36, 32, 8, tied=False),
}
