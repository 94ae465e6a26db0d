"""Hugging Face checkpoint directories: config.json, model.safetensors or a sharded index, tokenizer files.
Weights are matched by their Qwen3 names; a missing, unexpected or mis-shaped tensor is an error that names it.
A checkpoint is named by its folder or by a Hub id (owner/name) that huggingface_hub's cache already holds
(`resolve_checkpoint`: never a download)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from torch import Tensor

from dice_kernels.model.config import ModelConfig
from dice_kernels.model.transformer import BlockDiffusionLM

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Everything a tokenizer / chat format may need; copied verbatim on save.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json", "generation_config.json")


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded as written; the message names the file or tensor."""


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # owner/name, as the Hub spells repository ids


def resolve_checkpoint(name: str | Path) -> Path:
    """The folder of checkpoint `name`: a folder holding config.json, or the snapshot of a Hub id in the local
    Hugging Face cache ($HF_HUB_CACHE; only what is cached, so a config.json alone serves a memory plan). A training
    run folder is pointed to its final/ export."""
    path = Path(name)
    if not path.exists() and HUB_ID.fullmatch(str(name)):
        path = _cached_snapshot(str(name))
    if not path.is_dir():
        raise CheckpointError(f"{name}: no such checkpoint folder (give a folder with config.json and "
                              "*.safetensors, or a Hub id such as JetLM/SDAR-4B-Chat)")
    if not (path / "config.json").is_file():
        if (path / "final" / "config.json").is_file():
            raise CheckpointError(f"{name} is a training run folder: give its export, {path / 'final'}")
        raise CheckpointError(f"{name}: no config.json, so not a Hugging Face checkpoint folder (give the folder "
                              "holding config.json, *.safetensors and tokenizer.json)")
    return path


def _cached_snapshot(hub_id: str) -> Path:
    """The cached snapshot of `hub_id`, without touching the network."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        raise CheckpointError(f"{hub_id}: no such folder; reading it as a Hub id needs huggingface_hub: "
                              "pip install 'dice-kernels[model]'") from None
    try:
        return Path(snapshot_download(hub_id, local_files_only=True))
    except LocalEntryNotFoundError:
        raise CheckpointError(f"{hub_id}: no such folder, and the Hugging Face cache does not hold this Hub id: "
                              f"fetch it first (huggingface-cli download {hub_id}) or give the checkpoint "
                              "folder") from None


def _mask_id_from_tokenizer_files(directory: Path) -> int | None:
    """The id of the mask token tokenizer_config.json declares, looked up in its added tokens or tokenizer.json."""
    config_path, tokenizer_path = directory / "tokenizer_config.json", directory / "tokenizer.json"
    if not config_path.is_file():
        return None
    config = json.loads(config_path.read_text())
    mask = config.get("mask_token")
    mask = mask.get("content") if isinstance(mask, dict) else mask
    if mask is None:
        return None
    ids = {added["content"]: int(i) for i, added in config.get("added_tokens_decoder", {}).items()}
    if tokenizer_path.is_file():
        tokenizer = json.loads(tokenizer_path.read_text())
        ids.update({added["content"]: added["id"] for added in tokenizer.get("added_tokens", [])})
    return ids.get(mask)


def load_config(directory: str | Path) -> ModelConfig:
    """config.json, with SDAR's defaults for a missing block_size (4) and mask_token_id (the tokenizer's mask
    token, else 151669)."""
    directory = Path(directory)
    path = directory / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{directory}: no config.json (is this a Hugging Face checkpoint directory?)")
    return ModelConfig.from_hf(json.loads(path.read_text()), mask_token_id=_mask_id_from_tokenizer_files(directory))


def _weight_files(directory: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it."""
    if (directory / INDEX_FILE).is_file():
        weight_map = json.loads((directory / INDEX_FILE).read_text())["weight_map"]
        return {name: directory / shard for name, shard in weight_map.items()}
    if (directory / SINGLE_FILE).is_file():
        from safetensors import safe_open

        with safe_open(directory / SINGLE_FILE, framework="pt") as f:
            return {name: directory / SINGLE_FILE for name in f.keys()}
    raise CheckpointError(f"{directory}: neither {SINGLE_FILE} nor {INDEX_FILE}")


def _expected_shapes(model: BlockDiffusionLM) -> dict[str, torch.Size]:
    shapes = {name: t.shape for name, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        del shapes["lm_head.weight"]  # tied: stored once, as the embedding
    return shapes


def _read_tensors(files: dict[str, Path], names: list[str], dtype: torch.dtype, device: torch.device) -> dict[str, Tensor]:
    from safetensors import safe_open

    out: dict[str, Tensor] = {}
    for shard in sorted(set(files[n] for n in names)):
        with safe_open(shard, framework="pt", device=str(device)) as f:
            for name in names:
                if files[name] == shard:
                    out[name] = f.get_tensor(name).to(dtype)
    return out


def load_model(directory: str | Path, dtype: torch.dtype | None = None,
               device: str | torch.device = "cpu") -> BlockDiffusionLM:
    """Build the model from a checkpoint directory, in `dtype` (default: the checkpoint's) on `device`."""
    directory, device = Path(directory), torch.device(device)
    cfg = load_config(directory)
    dtype = dtype or cfg.torch_dtype
    with torch.device("meta"):  # no random init: every parameter is about to be assigned
        model = BlockDiffusionLM(cfg)
    expected = _expected_shapes(model)
    files = _weight_files(directory)
    stored = set(files)
    if cfg.tie_word_embeddings and "lm_head.weight" in stored:
        stored.discard("lm_head.weight")  # some exporters write the tied copy too; the embedding is the source
    missing, unexpected = sorted(set(expected) - stored), sorted(stored - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"{directory}: tensors do not match the config: "
                              f"missing {missing or 'none'}; unexpected {unexpected or 'none'}")
    tensors = _read_tensors(files, sorted(expected), dtype, device)
    wrong = [f"{n}: {tuple(t.shape)} in the file, {tuple(expected[n])} from the config"
             for n, t in tensors.items() if t.shape != expected[n]]
    if wrong:
        raise CheckpointError(f"{directory}: mis-shaped tensors: " + "; ".join(wrong))
    model.load_state_dict(tensors, strict=False, assign=True)
    model.tie_weights()
    return model.eval()


def save_model(model: BlockDiffusionLM, directory: str | Path, tokenizer_dir: str | Path | None = None,
               max_shard_bytes: int = 5 * 2**30) -> None:
    """Write config.json and the weights (sharded with an index past `max_shard_bytes`), and copy the
    tokenizer files from `tokenizer_dir`."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {n: t.detach().contiguous().cpu() for n, t in model.state_dict().items() if n in _expected_shapes(model)}
    dtype = str(next(iter(state.values())).dtype).removeprefix("torch.")
    cfg = model.config
    hf = cfg.to_hf() | {"torch_dtype": dtype}
    (directory / "config.json").write_text(json.dumps(hf, indent=2) + "\n")

    for stale in [directory / SINGLE_FILE, directory / INDEX_FILE, *directory.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)  # a previous save with other sharding must not shadow this one
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for name in sorted(state):
        nbytes = state[name].numel() * state[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = state[name]
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], directory / SINGLE_FILE, metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, directory / file, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, file))
        total = sum(t.numel() * t.element_size() for t in state.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")

    if tokenizer_dir is not None and Path(tokenizer_dir).resolve() != directory.resolve():
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_dir) / name).is_file():
                shutil.copy2(Path(tokenizer_dir) / name, directory / name)
