"""A pickle-free stream of tensors over a pipe: how a worker hands its outputs to the parent.

Nothing touches the filesystem (a concurrent candidate cannot read a reference's outputs) and nothing is
unpickled (the stream is JSON metadata plus raw bytes, validated before any allocation).
"""

from __future__ import annotations

import json
from typing import BinaryIO, Callable

import torch

MAGIC = b"DICE-TENSORS-1\n"
_MAX_HEADER = 1 << 20
_DTYPES = {str(d): d for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                               torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)}


class StreamError(ValueError):
    pass


class OutputsTooLarge(StreamError):
    """A frame announced more bytes than the reader may allocate: a limit, not a malformed stream."""


def write_trials(f: BinaryIO, trials: list[list[torch.Tensor]]) -> None:
    """Write per-trial lists of CPU tensors: MAGIC, header length, JSON header, then each tensor's bytes."""
    flat = [t.detach().contiguous().cpu() for trial in trials for t in trial]
    header = json.dumps({"trials": [len(trial) for trial in trials],
                         "tensors": [{"dtype": str(t.dtype), "shape": list(t.shape)} for t in flat]}).encode()
    f.write(MAGIC + len(header).to_bytes(8, "little") + header)
    for t in flat:
        if t.numel():
            f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    f.flush()


def _read_exact(f: BinaryIO, n: int) -> bytes:
    data = f.read(n)
    if data is None or len(data) != n:
        raise StreamError("stream ended early")
    return data


def read_trials(f: BinaryIO, max_bytes: int,
                admit: Callable[[int], None] | None = None) -> list[list[torch.Tensor]] | None:
    """Read what `write_trials` wrote; None for an empty stream. Refuses streams over `max_bytes` of data; `admit`
    sees the data's size before anything is allocated for it, and may refuse it by raising."""
    first = f.read(len(MAGIC))
    if not first:
        return None
    if first != MAGIC:
        raise StreamError("not a tensor stream")
    size = int.from_bytes(_read_exact(f, 8), "little")
    if size > _MAX_HEADER:
        raise StreamError(f"header of {size} bytes is too large")
    header = json.loads(_read_exact(f, size))
    specs, counts = header["tensors"], header["trials"]
    if sum(counts) != len(specs) or any(c < 0 for c in counts):
        raise StreamError("trial counts do not match the tensors")
    dtypes, shapes, total = [], [], 0
    for spec in specs:
        if spec["dtype"] not in _DTYPES:
            raise StreamError(f"unsupported dtype {spec['dtype']}")
        shape = [int(s) for s in spec["shape"]]
        if any(s < 0 for s in shape):
            raise StreamError("negative dimension")
        dtypes.append(_DTYPES[spec["dtype"]])
        shapes.append(shape)
        numel = 1
        for s in shape:
            numel *= s
        total += numel * dtypes[-1].itemsize
    if total > max_bytes:
        raise OutputsTooLarge(f"outputs of {total} bytes exceed the {max_bytes}-byte limit")
    if admit is not None:
        admit(total)
    tensors = []
    for dtype, shape in zip(dtypes, shapes):
        t = torch.empty(shape, dtype=dtype)
        if t.numel():
            buf = memoryview(t.reshape(-1).view(torch.uint8).numpy())
            got = 0
            while got < len(buf):
                n = f.readinto(buf[got:])
                if not n:
                    raise StreamError("stream ended early")
                got += n
        tensors.append(t)
    it = iter(tensors)
    return [[next(it) for _ in range(c)] for c in counts]
