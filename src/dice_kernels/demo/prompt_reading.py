"""Does the SFT model read the task from the prompt? `operator_copy` scores the line of a solution that copies the
task's first forward step (`// x = torch.tanh(x)`), teacher-forced on SFT's own samples: a model that writes it
wrong guesses the operator, and RL can re-weight guesses but not teach the reading (docs/demo.md, "Measured")."""

from __future__ import annotations

import json
from pathlib import Path

BLOCK_SIZE = 4  # the demo's block size (SFT, rollouts and benchmarks)
MASKED_BLOCKS = 3  # the line and what follows it: its tokens must not be visible to their own prediction
GUESSING_BELOW = 0.5  # the share of right lines under which the report says the SFT model guesses the operator


def operator_line_start(response: str) -> int | None:
    """Where the first `//` line after the `// def forward` line starts: in every solution of the world (fused, op
    by op, shortcut; C++ and CUDA) the comment that copies the task's first forward step; None without one."""
    forward = response.find("// def forward")
    comment = response.find("//", response.find("\n", forward)) if forward >= 0 else -1
    return None if comment < 0 else response.rfind("\n", 0, comment) + 1


def operator_copy(sft_rows: Path, tokenizer_dir: Path, checkpoint: Path, samples: int = 64) -> dict:
    """{"samples": n, "right": k}: of up to `samples` end-to-end SFT rows, on how many the model writes the operator
    line exactly right when the MASKED_BLOCKS blocks from that line on are masked and everything before stays
    clean, each masked token its argmax, through the SFT objective's own forward (train/sft/objective.py). No
    sampling and no decoding order in the way, on data the model trained on."""
    import torch

    from dice_kernels.data.records import read_jsonl
    from dice_kernels.model.checkpoint import load_model
    from dice_kernels.model.tokenizer import load_tokenizer
    from dice_kernels.train.model_setup import pad_token_id
    from dice_kernels.train.sft.objective import noisy_hidden_states, pack

    tok, model = load_tokenizer(tokenizer_dir), load_model(checkpoint).float().eval()
    mask_id, block = model.config.mask_token_id, BLOCK_SIZE
    right = seen = 0
    for row in read_jsonl(sft_rows):
        start = operator_line_start(row["response"]) if row["kind"] == "e2e" else None
        if start is None:
            continue
        response = row["response"]
        prompt = tok.encode(row["prompt"], add_special_tokens=False)
        ids, before = (tok.encode(t, add_special_tokens=False) for t in (response, response[:start]))
        if ids[:len(before)] != before:  # the line does not start on a token boundary: no clean cut to mask from
            continue
        batch = pack([(prompt, ids)], block, pad_token_id(tok))
        at = len(prompt) + len(before)
        masked = torch.zeros_like(batch.response)
        masked[0, at // block * block: (at // block + MASKED_BLOCKS) * block] = True
        masked &= batch.response  # the prompt's tail in the line's first block stays clean, as in training
        with torch.no_grad():
            hidden = noisy_hidden_states(model, batch, torch.where(masked, mask_id, batch.input_ids), block, "dense")
            logits = model.lm_head(hidden[masked])
        logits[:, mask_id] = float("-inf")
        written = batch.input_ids.clone()
        written[masked] = logits.argmax(-1)
        line = tok.decode(written[0, at:].tolist()).split("\n")[0].strip()
        right += line == response[start:].split("\n")[0].strip()
        seen += 1
        if seen == samples:
            break
    return {"samples": seen, "right": right}


def stage_operator_copy(sft_rows: Path, tokenizer_dir: Path, checkpoint: Path, out: Path) -> dict:
    """`operator_copy` of a checkpoint, kept in `out` (read back when it is there)."""
    if out.is_file():
        return json.loads(out.read_text())
    result = operator_copy(sft_rows, tokenizer_dir, checkpoint)
    out.write_text(json.dumps(result))
    return result
