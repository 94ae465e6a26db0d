"""Tokenizer and chat format from a checkpoint directory, and the stop tokens. The mask token is never looked up
by string (it differs between SDAR tokenizer files): it is `ModelConfig.mask_token_id`. transformers is imported
inside the functions so `import dice_kernels.model` stays light."""

from __future__ import annotations

from pathlib import Path
from typing import Any

STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")  # Qwen3's end of turn and end of text
# Qwen3's ChatML turn format, used when a tokenizer ships no chat template.
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def load_tokenizer(directory: str | Path) -> Any:
    """The checkpoint's fast tokenizer (tokenizer.json). Loaded as PreTrainedTokenizerFast directly: AutoTokenizer
    would look up the model_type, which transformers does not know for SDAR."""
    from transformers import PreTrainedTokenizerFast

    if not (Path(directory) / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{directory}: no tokenizer.json")
    return PreTrainedTokenizerFast.from_pretrained(str(directory))


def byte_tokenizer() -> Any:
    """A tokenizer that needs no download: one token per byte (byte-level BPE without merges), Qwen3's end and chat
    tokens and a mask token; for a random model that runs the pipeline end to end (`dice generate --random-init`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   mask_token="<|mask|>", additional_special_tokens=["<|im_start|>", "<|im_end|>"])


def stop_token_ids(tokenizer: Any) -> tuple[int, ...]:
    """<|im_end|> and <|endoftext|> (whichever the vocabulary has) and the tokenizer's eos."""
    vocab = tokenizer.get_vocab()
    stops = [vocab[t] for t in STOP_TOKENS if t in vocab]
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in stops:
        stops.append(tokenizer.eos_token_id)
    if not stops:
        raise ValueError(f"the tokenizer has none of the stop tokens {STOP_TOKENS} and no eos token")
    return tuple(stops)


def chat_prompt(tokenizer: Any, user: str, system: str | None = None) -> str:
    """`user` (and an optional system message) as a chat turn ready for the assistant's reply."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    template = None if tokenizer.chat_template else CHATML_TEMPLATE
    return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=True)
