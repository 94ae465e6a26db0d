"""Tiny random models, tokenizers and checkpoints for the model / sampling / objective tests (CPU, seconds)."""

from __future__ import annotations

from pathlib import Path

import torch

from dice_kernels.model import BlockDiffusionLM, ModelConfig, save_model

VOCAB = 320
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = ["import torch", "class ModelNew(nn.Module):", "def forward(self, x):", "return torch.relu(x)",
           "__global__ void kernel(float* out)", "hello world", "write a cuda kernel"]


def tiny_config(**changes) -> ModelConfig:
    values = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1e4,
                  mask_token_id=VOCAB - 1, dtype="float32")
    return ModelConfig(**(values | changes))


def tiny_model(seed: int = 0, **changes) -> BlockDiffusionLM:
    """Random weights at a scale that makes logits far from uniform (norm weights random too)."""
    torch.manual_seed(seed)
    model = BlockDiffusionLM(tiny_config(**changes))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if name.endswith("norm.weight") else 0.15 * torch.randn_like(p))
    return model.eval()


def save_tiny_tokenizer(directory: Path) -> object:
    """A byte-level BPE tokenizer (< VOCAB ids) with Qwen's special tokens and a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 20, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   mask_token="<|MASK|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(directory))
    return fast


def save_tiny_checkpoint(directory: Path, seed: int = 0, **changes) -> BlockDiffusionLM:
    """An SDAR-style checkpoint directory: config.json, model.safetensors, tokenizer files."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = save_tiny_tokenizer(directory)
    model = tiny_model(seed, mask_token_id=tokenizer.mask_token_id, **changes)
    save_model(model, directory)
    return model


def record_committing(monkeypatch) -> list[bool]:
    """The cached decoder's forwards as they run: True where some row committed a block (a forward of twice the
    queries for every row)."""
    from dice_kernels.sampling import decoder

    committing: list[bool] = []
    call = decoder._CachedForward.__call__

    def counting(self, state, any_commit, kv_len):
        committing.append(any_commit)
        return call(self, state, any_commit, kv_len)

    monkeypatch.setattr(decoder._CachedForward, "__call__", counting)
    return committing
