"""Text in, text out: a checkpoint's model and tokenizer, the chat format, and `GenerationResult` records
(text, generated ids and each token's unmasking step) around the token-level decoder."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from dice_kernels.model.checkpoint import load_model
from dice_kernels.model.tokenizer import chat_prompt, load_tokenizer, stop_token_ids
from dice_kernels.model.transformer import BlockDiffusionLM
from dice_kernels.sampling.decoder import Response, SamplingConfig, decode


@dataclass
class GenerationResult:
    text: str  # the generated text, without the stop token
    token_ids: list[int]  # generated ids, through the stop token when there is one
    unmask_steps: list[int]  # per generated id: the denoising step (within its block) that unmasked it
    prompt_ids: list[int]  # generated token i sits at absolute position len(prompt_ids) + i
    stopped: bool  # ended at a stop token (False: reached max_new_tokens)


@dataclass
class Generator:
    model: BlockDiffusionLM
    tokenizer: Any

    @classmethod
    def from_checkpoint(cls, directory: str | Path, dtype: torch.dtype | None = None,
                        device: str | torch.device = "cpu") -> Generator:
        return cls(load_model(directory, dtype=dtype, device=device), load_tokenizer(directory))

    def prompt_ids(self, prompts: list[str], chat: bool = True, system: str | None = None) -> list[list[int]]:
        """The token ids `__call__` decodes after: each prompt, as a user turn in the chat format when `chat`."""
        texts = [chat_prompt(self.tokenizer, p, system) if chat else p for p in prompts]
        return [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]

    def __call__(self, prompts: list[str], cfg: SamplingConfig, chat: bool = True, system: str | None = None,
                 rows: int | None = None,
                 on_result: Callable[[int, GenerationResult], None] | None = None) -> list[GenerationResult]:
        """Generate for each prompt; `chat` wraps it as a user turn in the checkpoint's chat format. `rows`: decode
        at most this many at once, a finished row taking the next waiting prompt; `on_result(i, result)` gets
        prompt i's result as soon as it is done."""
        prompt_ids = self.prompt_ids(prompts, chat, system)
        results: list[GenerationResult | None] = [None] * len(prompts)

        def done(i: int, r: Response) -> None:
            results[i] = GenerationResult(text=self.tokenizer.decode(r.tokens[:-1] if r.stopped else r.tokens),
                                          token_ids=r.tokens, unmask_steps=r.unmask_steps, prompt_ids=prompt_ids[i],
                                          stopped=r.stopped)
            if on_result is not None:
                on_result(i, results[i])

        decode(self.model, prompt_ids, cfg, list(stop_token_ids(self.tokenizer)), rows=rows, on_response=done)
        return results
