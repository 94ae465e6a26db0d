"""A small byte-level BPE tokenizer trained on the demo world's text, saved as a Hugging Face tokenizer directory
that `model.tokenizer.load_tokenizer` reads: Qwen's chat tokens, a mask token and a Qwen3-style chat template.

Pre-tokenization cuts lines into indentation, `// `, single digits and the runs between them, and BPE merges only
within a run: a boilerplate line is one token or two (short prompts for a CPU-sized model), while a forward line
is the same tokens in the prompt and in a solution's `// ` comment, and a constant is a token the model can copy.
Qwen3's own vocabulary (151k ids) would make the embedding and head of a CPU-sized model most of its compute.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

ENDOFTEXT, IM_START, IM_END, MASK = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, MASK)
# Qwen3's ChatML turns; the generation prompt ends with the empty think block that `prompts.chat_prompt` writes,
# so a prompt made with the template and one made by the data formats are the same text.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n\n</think>\n\n{% endif %}"
)
LINE = r"[^\n]*\n|[^\n]+"  # one line with its newline
# within a line: indentation (2+ spaces), a comment marker, a number (not the digits of a name like int64_t); each
# its own piece, the text between them too
PIECE = r" {2,}|// |(?<![A-Za-z_0-9.])[0-9]+(?:\.[0-9]+)?"


def train_tokenizer(texts: Iterable[str], out_dir: Path, vocab_size: int = 4096) -> Any:
    """Train on `texts`, save to `out_dir` (tokenizer.json + config files) and return the fast tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LINE), behavior="isolated"),
        pre_tokenizers.Split(Regex(PIECE), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token=ENDOFTEXT, mask_token=MASK)
    fast.chat_template = CHAT_TEMPLATE
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    return fast
