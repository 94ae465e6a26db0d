"""SFT data: the `dice data build` rows (data/format.py SFTRow, JSONL or Parquet) tokenized with the model's tokenizer,
cut to the cutoff (truncate or drop, counted), shuffled per epoch with a seeded permutation and packed first-fit
into rows of whole block-padded samples. Which rows an optimizer step trains on is a pure function of (seed,
step), so the data position of a resumed run is just its step."""

from __future__ import annotations

import functools
import hashlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from dice_kernels.config_io import ConfigError
from dice_kernels.train.sft.objective import PackedBatch, pack

FIELDS = ("prompt", "response")  # the SFTRow fields training reads; the chat format is already in the text


class DataError(ValueError):
    """A dataset that cannot be trained on; the message names the file (and line)."""


@dataclass
class SFTDataConfig:
    path: str = ""  # `dice data build` output: <out>/sft.jsonl or <out>/sft.parquet
    cutoff: int = 6144  # most tokens of one sample (prompt + response, padded to whole blocks)
    overflow: Literal["truncate", "drop"] = "truncate"  # a longer sample: cut the response's tail, or skip it
    seq_len: int = 0  # packed row length; 0 = cutoff
    shuffle: bool = True  # a new seeded permutation every epoch

    def __post_init__(self) -> None:
        if not self.path:
            raise ConfigError("data.path is required: the SFT rows (`dice data build --out DIR` writes DIR/sft.jsonl)")
        if self.cutoff < 1 or self.seq_len < 0:
            raise ConfigError("data.cutoff must be >= 1 and data.seq_len >= 0")
        if self.seq_len and self.seq_len < self.cutoff:
            raise ConfigError(f"data.seq_len ({self.seq_len}) must be >= data.cutoff ({self.cutoff}): "
                              "a packed row holds whole samples")

    @property
    def row_len(self) -> int:
        return self.seq_len or self.cutoff


def _check_row(row: Any, where: str) -> dict:
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object with {', '.join(FIELDS)}, got {type(row).__name__}")
    for name in FIELDS:
        if not isinstance(row.get(name), str):
            raise DataError(f"{where}: field {name!r} is missing or not a string")
    return row


