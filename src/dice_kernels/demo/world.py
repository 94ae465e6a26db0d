'''A synthetic, verifiable task world: seeded KernelBench-format programs and their C++ and CUDA solutions.

A program is a chain of element-wise ops on a 2-D input (some bring a second input: same shape, one value per
column, or one value per row), optionally closed by a row reduction. Its *family* is the op sequence; within a
family, shapes, constants, spellings and the name of the running variable vary. Solutions come from templates
that translate each forward line into one C++ (or CUDA) statement, so the infill core (the `source = """..."""`
string) is short. Families are split train / held-out by a seeded hash, so held-out tasks are new compositions of
ops the training set has seen, never copies. The same seed always gives the same world, byte for byte.
'''

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from pathlib import Path

from dice_kernels.data.format import rl_e2e_tasks, rl_infill_tasks, sft_rows, write_sft, write_table
from dice_kernels.data.infill import split_program
from dice_kernels.data.records import PairRecord, write_jsonl, write_records

TRAIN, HELDOUT = "train", "heldout"
BACKENDS = ("cpu", "cuda")


@dataclass(frozen=True)
class Op:
    """One element-wise step. Spellings are Python right-hand sides ({h}: running value, {c}: the constant);
    `cpp` / `cuda` are the statements on the running float `v` ({c}: constant; inputs as `py[i]`, `pb[c]`, `ps[r]`)."""

    name: str
    spellings: tuple[str, ...]
    cpp: str
    cuda: str = ""  # empty: same as cpp
    arg: str = ""  # extra input it reads: y (same shape as x), b (one value per column), s (one value per row)
    consts: tuple[float, ...] = ()


@dataclass(frozen=True)
class Reduction:
    name: str
    spellings: tuple[str, ...]
    init: str  # the accumulator's start value
    update: str  # CPU statement folding `v` into `acc`
    cuda_update: str
    store: str  # the row's result


OPS = (
    Op("relu", ("torch.relu({h})", "{h}.relu()"), "v = std::max(v, 0.0f);", "v = fmaxf(v, 0.0f);"),
    Op("sigmoid", ("torch.sigmoid({h})", "{h}.sigmoid()"), "v = 1.0f / (1.0f + std::exp(-v));",
       "v = 1.0f / (1.0f + expf(-v));"),
    Op("tanh", ("torch.tanh({h})", "{h}.tanh()"), "v = std::tanh(v);", "v = tanhf(v);"),
    Op("abs", ("torch.abs({h})", "{h}.abs()"), "v = std::fabs(v);", "v = fabsf(v);"),
    Op("square", ("{h} * {h}", "torch.square({h})"), "v = v * v;"),
    Op("scale", ("{h} * {c}", "{c} * {h}"), "v = v * {c}f;", consts=(0.25, 0.5, 1.5, 2.0, 3.0)),
    Op("shift", ("{h} + {c}", "{c} + {h}"), "v = v + {c}f;", consts=(0.1, 0.5, 1.0, 2.0)),
    Op("clamp", ("torch.clamp({h}, -{c}, {c})", "{h}.clamp(-{c}, {c})"), "v = std::min(std::max(v, -{c}f), {c}f);",
       "v = fminf(fmaxf(v, -{c}f), {c}f);", consts=(0.5, 1.0, 2.0)),
    Op("add_y", ("{h} + y", "torch.add({h}, y)"), "v = v + py[i];", arg="y"),
    Op("mul_y", ("{h} * y", "torch.mul({h}, y)"), "v = v * py[i];", arg="y"),
    Op("max_y", ("torch.maximum({h}, y)", "torch.max({h}, y)"), "v = std::max(v, py[i]);", "v = fmaxf(v, py[i]);",
       arg="y"),
    Op("add_b", ("{h} + b", "torch.add({h}, b)"), "v = v + pb[c];", arg="b"),
    Op("mul_s", ("{h} * s", "torch.mul({h}, s)"), "v = v * ps[r];", arg="s"),
)
REDUCTIONS = (
    Reduction("sum", ("torch.sum({h}, dim=1)", "{h}.sum(dim=1)"), "0.0f", "acc = acc + v;", "acc = acc + v;",
              "po[r] = acc;"),
    Reduction("amax", ("torch.amax({h}, dim=1)", "{h}.amax(dim=1)"), "-INFINITY", "acc = std::max(acc, v);",
              "acc = fmaxf(acc, v);", "po[r] = acc;"),
    Reduction("mean", ("torch.mean({h}, dim=1)", "{h}.mean(dim=1)"), "0.0f", "acc = acc + v;", "acc = acc + v;",
              "po[r] = acc / cols;"),
)
_OPS = {op.name: op for op in OPS}
_REDUCTIONS = {r.name: r for r in REDUCTIONS}
ARG_SHAPES = {"y": "rows, cols", "b": "cols", "s": "rows, 1"}  # get_inputs' torch.randn sizes per extra input
ROWS, COLS = (16, 32, 64, 128), (64, 128, 256, 512)
MAX_CHAIN = 3  # element-wise ops per program (a reduction may follow)


