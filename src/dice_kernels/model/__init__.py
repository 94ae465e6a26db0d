"""SDAR-compatible block-diffusion transformer: config, attention masks and KV cache, the decoder, checkpoint I/O
and tokenizer glue. Imports only torch (and safetensors/transformers lazily, inside the functions that need them)."""

from dice_kernels.model.attention import (Attention, KVCache, Layout, block_diffusion_mask_mod, dense_mask,
                                          flex_block_mask)
from dice_kernels.model.checkpoint import CheckpointError, load_config, load_model, save_model
from dice_kernels.model.config import SDAR_SHAPES, ConfigError, ModelConfig
from dice_kernels.model.transformer import BlockDiffusionLM

__all__ = ["Attention", "BlockDiffusionLM", "CheckpointError", "ConfigError", "KVCache", "Layout", "ModelConfig",
           "SDAR_SHAPES", "block_diffusion_mask_mod", "dense_mask", "flex_block_mask", "load_config", "load_model",
           "save_model"]
