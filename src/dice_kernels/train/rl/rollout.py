"""Rollouts: each step's prompts (end-to-end or infilling, in the chat format SFT trains on) decoded `group`
times each by the block-diffusion sampler, batched; each response keeps its trajectory (per-token unmasking
step) for TraceRL and becomes a harness candidate. Infilling candidates are prefix + generated core + suffix."""

from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dice_kernels.data.format import example_cut
from dice_kernels.data.infill import InfillError, split_program
from dice_kernels.harness.candidate import Candidate, candidate_from_text, extract_code
from dice_kernels.model.transformer import BlockDiffusionLM
from dice_kernels.prompts import SYSTEM_PROMPT, chat_prompt, e2e_user, infill_user
from dice_kernels.sampling.decoder import SamplingConfig, decode, release_graphs
from dice_kernels.train.rl.curriculum import RLTask
from dice_kernels.train.rl.tracerl import Trajectory

PHASES = ("infill", "e2e")


@dataclass
class Rollout:
    task: RLTask
    sample: int  # index within the task's group
    trajectory: Trajectory
    text: str  # the response, without its stop token
    stopped: bool  # False: cut at max_new_tokens
    candidate: Candidate


def rollout_prompt(task: RLTask, phase: str, backend: str) -> str:
    """The chat prompt of a task: infilling shows prefix and suffix, end-to-end the whole reference. The CPU
    backend asks for C++ (`load_inline` with cpp_sources only): it cannot run CUDA."""
    if phase == "infill":
        if not task.infill:
            raise ValueError(f"task {task.id} has no infilling split (prefix/suffix): use an rl_infill task set")
        user = infill_user(task.reference, task.prefix, task.suffix, example_cut(backend), backend)
    elif phase == "e2e":
        user = e2e_user(task.reference, backend)
    else:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    return chat_prompt(user, SYSTEM_PROMPT)


def prompt_ids(tokenizer, task: RLTask, phase: str, backend: str) -> list[int]:
    """The token ids of `rollout_prompt`, as the sampler decodes after them."""
    return tokenizer.encode(rollout_prompt(task, phase, backend), add_special_tokens=False)


def infill_core(text: str) -> tuple[str | None, str]:
    """(core, problem) from an infilling response. The model is asked for the whole program in a code block; the
    core is the kernel-source assignment cut from it (data/infill.split_program). A code body that is not a whole
    program is taken as the core itself (a model that wrote only the source string). None: nothing usable."""
    code, problem = extract_code(text)
    if (code is None and "truncated" in problem) or not text.strip():
        return None, problem or "no code: the output is empty"
    body = code if code is not None else text
    try:
        return split_program(body).core, ""
    except InfillError:
        return body.strip("\n"), ""


def response_candidate(task: RLTask, phase: str, text: str, id: str) -> Candidate:
    """The harness candidate of a response: the extracted program (e2e), or prefix + core + suffix (infill)."""
    if phase == "e2e":
        return candidate_from_text(text, id=id)
    core, problem = infill_core(text)
    program = None if core is None else task.prefix + core + task.suffix
    return Candidate(id=id, code=program, problem=problem)


def generate_rollouts(model: BlockDiffusionLM, tokenizer: Any, tasks: list[RLTask], group: int, phase: str,
                      backend: str, sampling: SamplingConfig, batch_rows: int, step: int,
                      stop_ids: list[int], keep_graphs: bool = False) -> list[Rollout]:
    """`group` responses per task, decoded `batch_rows` rows at a time (a task's group shares its prompt); a row
    whose response ends takes the next waiting one, so a batch does not wait for its longest response. The seed
    derives from the sampling seed and the step, so a resumed step redraws the same responses from the same weights.
    The decoder's KV cache and graphs are freed at the end unless `keep_graphs` (a training update would otherwise
    hold them)."""
    prompts = [prompt_ids(tokenizer, t, phase, backend) for t in tasks]
    rows = [(ti, k) for ti in range(len(tasks)) for k in range(group)]
    out: list[Rollout] = []
    was_training = model.training
    model.eval()
    try:
        seed = None if sampling.seed is None else sampling.seed + 1_000_003 * step
        cfg = SamplingConfig(**{**sampling.__dict__, "seed": seed})
        decoded = decode(model, [prompts[ti] for ti, _ in rows], cfg, stop_ids, rows=batch_rows)
        for i, (ti, k) in enumerate(rows):
            ids, stopped = decoded.tokens[i], decoded.stopped[i]
            text = tokenizer.decode(ids[:-1] if stopped else ids)
            task = tasks[ti]
            cid = f"step{step}/{task.id}/{k}"
            trajectory = Trajectory(prompts[ti], ids, decoded.unmask_steps[i], decoded.tail_tokens[i],
                                    decoded.tail_steps[i])
            out.append(Rollout(task=task, sample=k, trajectory=trajectory, text=text, stopped=stopped,
                               candidate=response_candidate(task, phase, text, cid)))
    finally:
        if not keep_graphs:
            release_graphs(model)
        model.train(was_training)
    return out


def save_rollouts(path: Path, rollouts: list[Rollout], rewards: list[float]) -> None:
    """One step's rollouts as gzipped JSON lines: task, sample, candidate id (its row in rewards.sqlite and the
    harness's results), reward, whether it stopped, its token count and its text, so a run's samples can be read
    and scored again (a DICE-reward run's rollouts under the robust check). A step redone after a resume replaces
    its file whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{os.getpid()}")
    with gzip.open(staging, "wt", encoding="utf-8") as f:
        for r, reward in zip(rollouts, rewards, strict=True):
            f.write(json.dumps({"task_id": r.task.id, "sample": r.sample, "candidate_id": r.candidate.id,
                                "reward": reward, "stopped": r.stopped, "tokens": len(r.trajectory.tokens),
                                "text": r.text}) + "\n")
    os.replace(staging, path)