@dataclass(frozen=True)
class Spec:
    """Everything that decides one program: the family (ops, reduction) and its mutations."""

    ops: tuple[str, ...]
    reduction: str  # "" for none
    consts: tuple[float | None, ...]  # one per op
    spellings: tuple[int, ...]  # one per op, plus one for the reduction
    var: str  # the running variable: x (rebound) or a fresh name
    rows: int
    cols: int

    @property
    def family(self) -> str:
        return ">".join(self.ops + ((self.reduction,) if self.reduction else ()))

    @property
    def args(self) -> list[str]:
        """The inputs of forward: x, then the extra inputs it uses in one fixed order (y, b, s), so every held-out
        signature is one the training set has (order of first use would make new ones)."""
        used = {_OPS[name].arg for name in self.ops}
        return ["x"] + [a for a in ARG_SHAPES if a in used]

    @property
    def level(self) -> int:
        """1: a single operator; 2: a fusion of two or three; 3: four (the curriculum's easy -> hard order)."""
        steps = len(self.ops) + bool(self.reduction)
        return 1 if steps == 1 else 2 if steps <= 3 else 3


@dataclass(frozen=True)
class WorldTask:
    id: str
    name: str
    problem_id: int
    split: str  # train | heldout
    family: str
    level: int
    reference: str  # the KernelBench-format PyTorch program
    cpu: str  # ModelNew with a C++ extension (cpp_sources only): what the CPU backend runs
    cuda: str  # ModelNew with a CUDA kernel

    def solution(self, backend: str) -> str:
        return self.cpu if backend == "cpu" else self.cuda


def _const(c: float) -> str:
    return repr(float(c))


def forward_lines(spec: Spec) -> list[str]:
    """The body of `Model.forward` before its `return`, one line per step, without indentation."""
    lines, h = [], "x"
    steps = [(_OPS[n].spellings[s], c) for n, s, c in zip(spec.ops, spec.spellings, spec.consts)]
    if spec.reduction:
        steps.append((_REDUCTIONS[spec.reduction].spellings[spec.spellings[-1]], None))
    for spelling, c in steps:
        lines.append(f"{spec.var} = {spelling.format(h=h, c=_const(c) if c is not None else '')}")
        h = spec.var
    return lines


def _forward_def(spec: Spec) -> str:
    return f"def forward(self, {', '.join(spec.args)}):"


def reference_program(spec: Spec) -> str:
    body = "\n".join(f"        {line}" for line in forward_lines(spec))
    inputs = ", ".join(f"torch.randn({ARG_SHAPES.get(a, 'rows, cols')})" for a in spec.args)
    return f'''import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    {_forward_def(spec)}
{body}
        return {spec.var}


rows = {spec.rows}
cols = {spec.cols}


def get_inputs():
    return [{inputs}]


def get_init_inputs():
    return []
'''


def _statements(spec: Spec, cuda: bool, indent: str) -> str:
    """One statement per element-wise op, each after its forward line as a comment (real code often says which
    PyTorch line a statement implements; here it also makes the translation local: copy the next forward line,
    then write the statement it becomes). A reduction's fold into `acc` comes last, after its own line."""
    texts = [((op.cuda or op.cpp) if cuda else op.cpp).format(c=_const(c) if c is not None else "")
             for op, c in zip((_OPS[n] for n in spec.ops), spec.consts)]
    if spec.reduction:
        red = _REDUCTIONS[spec.reduction]
        texts.append(red.cuda_update if cuda else red.update)
    return "\n".join(f"{indent}// {line}\n{indent}{text}" for line, text in zip(forward_lines(spec), texts))


