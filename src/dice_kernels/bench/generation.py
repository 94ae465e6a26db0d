"""The generation half of a bench run: one end-to-end prompt per (task, sample), decoded in batches with the
KV-cached block-diffusion sampler, a finished row taking the next waiting prompt. Each output is written as soon as it
is done, as
`generations/<level>/<task>/s<k>.md` (the raw text) and `s<k>.json` (tokens, stop, seconds, decoding settings);
an output whose `.json` exists is never generated again, which is what makes a killed run resumable."""

from __future__ import annotations

import json
import os
import re
import time
import zlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from dice_kernels.bench.config import BenchConfig
from dice_kernels.tasks import Task

if TYPE_CHECKING:
    from dice_kernels.sampling.generate import GenerationResult

_UNSAFE = re.compile(r"[^\w.-]+")


@dataclass(frozen=True)
class Item:
    task: Task
    sample: int

    @property
    def candidate_id(self) -> str:
        return f"{self.task.id}#s{self.sample}"


def output_paths(root: Path, item: Item) -> tuple[Path, Path]:
    """(raw text, record) of one generation: a KernelBench-like layout that `dice eval --solutions` also pairs."""
    level = f"level{item.task.level}" if item.task.level is not None else "other"
    folder = root / level / _UNSAFE.sub("_", item.task.name)
    return folder / f"s{item.sample}.md", folder / f"s{item.sample}.json"


def pending(root: Path, tasks: list[Task], samples: int, settings: dict) -> list[Item]:
    """The (task, sample) outputs not written yet. A finished output made with other settings is an error: mixing
    two decodings in one table would be silently wrong."""
    todo = []
    for task in tasks:
        for k in range(samples):
            item = Item(task, k)
            text_path, record_path = output_paths(root, item)
            if not record_path.is_file():
                todo.append(item)
                continue
            recorded = json.loads(record_path.read_text()).get("settings")
            if recorded != settings:
                raise ValueError(f"{record_path} was generated with other settings ({_diff(recorded, settings)}); "
                                 "use a new --out, or the settings of that run")
    return todo


def _diff(old: dict | None, new: dict) -> str:
    old = old or {}
    keys = sorted(k for k in {*old, *new} if old.get(k) != new.get(k))
    return "; ".join(f"{k}: {old.get(k)} -> {new.get(k)}" for k in keys)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def generate(cfg: BenchConfig, items: list[Item], root: Path, log: Callable[[dict], None],
             advance: Callable[[int], None]) -> None:
    """Decode `items` `cfg.batch_size` rows at a time, a row whose output ended taking the next waiting item (so a
    batch never waits for its longest output), and write each output as soon as it is done.

    `log` receives one timing record for the model load and one for the generation; `advance` the outputs written.
    """
    import torch

    from dice_kernels.prompts import SYSTEM_PROMPT, e2e_user
    from dice_kernels.sampling.generate import Generator

    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device)
    dtype = (None if device.type == "cuda" else torch.float32) if cfg.dtype == "auto" else getattr(torch, cfg.dtype)
    began = time.perf_counter()
    generator = Generator.from_checkpoint(cfg.checkpoint, dtype=dtype, device=device)
    log({"phase": "load_model", "seconds": time.perf_counter() - began})
    settings = cfg.generation_settings()
    backend = settings["prompt_backend"]
    prompts = {t.id: e2e_user(t.code, backend) for t in {i.task.id: i.task for i in items}.values()}
    # longest prompts first: the first rows have similar lengths, so the shared prefill wastes little
    items = sorted(items, key=lambda i: (-len(prompts[i.task.id]), i.task.id, i.sample))
    decoding = cfg.decoding
    if decoding.seed is not None:  # the random stream depends on the first output, not on the order run
        decoding = replace(decoding, seed=decoding.seed + zlib.crc32(items[0].candidate_id.encode()))
    began = time.perf_counter()

    def write(at: int, r: GenerationResult) -> None:
        item = items[at]
        text_path, record_path = output_paths(root, item)
        text_path.parent.mkdir(parents=True, exist_ok=True)
        _write_atomic(text_path, r.text)
        record = {"task_id": item.task.id, "task_name": item.task.name, "sample": item.sample,
                  "tokens": len(r.token_ids), "prompt_tokens": len(r.prompt_ids), "stopped": r.stopped,
                  "done_after_s": round(time.perf_counter() - began, 3), "rows": cfg.batch_size,
                  "settings": settings, "seed": decoding.seed}
        _write_atomic(record_path, json.dumps(record, indent=1))  # written last: marks the output done
        advance(1)

    results = generator([prompts[i.task.id] for i in items], decoding, chat=True, system=SYSTEM_PROMPT,
                        rows=cfg.batch_size, on_result=write)
    log({"phase": "generate", "seconds": time.perf_counter() - began, "rows": len(items),
         "tokens": sum(len(r.token_ids) for r in results)})
    del generator
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the harness's workers need the GPU next
