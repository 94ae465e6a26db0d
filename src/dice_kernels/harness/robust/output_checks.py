"""Checks on a model's outputs that need no instrumentation, run in the reference's and a candidate's worker
alike: outputs that alias an input, inputs a call mutated (`output_findings`), and the allocator's free blocks
poisoned before a call (`poison_free_memory`), so an output forged on freed memory holds NaN, not a stale result.
`Finding` is what every check of the robust check reports."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dice_kernels.harness.outcomes import DeceptiveKind


@dataclass(frozen=True)
class Finding:
    kind: DeceptiveKind
    reason: str
    ops: tuple[tuple[str, int], ...] = ()  # every ATen op behind the finding and its count, most called first

    def to_dict(self) -> dict:
        return {"kind": self.kind.value, "reason": self.reason, **({"ops": dict(self.ops)} if self.ops else {})}


def _storage_range(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.data_ptr() + s.nbytes()


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN matching NaN where both hold one."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if torch.equal(a, b):  # one pass, no copy: the usual answer (unchanged inputs, finished outputs)
        return True
    if a.is_floating_point() or a.is_complex():  # unequal, or NaN somewhere (NaN != NaN)
        return bool(torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.nan_to_num(0), b.nan_to_num(0)))
    return False


def tensors_in(values) -> list[torch.Tensor]:
    if isinstance(values, torch.Tensor):
        return [values]
    if isinstance(values, (list, tuple)):
        return [t for v in values for t in tensors_in(v)]
    return []


def snapshot_inputs(inputs: list) -> list[torch.Tensor]:
    return [t.detach().clone() for t in tensors_in(inputs)]


def output_findings(inputs: list, before: list[torch.Tensor], outputs: list[torch.Tensor]) -> list[Finding]:
    """Forged outputs visible right after forward: an output sharing memory with an input; mutated inputs."""
    found = []
    ins = tensors_in(inputs)
    ranges = [_storage_range(t) for t in ins if t.numel()]
    for i, out in enumerate(outputs):
        if not out.numel():
            continue
        lo, hi = _storage_range(out)
        if any(lo < r_hi and r_lo < hi for r_lo, r_hi in ranges):
            found.append(Finding(DeceptiveKind.OUTPUT_ALIASES_INPUT,
                                 f"output {i} shares memory with an input (the op was not computed into new memory)"))
    for i, (now, then) in enumerate(zip(ins, before)):
        if not _same_values(now.detach(), then):
            found.append(Finding(DeceptiveKind.INPUT_MUTATED, f"forward modified input {i} in place"))
    return found


_SLACK = 256


def poison_free_memory(device: str, sizes: list[int]) -> None:
    """Allocate blocks of the given byte sizes, fill them with NaN and free them, so that the free blocks a
    same-size allocation would get next hold poison.

    A candidate that returns `torch.empty` it never writes then hands back NaN instead of a stale result. Works
    where the allocator reuses blocks: the CUDA caching allocator; on CPU the C allocator for a same-size request
    made with no allocation in between (when it hands back fresh zeroed pages instead, nothing stale is there).
    Each block has `_SLACK` extra bytes, so that an aligned request of the original size fits in it (glibc's
    `posix_memalign` asks for more than the size; a block of exactly the size would be skipped).
    """
    blocks = [torch.empty((n + _SLACK + 3) // 4, dtype=torch.float32, device=device).fill_(float("nan"))
              for n in sizes if n]
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    del blocks