def _signature(spec: Spec) -> str:
    return f"torch::Tensor fused({', '.join(f'torch::Tensor {a}' for a in spec.args)})"


def _out_shape(spec: Spec) -> str:
    return "{rows}" if spec.reduction else "{rows, cols}"


def cpu_source(spec: Spec) -> str:
    """The C++ function: a row loop and a column loop, one statement per op, the reduction folded in."""
    pointers = "\n".join(f"    const float* p{a} = {a}.data_ptr<float>();" for a in spec.args)
    red = _REDUCTIONS.get(spec.reduction)
    inner = _statements(spec, cuda=False, indent="            ")
    if red:
        loop = f"""        float acc = {red.init};
        for (int64_t c = 0; c < cols; ++c) {{
            int64_t i = r * cols + c;
            float v = px[i];
{inner}
        }}
        {red.store}"""
    else:
        loop = f"""        for (int64_t c = 0; c < cols; ++c) {{
            int64_t i = r * cols + c;
            float v = px[i];
{inner}
            po[i] = v;
        }}"""
    inner_lines = "\n".join(line for line in loop.split("\n") if line.strip())
    return f"""// {_forward_def(spec)}
{_signature(spec)} {{
    int64_t rows = x.size(0), cols = x.size(1);
    auto out = torch::empty({_out_shape(spec)}, x.options());
{pointers}
    float* po = out.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r) {{
{inner_lines}
    }}
    return out;
}}"""


def cuda_source(spec: Spec) -> str:
    """The CUDA kernel: one thread per element, or one thread per row for a reduction; and its launcher."""
    params = ", ".join(f"const float* p{a}" for a in spec.args)
    red = _REDUCTIONS.get(spec.reduction)
    if red:
        body = f"""    int64_t r = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (r >= rows) return;
    float acc = {red.init};
    for (int64_t c = 0; c < cols; ++c) {{
        int64_t i = r * cols + c;
        float v = px[i];
{_statements(spec, cuda=True, indent="        ")}
    }}
    {red.store}"""
        count = "rows"
    else:
        body = f"""    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i >= rows * cols) return;
    int64_t r = i / cols, c = i % cols;
    float v = px[i];
{_statements(spec, cuda=True, indent="    ")}
    po[i] = v;"""
        count = "rows * cols"
    body = "\n".join(line for line in body.split("\n") if line.strip())
    launch_args = ", ".join(f"{a}.data_ptr<float>()" for a in spec.args)
    return f"""// {_forward_def(spec)}
__global__ void fused_kernel({params}, float* po, int64_t rows, int64_t cols) {{
{body}
}}

{_signature(spec)} {{
    int64_t rows = x.size(0), cols = x.size(1);
    auto out = torch::empty({_out_shape(spec)}, x.options());
    int64_t n = {count};
    fused_kernel<<<(n + 255) / 256, 256>>>({launch_args}, out.data_ptr<float>(), rows, cols);
    return out;
}}"""


_IMPORTS = "import torch\nimport torch.nn as nn\nfrom torch.utils.cpp_extension import load_inline\n"


def _model_new(spec: Spec) -> str:
    args = ", ".join(spec.args)
    return f'''class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, {args}):
        return ext.fused({args})
'''


def cpu_program(spec: Spec) -> str:
    return (f'{_IMPORTS}\nsource = """\n{cpu_source(spec)}\n"""\n\n'
            'ext = load_inline(name="fused", cpp_sources=source, functions=["fused"], extra_cflags=["-O3"])\n\n\n'
            f"{_model_new(spec)}")


def cuda_program(spec: Spec) -> str:
    return (f'{_IMPORTS}\nsource = """\n{cuda_source(spec)}\n"""\n\n'
            f'cpp_src = "{_signature(spec)};"\n\n'
            'ext = load_inline(name="fused", cpp_sources=cpp_src, cuda_sources=source, functions=["fused"])\n\n\n'
            f"{_model_new(spec)}")


def family_split(family: str, seed: int, heldout_fraction: float) -> str:
    """Held-out families are chosen by a seeded hash of the family; a single op is always trained on, so every
    held-out family is a new composition of known steps."""
    if ">" not in family:
        return TRAIN
    h = int.from_bytes(hashlib.sha256(f"{seed}:{family}".encode()).digest()[:8], "big")
    return HELDOUT if h / 2**64 < heldout_fraction else TRAIN