def read_rows(path: str | Path) -> list[dict]:
    """SFT rows from JSONL (one object per line) or Parquet; a bad row is an error naming file and line."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: dataset file not found (`dice data build --out DIR` writes DIR/sft.jsonl)")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as e:  # pyarrow raises several types for a damaged file
            raise DataError(f"{path}: not a readable Parquet file ({e})") from None
        rows = [_check_row(r, f"{path}: row {i}") for i, r in enumerate(table.to_pylist())]
    else:
        rows = []
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(_check_row(json.loads(line), f"{path}:{i}"))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{i}: not valid JSON ({e.msg})") from None
    if not rows:
        raise DataError(f"{path}: no rows")
    return rows


@dataclass
class CutStats:
    rows: int = 0
    truncated: int = 0
    dropped: int = 0
    tokens: int = 0  # block-padded tokens of the kept samples


def tokenize(rows: list[dict], tokenizer: Any, cfg: SFTDataConfig,
             block_size: int) -> tuple[list[tuple[list[int], list[int]]], CutStats]:
    """(prompt ids, response ids) per row, cut so that the block-padded sample fits `cfg.cutoff`."""
    enc = lambda texts: tokenizer(texts, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompts, responses = enc([r["prompt"] for r in rows]), enc([r["response"] for r in rows])
    fit = cfg.cutoff // block_size * block_size  # the most unpadded tokens whose padded length fits
    samples, stats = [], CutStats(rows=len(rows))
    for prompt, response in zip(prompts, responses):
        if len(prompt) + len(response) > fit:
            if cfg.overflow == "drop" or len(prompt) >= fit:
                stats.dropped += 1
                continue
            response = response[:fit - len(prompt)]
            stats.truncated += 1
        if not response:
            stats.dropped += 1  # nothing to train on
            continue
        samples.append((prompt, response))
        stats.tokens += -(-(len(prompt) + len(response)) // block_size) * block_size
    return samples, stats


OPEN_ROWS = 64  # first-fit looks at the newest rows that still have room (bounded cost per sample)


def pack_rows(lengths: list[int], order: list[int], row_len: int) -> list[list[int]]:
    """First-fit over the open rows: each sample (in `order`) goes into the oldest of the last OPEN_ROWS rows
    with room for it, else opens a new row."""
    rows: list[list[int]] = []
    room: list[int] = []
    open_rows: list[int] = []
    for i in order:
        target = next((r for r in open_rows if lengths[i] <= room[r]), None)
        if target is None:
            target = len(rows)
            rows.append([])
            room.append(row_len)
            open_rows = (open_rows + [target])[-OPEN_ROWS:]
        rows[target].append(i)
        room[target] -= lengths[i]
    return rows


@dataclass
class StepData:
    batch: PackedBatch  # the global batch of this optimizer step: [global rows, row_len]
    tokens: int  # sample tokens in it (block-padded; without the rows' unused tails)
    epoch: int  # 0-based


@dataclass
class SFTData:
    """Tokenized samples and the step -> rows plan. `rows_per_step` is the global batch in packed rows."""

    samples: list[tuple[list[int], list[int]]]
    stats: CutStats
    row_len: int
    block_size: int
    pad_id: int
    rows_per_step: int
    seed: int
    shuffle: bool = True
    _epochs: list[list[list[int]]] = field(default_factory=list, repr=False)

    @classmethod
    def load(cls, cfg: SFTDataConfig, tokenizer: Any, block_size: int, pad_id: int, rows_per_step: int,
             seed: int) -> SFTData:
        samples, stats = tokenize(read_rows(cfg.path), tokenizer, cfg, block_size)
        if not samples:
            raise DataError(f"{cfg.path}: every row was dropped by the cutoff ({cfg.cutoff} tokens, "
                            f"overflow={cfg.overflow})")
        return cls(samples, stats, cfg.row_len, block_size, pad_id, rows_per_step, seed, cfg.shuffle)

    def _length(self, i: int) -> int:
        prompt, response = self.samples[i]
        return -(-(len(prompt) + len(response)) // self.block_size) * self.block_size

    def epoch_rows(self, epoch: int) -> list[list[int]]:
        """The packed rows (sample indices) of `epoch`: a permutation seeded by (seed, epoch), then first-fit."""
        while len(self._epochs) <= epoch:
            order = list(range(len(self.samples)))
            if self.shuffle:
                random.Random(self.seed * 1_000_003 + len(self._epochs)).shuffle(order)
            self._epochs.append(pack_rows([self._length(i) for i in range(len(self.samples))], order,
                                          self.row_len))
        return self._epochs[epoch]

    def steps_in_epoch(self, epoch: int) -> int:
        return -(-len(self.epoch_rows(epoch)) // self.rows_per_step)

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, step within the epoch) of 0-based optimizer step `step`."""
        epoch = 0
        while step >= self.steps_in_epoch(epoch):
            step -= self.steps_in_epoch(epoch)
            epoch += 1
        return epoch, step

    def total_steps(self, epochs: int) -> int:
        return sum(self.steps_in_epoch(e) for e in range(epochs))

    def step(self, step: int) -> StepData:
        """The global batch of 0-based optimizer step `step`; an epoch's last step fills up with empty rows."""
        epoch, k = self.position(step)
        rows = self.epoch_rows(epoch)[k * self.rows_per_step:(k + 1) * self.rows_per_step]
        rows = rows + [[]] * (self.rows_per_step - len(rows))
        packed = [pack([self.samples[i] for i in row], self.block_size, self.pad_id, self.row_len) for row in rows]
        batch = PackedBatch(*(torch.cat([getattr(p, f) for p in packed]) for f in
                              ("input_ids", "positions", "doc", "response")))
        tokens = sum(self._length(i) for row in rows for i in row)
        return StepData(batch, tokens, epoch)

    @functools.cached_property
    def fingerprint(self) -> str:
        """Identifies the tokenized data and its packing; a resumed run must see the same."""
        h = hashlib.sha256(json.dumps([self.row_len, self.block_size, self.pad_id, self.rows_per_step, self.seed,
                                       self.shuffle]).encode())
        for prompt, response in self.samples:
            h.update(json.dumps([prompt, response]).encode())
        return h.hexdigest()[:16]
