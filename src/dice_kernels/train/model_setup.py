"""The initial model a trainer starts from: its tokenizer loaded and checked against the model's shape, block
size and mask token (`model_config`), and the model (a Hugging Face directory, or random init of a shape) built
straight into its FSDP shards (`build_model`)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from dice_kernels.model.checkpoint import load_config, load_model
from dice_kernels.model.config import SDAR_SHAPES, ModelConfig, tiny_config
from dice_kernels.model.transformer import BlockDiffusionLM
from dice_kernels.train.config import ModelSection, ParallelConfig
from dice_kernels.train.distributed import Dist, parallelize

SHAPES = ("tiny", *SDAR_SHAPES)
PAD_TOKEN = "<|endoftext|>"  # SDAR pads samples to whole blocks with it, and trains on it


class ModelSetupError(ValueError):
    """A model / tokenizer pair a trainer cannot use; the message names the directory and what to change."""


def load_tokenizer_for(section: ModelSection) -> Any:
    from dice_kernels.model.tokenizer import load_tokenizer

    try:
        return load_tokenizer(section.tokenizer_dir)
    except (OSError, ValueError) as e:
        raise ModelSetupError(f"{section.tokenizer_dir}: cannot load the tokenizer ({e}); model.tokenizer must "
                              "be a directory with tokenizer.json") from None


def model_config(section: ModelSection, tokenizer: Any) -> ModelConfig:
    """The model's shape, block size and mask id, checked against the tokenizer.

    The mask id is the config's (a checkpoint), else the tokenizer's mask token, else the first id past the
    tokenizer's vocabulary (SDAR's convention: 151669 = len(Qwen3's tokenizer)). It must not be an ordinary token.
    """
    from dice_kernels.model.checkpoint import CheckpointError

    declared = tokenizer.mask_token_id
    if section.checkpoint:
        try:
            cfg = load_config(section.checkpoint)
        except CheckpointError as e:
            raise ModelSetupError(str(e)) from None
    elif section.shape == "tiny":
        cfg = tiny_config(len(tokenizer), declared)
    elif section.shape in SDAR_SHAPES:
        cfg = SDAR_SHAPES[section.shape]
        if declared is not None:
            cfg = replace(cfg, mask_token_id=declared)
    else:
        raise ModelSetupError(f"model.shape {section.shape!r} is not one of {', '.join(SHAPES)}")
    where = section.checkpoint or section.tokenizer_dir
    mask = cfg.mask_token_id
    if mask is None:
        raise ModelSetupError(f"{where}: no mask token (the tokenizer declares none and config.json has no "
                              "mask_token_id): add mask_token to tokenizer_config.json or mask_token_id to config.json")
    if declared is not None and declared != mask:
        raise ModelSetupError(f"{where}: config.json's mask_token_id {mask} differs from the tokenizer's mask token "
                              f"id {declared}")
    if mask < len(tokenizer) and declared is None:
        raise ModelSetupError(f"{where}: mask_token_id {mask} is the ordinary token "
                              f"{tokenizer.convert_ids_to_tokens(mask)!r} of the tokenizer; declare a mask token")
    if len(tokenizer) > cfg.vocab_size:
        raise ModelSetupError(f"{where}: the tokenizer has {len(tokenizer)} tokens, more than the model's "
                              f"vocab_size {cfg.vocab_size}")
    if pad_token_id(tokenizer) is None:
        raise ModelSetupError(f"{section.tokenizer_dir}: the tokenizer has no {PAD_TOKEN}, pad or eos token")
    return cfg


def pad_token_id(tokenizer: Any) -> int | None:
    """<|endoftext|> (SDAR's pad-to-block token), else the tokenizer's pad, else its eos."""
    vocab = tokenizer.get_vocab()
    if PAD_TOKEN in vocab:
        return vocab[PAD_TOKEN]
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def _init_weights(model: BlockDiffusionLM, seed: int) -> None:
    """Random init that does not depend on the number of ranks: each parameter's full tensor comes from a
    generator seeded by (seed, parameter index) on this rank's device, and the rank keeps its shard."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            device = p.device
            gen = torch.Generator(device).manual_seed(seed * 100_003 + i)
            if name.endswith("norm.weight"):
                full = torch.ones(p.shape, device=device)
            else:
                full = torch.randn(p.shape, generator=gen, device=device).mul_(0.02)
            if isinstance(p, DTensor):
                full = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
            p.copy_(full)


def build_model(section: ModelSection, parallel: ParallelConfig, dist: Dist,
                tokenizer: Any) -> BlockDiffusionLM:
    """The initial model, sharded over all ranks with fp32 master weights: built on the meta device, sharded,
    then materialised shard by shard (a checkpoint is read on rank 0 only and broadcast)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    cfg = replace(model_config(section, tokenizer), dtype="float32")
    with torch.device("meta"):
        model = BlockDiffusionLM(cfg)
    parallelize(model, model.model.layers, parallel, dist.device, forward_methods=("hidden_states",))
    model.to_empty(device=dist.device)
    if section.checkpoint:
        full = load_model(section.checkpoint, dtype=torch.float32).state_dict() if dist.is_main else {}
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        del full
    else:
        _init_weights(model, section.seed)
    return model