def random_spec(rng: random.Random) -> Spec:
    while True:
        ops = tuple(rng.choice(OPS).name for _ in range(rng.randint(0, MAX_CHAIN)))
        reduction = rng.choice(REDUCTIONS).name if rng.random() < 0.4 else ""
        if ops or reduction:
            break
    consts = tuple(rng.choice(_OPS[n].consts) if _OPS[n].consts else None for n in ops)
    spellings = tuple(rng.randrange(len(_OPS[n].spellings)) for n in ops) + (rng.randrange(2),)
    return Spec(ops, reduction, consts, spellings, rng.choice(("x", "h")), rng.choice(ROWS), rng.choice(COLS))


def build_world(seed: int, n_train: int, n_heldout: int, heldout_fraction: float = 0.2) -> list[WorldTask]:
    """`n_train` + `n_heldout` distinct tasks, deterministic in `seed`; train first, then held-out, each by id."""
    rng = random.Random(seed)
    want = {TRAIN: n_train, HELDOUT: n_heldout}
    found: dict[str, list[Spec]] = {TRAIN: [], HELDOUT: []}
    seen: set[str] = set()
    for _ in range(200 * (n_train + n_heldout) + 1000):
        if all(len(found[s]) >= want[s] for s in want):
            break
        spec = random_spec(rng)
        split = family_split(spec.family, seed, heldout_fraction)
        code = reference_program(spec)
        if len(found[split]) < want[split] and code not in seen:
            seen.add(code)
            found[split].append(spec)
    else:
        raise ValueError(f"could not draw {n_train} train and {n_heldout} held-out distinct tasks from seed {seed}")
    tasks = []
    for split in (TRAIN, HELDOUT):
        for k, spec in enumerate(found[split], 1):
            name = f"{k}_{spec.family.replace('>', '_')}"
            tasks.append(WorldTask(id=f"demo-{split}/{k}", name=name, problem_id=k, split=split, family=spec.family,
                                   level=spec.level, reference=reference_program(spec), cpu=cpu_program(spec),
                                   cuda=cuda_program(spec)))
    return tasks


@dataclass(frozen=True)
class WorldFiles:
    """The world on disk, in the formats `dice data` writes (data/format.py) and the task loader reads."""

    pairs: Path  # PairRecord JSONL, every task (train and held-out) with its template solution
    sft: Path  # SFT rows (e2e + infill) of the train tasks
    rl_infill: Path  # phase 1 task set (train tasks)
    rl_e2e: Path  # phase 2 task set (train tasks)
    train_tasks: Path  # Task JSONL
    heldout_tasks: Path  # Task JSONL: what the benchmark runs


def records(tasks: list[WorldTask], backend: str) -> list[PairRecord]:
    return [PairRecord(id=t.id, source="demo", reference=t.reference, kernel=t.solution(backend), level=t.level,
                       provenance={"family": t.family, "split": t.split, "backend": backend}) for t in tasks]


def task_rows(tasks: list[WorldTask]) -> list[dict]:
    return [{"id": t.id, "name": t.name, "level": t.level, "problem_id": t.problem_id, "code": t.reference,
             "family": t.family} for t in tasks]


def write_world(tasks: list[WorldTask], out_dir: Path, backend: str) -> WorldFiles:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, not {backend!r}")
    out_dir.mkdir(parents=True, exist_ok=True)
    recs = records(tasks, backend)
    train = [r for r, t in zip(recs, tasks) if t.split == TRAIN]
    splits = {r.id: split_program(r.kernel) for r in train}
    files = WorldFiles(pairs=out_dir / "pairs.jsonl", sft=out_dir / "sft.jsonl", rl_infill=out_dir / "rl_infill.jsonl",
                       rl_e2e=out_dir / "rl_e2e.jsonl", train_tasks=out_dir / "train_tasks.jsonl",
                       heldout_tasks=out_dir / "heldout_tasks.jsonl")
    write_records(files.pairs, recs)
    write_sft(sft_rows(train, splits, backend=backend), out_dir)
    write_table(rl_infill_tasks(train, splits, backend=backend), out_dir, "rl_infill")
    write_table(rl_e2e_tasks(train, backend=backend), out_dir, "rl_e2e")
    write_jsonl(files.train_tasks, task_rows([t for t in tasks if t.split == TRAIN]))
    write_jsonl(files.heldout_tasks, task_rows([t for t in tasks if t.split == HELDOUT]))
    return files
