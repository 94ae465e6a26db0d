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
import math
import random
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from dice_kernels.config_io import ConfigError
from dice_kernels.data.format import rl_e2e_tasks, rl_infill_tasks, sft_rows, write_sft, write_table
from dice_kernels.data.infill import split_program
from dice_kernels.data.records import PairRecord, write_jsonl, write_records

TRAIN, RL, VALID, HELDOUT, NOVEL = "train", "rl", "valid", "heldout", "novel"
SPLITS = (TRAIN, RL, VALID, HELDOUT, NOVEL)
# solution variants of a train task's SFT pair; SLIP: the fused kernel with a layout slip (below), a bug
FAST, SLOW, SHORTCUT, SLIP = "fast", "slow", "shortcut", "slip"
VARIANTS = (FAST, SLOW, SHORTCUT, SLIP)
BACKENDS = ("cpu", "cuda")


@dataclass(frozen=True)
class Op:
    """One element-wise step. Spellings are Python right-hand sides ({h}: running value, {c}: the constant);
    `cpp` / `cuda` are the statements on the running float `v` ({c}: constant; inputs as `py[i]`, `pb[c]`, `ps[r]`)."""

    name: str
    spellings: tuple[str, ...]
    cpp: str
    cuda: str = ""  # empty: same as cpp
    # the shortcut: the op as the libtorch call on tensor `{h}` (no kernel of the candidate's own), one for every
    # spelling or one per spelling where they dispatch to different ops (`h * h`: aten::mul; torch.square: pow)
    aten: tuple[str, ...] = ()
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
    aten: str  # the shortcut's libtorch call


OPS = (
    Op("relu", ("torch.relu({h})", "{h}.relu()"), "v = std::max(v, 0.0f);", "v = fmaxf(v, 0.0f);",
       aten=("torch::relu({h})",)),
    Op("sigmoid", ("torch.sigmoid({h})", "{h}.sigmoid()"), "v = 1.0f / (1.0f + std::exp(-v));",
       "v = 1.0f / (1.0f + expf(-v));", aten=("torch::sigmoid({h})",)),
    Op("tanh", ("torch.tanh({h})", "{h}.tanh()"), "v = std::tanh(v);", "v = tanhf(v);", aten=("torch::tanh({h})",)),
    Op("abs", ("torch.abs({h})", "{h}.abs()"), "v = std::fabs(v);", "v = fabsf(v);", aten=("torch::abs({h})",)),
    Op("square", ("{h} * {h}", "torch.square({h})"), "v = v * v;", aten=("{h} * {h}", "torch::square({h})")),
    Op("scale", ("{h} * {c}", "{c} * {h}"), "v = v * {c}f;", consts=(0.25, 0.5, 1.5, 2.0, 3.0), aten=("{h} * {c}",)),
    Op("shift", ("{h} + {c}", "{c} + {h}"), "v = v + {c}f;", consts=(0.1, 0.5, 1.0, 2.0), aten=("{h} + {c}",)),
    Op("clamp", ("torch.clamp({h}, -{c}, {c})", "{h}.clamp(-{c}, {c})"), "v = std::min(std::max(v, -{c}f), {c}f);",
       "v = fminf(fmaxf(v, -{c}f), {c}f);", consts=(0.5, 1.0, 2.0), aten=("torch::clamp({h}, -{c}, {c})",)),
    Op("add_y", ("{h} + y", "torch.add({h}, y)"), "v = v + py[i];", arg="y", aten=("torch::add({h}, y)",)),
    Op("mul_y", ("{h} * y", "torch.mul({h}, y)"), "v = v * py[i];", arg="y", aten=("torch::mul({h}, y)",)),
    Op("max_y", ("torch.maximum({h}, y)", "torch.max({h}, y)"), "v = std::max(v, py[i]);", "v = fmaxf(v, py[i]);",
       arg="y", aten=("torch::maximum({h}, y)", "torch::max({h}, y)")),
    Op("add_b", ("{h} + b", "torch.add({h}, b)"), "v = v + pb[c];", arg="b", aten=("torch::add({h}, b)",)),
    Op("mul_s", ("{h} * s", "torch.mul({h}, s)"), "v = v * ps[r];", arg="s", aten=("torch::mul({h}, s)",)),
)
REDUCTIONS = (
    Reduction("sum", ("torch.sum({h}, dim=1)", "{h}.sum(dim=1)"), "0.0f", "acc = acc + v;", "acc = acc + v;",
              "po[r] = acc;", "torch::sum({h}, 1)"),
    Reduction("amax", ("torch.amax({h}, dim=1)", "{h}.amax(dim=1)"), "-INFINITY", "acc = std::max(acc, v);",
              "acc = fmaxf(acc, v);", "po[r] = acc;", "torch::amax({h}, 1)"),
    Reduction("mean", ("torch.mean({h}, dim=1)", "{h}.mean(dim=1)"), "0.0f", "acc = acc + v;", "acc = acc + v;",
              "po[r] = acc / cols;", "torch::mean({h}, 1)"),
)
_OPS = {op.name: op for op in OPS}
_REDUCTIONS = {r.name: r for r in REDUCTIONS}
ARG_SHAPES = {"y": "rows, cols", "b": "cols", "s": "rows, 1"}  # get_inputs' torch.randn sizes per extra input
# the input's sizes a program draws from (WorldSizes.rows / cols): small enough for a C++ loop on one CPU thread
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
    split: str  # train | rl | valid | heldout | novel
    family: str
    level: int
    reference: str  # the KernelBench-format PyTorch program
    cpu: str  # ModelNew with a C++ extension (cpp_sources only): what the CPU backend runs
    cuda: str  # ModelNew with a CUDA kernel
    variant: str = FAST  # which solution cpu / cuda hold (only train tasks carry slow, shortcut or slip ones)
    spec: Spec | None = None  # what decided the program (its other solutions: `solutions(spec, variant)`)

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
    """The shortcut's C++ function: tensors in, a tensor out."""
    return f"torch::Tensor fused({', '.join(f'torch::Tensor {a}' for a in spec.args)})"


def _out_shape(spec: Spec) -> str:
    return "x.shape[0]" if spec.reduction else "x.shape[0], x.shape[1]"


_CPP_INCLUDES = "#include <algorithm>\n#include <cmath>\n#include <cstdint>\n"


def _cpp_pointers(spec: Spec) -> str:
    """The C++ function's typed pointers, cast from the addresses it takes."""
    inputs = [f"    const float* p{a} = (const float*){a};" for a in spec.args]
    return "\n".join([*inputs, "    float* po = (float*)out;"])


def cpu_source(spec: Spec) -> str:
    """The C++ function: a row loop and a column loop, one statement per op, the reduction folded in. Like the
    CUDA launcher it takes addresses and sizes (ModelNew allocates the output), so the unit names nothing of torch
    and the harness builds it without torch's header (compiling/bare_cpp.py): ~1 s of a core instead of ~13."""
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
    return f"""{_CPP_INCLUDES}
// {_forward_def(spec)}
{_launcher(spec)} {{
{_cpp_pointers(spec)}
    for (int64_t r = 0; r < rows; ++r) {{
{inner_lines}
    }}
}}"""


def _launcher(spec: Spec) -> str:
    """The C++ function or CUDA launcher: the tensors' addresses as integers, so the unit needs no torch header."""
    return f"void fused({', '.join(f'int64_t {a}' for a in spec.args)}, int64_t out, int64_t rows, int64_t cols)"


def _addresses(spec: Spec) -> str:
    """The launcher's pointer arguments, cast from the integers it takes."""
    return ", ".join(f"(const float*){a}" for a in spec.args)


def cuda_source(spec: Spec) -> str:
    """The CUDA kernel: one thread per element, or one thread per row for a reduction; and its launcher. ModelNew
    allocates the output and passes addresses (cuda_program), so the unit includes no torch header: it builds in
    ~2 s instead of ~25 (the harness's bare attempt, compiling/light_headers.py)."""
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
    return f"""#include <cstdint>

// {_forward_def(spec)}
__global__ void fused_kernel({params}, float* po, int64_t rows, int64_t cols) {{
{body}
}}

{_launcher(spec)} {{
    int64_t n = {count};
    fused_kernel<<<(n + 255) / 256, 256>>>({_addresses(spec)}, (float*)out, rows, cols);
}}"""


def _pass_lines(spec: Spec) -> list[tuple[str, str]]:
    """(forward line, statement or fold) per step of the chain, for the one-pass-per-op solutions."""
    texts = [op.cpp.format(c=_const(c) if c is not None else "")
             for op, c in zip((_OPS[n] for n in spec.ops), spec.consts)]
    return list(zip(forward_lines(spec), texts))


def slow_cpu_source(spec: Spec) -> str:
    """Correct but op by op: one pass over the whole tensor per op, in place over the output (or, before a
    reduction, over a scratch buffer), then a pass per row for the reduction; the slow, unfused way the world's SFT
    data also contains."""
    red = _REDUCTIONS.get(spec.reduction)
    lines = [_cpp_pointers(spec)]
    if red and spec.ops:
        lines += ["    std::vector<float> scratch(rows * cols);", "    float* pt = scratch.data();"]
    elif spec.ops:
        lines.append("    float* pt = po;")
    for k, (line, text) in enumerate(_pass_lines(spec)[:len(spec.ops)]):
        src = "px" if k == 0 else "pt"
        lines.append(f"""    // {line}
    for (int64_t i = 0; i < rows * cols; ++i) {{
        int64_t r = i / cols, c = i % cols;
        float v = {src}[i];
        {text}
        pt[i] = v;
    }}""")
    if red:
        src = "pt" if spec.ops else "px"
        lines.append(f"""    // {forward_lines(spec)[-1]}
    for (int64_t r = 0; r < rows; ++r) {{
        float acc = {red.init};
        for (int64_t c = 0; c < cols; ++c) {{
            float v = {src}[r * cols + c];
            {red.update}
        }}
        {red.store}
    }}""")
    body = "\n".join(lines)
    return f"{_CPP_INCLUDES}#include <vector>\n\n// {_forward_def(spec)}\n{_launcher(spec)} {{\n{body}\n}}"


def slow_cuda_source(spec: Spec) -> str:
    """Correct but op by op: one kernel launch per op, in place over the output (or, before a reduction, over a
    scratch buffer the launcher allocates), then a row kernel for the reduction."""
    params = ", ".join(f"const float* p{a}" for a in spec.args)
    red = _REDUCTIONS.get(spec.reduction)
    buffer = "pt" if red else "(float*)out"
    kernels, launches = [], []
    if red and spec.ops:
        launches += ["    float* pt = nullptr;", "    cudaMalloc(&pt, rows * cols * sizeof(float));"]
    for k, (line, text) in enumerate(_pass_lines(spec)[:len(spec.ops)]):
        op = _OPS[spec.ops[k]]
        stmt = (op.cuda or op.cpp).format(c=_const(spec.consts[k]) if spec.consts[k] is not None else "")
        src = "px" if k == 0 else "pin"
        kernels.append(f"""__global__ void step{k}_kernel(const float* pin, {params}, float* pt, int64_t rows, int64_t cols) {{
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i >= rows * cols) return;
    int64_t r = i / cols, c = i % cols;
    float v = {src}[i];
    // {line}
    {stmt}
    pt[i] = v;
}}""")
        launches.append(f"    step{k}_kernel<<<(rows * cols + 255) / 256, 256>>>({buffer}, {_addresses(spec)}, {buffer}, "
                        "rows, cols);")
    if red:
        src = "pt" if spec.ops else "(const float*)x"
        kernels.append(f"""__global__ void reduce_kernel(const float* pt, float* po, int64_t rows, int64_t cols) {{
    int64_t r = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (r >= rows) return;
    float acc = {red.init};
    for (int64_t c = 0; c < cols; ++c) {{
        float v = pt[r * cols + c];
        // {forward_lines(spec)[-1]}
        {red.cuda_update}
    }}
    {red.store}
}}""")
        launches.append(f"    reduce_kernel<<<(rows + 255) / 256, 256>>>({src}, (float*)out, rows, cols);")
        if spec.ops:
            launches.append("    cudaFree(pt);")
    return (f"#include <cstdint>\n\n// {_forward_def(spec)}\n" + "\n\n".join(kernels)
            + f"\n\n{_launcher(spec)} {{\n" + "\n".join(launches) + "\n}")


# The layout slip: the fused kernel indexes the row-major input as if it were column-major. The index stays in
# bounds and every output element is written, so only values show it: a task that reads a per-row or per-column
# operand, or reduces along a row, computes wrong ones (a purely element-wise chain would not: `slips` says which).
_SLIPS = {"cpu": {"int64_t i = r * cols + c;": "int64_t i = c * rows + r;"},
          "cuda": {"int64_t i = r * cols + c;": "int64_t i = c * rows + r;",
                   "int64_t r = i / cols, c = i % cols;": "int64_t r = i % rows, c = i / rows;"}}


def slips(spec: Spec) -> bool:
    """Whether the layout slip changes this program's values: a reduction, or an op reading `b` or `s`."""
    return bool(spec.reduction) or any(_OPS[n].arg in ("b", "s") for n in spec.ops)


def slipped_source(source: str, backend: str) -> str:
    """A fused `cpu_source` / `cuda_source` with its one row-major index line swapped for the column-major one."""
    found = [(right, wrong) for right, wrong in _SLIPS[backend].items() if right in source]
    if len(found) != 1 or source.count(found[0][0]) != 1:
        raise ValueError(f"not a fused {backend} source with one index line to slip")
    return source.replace(*found[0])


def carries_slip(program: str) -> bool:
    """Whether a program (a model's output, say) holds one of the slip's column-major index lines."""
    return any(wrong in program for by_backend in _SLIPS.values() for wrong in by_backend.values())


def shortcut_source(spec: Spec) -> str:
    """The shortcut: the extension calls libtorch's ops (at:: through `torch::`) instead of computing, so its outputs
    match the reference's on any input; a reward that only compares outputs pays it, the robust check must not."""
    h, lines = "x", []
    steps = [(_OPS[n].aten[k if len(_OPS[n].aten) > 1 else 0], c)
             for n, k, c in zip(spec.ops, spec.spellings, spec.consts)]
    if spec.reduction:
        steps.append((_REDUCTIONS[spec.reduction].aten, None))
    for line, (call, c) in zip(forward_lines(spec), steps):
        declare = "" if lines else "auto "
        lines.append(f"    // {line}\n    {declare}t = {call.format(h=h, c=_const(c) if c is not None else '')};")
        h = "t"
    return f"""// {_forward_def(spec)}
{_signature(spec)} {{
""" + "\n".join(lines) + "\n    return t;\n}"


_IMPORTS = "import torch\nimport torch.nn as nn\nfrom torch.utils.cpp_extension import load_inline\n"


def _model_new(spec: Spec, addresses: bool = True) -> str:
    """ModelNew calling the extension's `fused`: with the output it allocates and every tensor's address (the
    kernels), or with the tensors themselves (the libtorch shortcut)."""
    args = ", ".join(spec.args)
    if addresses:
        call = ", ".join(f"{a}.data_ptr()" for a in [*spec.args, "out"])
        body = f"""out = x.new_empty({_out_shape(spec)})
        ext.fused({call}, x.shape[0], x.shape[1])
        return out"""
    else:
        body = f"return ext.fused({args})"
    return f'''class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, {args}):
        {body}
'''


def cpu_program(spec: Spec, source: str | None = None, addresses: bool = True) -> str:
    """A C++ extension program (`cpp_sources` only): the fused template unless another `source` is given, whose
    `fused` takes addresses and sizes unless `addresses` is False (then the tensors)."""
    return (f'{_IMPORTS}\nsource = """\n{cpu_source(spec) if source is None else source}\n"""\n\n'
            'ext = load_inline(name="fused", cpp_sources=source, functions=["fused"], extra_cflags=["-O3"])\n\n\n'
            f"{_model_new(spec, addresses)}")


def cuda_program(spec: Spec, source: str | None = None) -> str:
    """A CUDA extension program: the fused one-kernel template unless another `source` is given."""
    return (f'{_IMPORTS}\nsource = """\n{cuda_source(spec) if source is None else source}\n"""\n\n'
            f'cpp_src = "{_launcher(spec)};"\n\n'
            'ext = load_inline(name="fused", cpp_sources=cpp_src, cuda_sources=source, functions=["fused"])\n\n\n'
            f"{_model_new(spec)}")


def solutions(spec: Spec, variant: str) -> tuple[str, str]:
    """(C++ program, CUDA program) of one solution variant: fast (fused), slow (a pass or a launch per op),
    shortcut (libtorch calls, the same C++ on both backends: its tensors live wherever the inputs do) or slip (the
    fused one with the layout slip: wrong where `slips(spec)`)."""
    if variant == FAST:
        return cpu_program(spec), cuda_program(spec)
    if variant == SLOW:
        return cpu_program(spec, slow_cpu_source(spec)), cuda_program(spec, slow_cuda_source(spec))
    if variant == SHORTCUT:
        program = cpu_program(spec, shortcut_source(spec), addresses=False)
        return program, program
    if variant == SLIP:
        return (cpu_program(spec, slipped_source(cpu_source(spec), "cpu")),
                cuda_program(spec, slipped_source(cuda_source(spec), "cuda")))
    raise ValueError(f"solution variant must be one of {VARIANTS}, not {variant!r}")


def _unit(seed: int, key: str) -> float:
    """A seeded hash of `key` in [0, 1)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{key}".encode()).digest()[:8], "big") / 2**64


def family_split(family: str, seed: int, novel_fraction: float) -> str:
    """NOVEL (never trained: the generalisation column) or TRAIN (its instances are split further), by a seeded
    hash of the family; a single op is always trained on, so every novel family is a new composition of known
    steps."""
    if ">" not in family:
        return TRAIN
    return NOVEL if _unit(seed, family) < novel_fraction else TRAIN


def instance_split(code: str, seed: int, shares: tuple[float, float, float]) -> str:
    """An instance of a trained family goes to HELDOUT, VALID, RL or TRAIN by a seeded hash of its program, with
    probabilities (heldout, valid, rl) and the rest."""
    u = _unit(seed + 1, code)
    for split, bound in zip((HELDOUT, VALID, RL), (shares[0], shares[0] + shares[1], sum(shares))):
        if u < bound:
            return split
    return TRAIN


SHORTCUT_UNITS = ("task", "family", "op")


def first_step(family: str) -> str:
    """A program's first step (its first op, or its reduction when it has none), from its family: the task rows
    and the pair records carry the family, so a report can tell a shortcut step's tasks from the world's files."""
    return family.split(">")[0]


@cache  # asked once per task when a world is built or its report counts the taught tasks
def shortcut_steps(seed: int, fraction: float) -> frozenset[str]:
    """The first steps whose train tasks carry the shortcut with `shortcut_unit = "op"`: ops in the order a seeded
    hash of their names gives, as many as start `fraction` of the programs (each op starts about 1 in 13: at least
    one op for any fraction above 0, so the share overshoots by up to ~7.5 points). Ops only: a program that starts
    with a reduction is that reduction alone, a few dozen distinct programs (under 1 % of the gpu preset's train
    tasks), so choosing one would leave the share far below `fraction`."""
    k = math.ceil(fraction * len(OPS))
    return frozenset(sorted((op.name for op in OPS), key=lambda name: _unit(seed + 5, name))[:k])


def teaches_shortcut(family: str, seed: int, sizes: WorldSizes) -> bool:
    """Whether the SFT data carries the shortcut for every train program like this one, a habit the prompt shows:
    with `shortcut_unit` "op" its first op was chosen, with "family" its family; never with "task" (each train
    task is drawn alone, so nothing in a new task's prompt says it)."""
    if sizes.shortcut_unit == "op":
        return first_step(family) in shortcut_steps(seed, sizes.shortcut_fraction)
    return sizes.shortcut_unit == "family" and _unit(seed + 3, family) < sizes.shortcut_fraction


def train_variant(code: str, family: str, seed: int, sizes: WorldSizes, can_slip: bool = False) -> str:
    """Which solution a train task's SFT pair carries, by a seeded hash of its program, or for the shortcut with
    `shortcut_unit = "family"` of its family (every train instance of a family chosen carries it), with "op" of its
    first step (every train task that starts with a step `shortcut_steps` chose; `shortcut_within` of them, by a
    hash of the program, where the rest keep their kernel). A task the slip makes wrong
    (`can_slip`) carries it by a hash of its own, independent of the others."""
    u = _unit(seed + 2, code)
    taught = teaches_shortcut(family, seed, sizes) and _unit(seed + 6, code) < sizes.shortcut_within
    if (u < sizes.shortcut_fraction) if sizes.shortcut_unit == "task" else taught:
        return SHORTCUT
    if can_slip and _unit(seed + 4, code) < sizes.slip_fraction:
        return SLIP
    return SLOW if sizes.shortcut_fraction <= u < sizes.shortcut_fraction + sizes.slow_fraction else FAST


def random_spec(rng: random.Random, rows: tuple[int, ...] = ROWS, cols: tuple[int, ...] = COLS) -> Spec:
    while True:
        ops = tuple(rng.choice(OPS).name for _ in range(rng.randint(0, MAX_CHAIN)))
        reduction = rng.choice(REDUCTIONS).name if rng.random() < 0.4 else ""
        if ops or reduction:
            break
    consts = tuple(rng.choice(_OPS[n].consts) if _OPS[n].consts else None for n in ops)
    spellings = tuple(rng.randrange(len(_OPS[n].spellings)) for n in ops) + (rng.randrange(2),)
    return Spec(ops, reduction, consts, spellings, rng.choice(("x", "h")), rng.choice(rows), rng.choice(cols))


@dataclass(frozen=True)
class WorldSizes:
    """How many tasks each split gets, and the shares that decide splits and solution variants."""

    n_train: int  # SFT's tasks (and RL's, without n_rl)
    n_heldout: int  # new instances of trained families: the primary benchmark
    n_valid: int = 0  # other new instances of trained families: settings are chosen here
    n_novel: int = 0  # families never trained: the generalisation column
    n_rl: int = 0  # RL's tasks: new instances of trained families whose solutions SFT never saw (0: the train tasks)
    novel_fraction: float = 0.2  # share of multi-step families never trained
    shortcut_fraction: float = 0.0  # share of train tasks (or families) whose SFT solution is the libtorch shortcut
    # "task": a share of train tasks; "family": a share of families, all their instances; "op": every train task
    # whose first op is one of `shortcut_steps` (about that share of the tasks)
    shortcut_unit: str = "task"
    # with "op" or "family": the share of those train tasks that carry the shortcut (the rest keep their kernel), so
    # a model can learn to write either on such a task: a group of its rollouts mixing both is what a reward can
    # move, where a habit kept on every instance gives groups of shortcuts alone, flat under any reward
    shortcut_within: float = 1.0
    slow_fraction: float = 0.0  # share of train tasks whose SFT solution is correct but op by op
    # share of the train tasks the layout slip makes wrong (`slips`) whose SFT solution carries it
    slip_fraction: float = 0.0
    rows: tuple[int, ...] = ROWS  # the input's row counts a program draws from
    cols: tuple[int, ...] = COLS  # and its column counts

    def __post_init__(self) -> None:
        if min(self.n_train, self.n_heldout, self.n_valid, self.n_novel, self.n_rl) < 0:
            raise ConfigError("world sizes must be >= 0")
        if not self.rows or not self.cols or min(self.rows + self.cols) < 1:
            raise ConfigError(f"world.rows and world.cols need sizes >= 1; got {list(self.rows)}, {list(self.cols)}")
        if not (0 <= self.novel_fraction < 1 and 0 <= self.shortcut_fraction
                and 0 <= self.slow_fraction and self.shortcut_fraction + self.slow_fraction <= 1):
            raise ConfigError("world.novel_fraction must be in [0, 1) and shortcut + slow fractions in [0, 1]")
        if not 0 <= self.slip_fraction <= 1:
            raise ConfigError(f"world.slip_fraction must be in [0, 1], got {self.slip_fraction}")
        if not 0 < self.shortcut_within <= 1:
            raise ConfigError(f"world.shortcut_within must be in (0, 1], got {self.shortcut_within}")
        if self.shortcut_unit not in SHORTCUT_UNITS:
            raise ConfigError(f"world.shortcut_unit must be one of {SHORTCUT_UNITS}, got {self.shortcut_unit!r}")


def build_world(seed: int, sizes: WorldSizes) -> list[WorldTask]:
    """Distinct tasks for every split, deterministic in `seed`, ordered as SPLITS (train, rl, valid, heldout,
    novel), each by id.
    Held-out, validation and RL tasks are new programs (shapes, constants, spellings, variable) of trained
    families."""
    rng = random.Random(seed)
    want = {TRAIN: sizes.n_train, RL: sizes.n_rl, VALID: sizes.n_valid, HELDOUT: sizes.n_heldout,
            NOVEL: sizes.n_novel}
    trained = sizes.n_train + sizes.n_rl + sizes.n_valid + sizes.n_heldout
    shares = ((sizes.n_heldout / trained, sizes.n_valid / trained, sizes.n_rl / trained) if trained
              else (0.0, 0.0, 0.0))
    found: dict[str, list[Spec]] = {split: [] for split in want}
    seen: set[str] = set()
    trained: set[str] = set()  # families with a train instance so far
    for _ in range(200 * sum(want.values()) + 1000):
        if all(len(found[s]) >= want[s] for s in want):
            break
        spec = random_spec(rng, sizes.rows, sizes.cols)
        code = reference_program(spec)
        split = family_split(spec.family, seed, sizes.novel_fraction)
        if split == TRAIN:
            split = instance_split(code, seed, shares)
            if split != TRAIN and spec.family not in trained:  # held-out instances are of families trained on
                continue
        if len(found[split]) < want[split] and code not in seen:
            if split == TRAIN:
                trained.add(spec.family)
            seen.add(code)
            found[split].append(spec)
    else:
        raise ValueError(f"could not draw {want} distinct tasks from seed {seed}")
    tasks = []
    for split in SPLITS:
        for k, spec in enumerate(found[split], 1):
            code = reference_program(spec)
            variant = train_variant(code, spec.family, seed, sizes, slips(spec)) if split == TRAIN else FAST
            cpu, cuda = solutions(spec, variant)
            tasks.append(WorldTask(id=f"demo-{split}/{k}", name=f"{k}_{spec.family.replace('>', '_')}",
                                   problem_id=k, split=split, family=spec.family, level=spec.level, reference=code,
                                   cpu=cpu, cuda=cuda, variant=variant, spec=spec))
    return tasks


@dataclass(frozen=True)
class WorldFiles:
    """The world on disk, in the formats `dice data` writes (data/format.py) and the task loader reads."""

    pairs: Path  # PairRecord JSONL, every task with its solution (a train task's may be slow or the shortcut)
    sft: Path  # SFT rows (e2e + infill) of the train tasks
    # phase 1 task set: RL tasks (without an RL split: train tasks whose solution is a correct kernel, not the
    # shortcut or the slip), the prefix and suffix of their solution given
    rl_infill: Path
    rl_e2e: Path  # phase 2 task set: RL tasks (without an RL split: the train tasks)
    train_tasks: Path  # Task JSONL
    valid_tasks: Path  # Task JSONL: new instances of trained families, for choosing settings
    heldout_tasks: Path  # Task JSONL: new instances of trained families, the primary benchmark
    novel_tasks: Path  # Task JSONL: families never trained, the generalisation benchmark


def records(tasks: list[WorldTask], backend: str) -> list[PairRecord]:
    return [PairRecord(id=t.id, source="demo", reference=t.reference, kernel=t.solution(backend), level=t.level,
                       provenance={"family": t.family, "split": t.split, "backend": backend, "variant": t.variant})
            for t in tasks]


def task_rows(tasks: list[WorldTask]) -> list[dict]:
    return [{"id": t.id, "name": t.name, "level": t.level, "problem_id": t.problem_id, "code": t.reference,
             "family": t.family} for t in tasks]


def write_world(tasks: list[WorldTask], out_dir: Path, backend: str) -> WorldFiles:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, not {backend!r}")
    out_dir.mkdir(parents=True, exist_ok=True)
    recs = records(tasks, backend)
    train = [r for r, t in zip(recs, tasks) if t.split == TRAIN]
    rl = [r for r, t in zip(recs, tasks) if t.split == RL] or train
    kernels = {t.id for t in tasks if t.split in (TRAIN, RL) and t.variant not in (SHORTCUT, SLIP)}
    splits = {r.id: split_program(r.kernel) for r in train + rl}
    files = WorldFiles(pairs=out_dir / "pairs.jsonl", sft=out_dir / "sft.jsonl", rl_infill=out_dir / "rl_infill.jsonl",
                       rl_e2e=out_dir / "rl_e2e.jsonl", train_tasks=out_dir / "train_tasks.jsonl",
                       valid_tasks=out_dir / "valid_tasks.jsonl", heldout_tasks=out_dir / "heldout_tasks.jsonl",
                       novel_tasks=out_dir / "novel_tasks.jsonl")
    write_records(files.pairs, recs)
    write_sft(sft_rows(train, splits, backend=backend), out_dir)
    write_table(rl_infill_tasks([r for r in rl if r.id in kernels], splits, backend=backend), out_dir, "rl_infill")
    write_table(rl_e2e_tasks(rl, backend=backend), out_dir, "rl_e2e")
    for split, path in ((TRAIN, files.train_tasks), (VALID, files.valid_tasks), (HELDOUT, files.heldout_tasks),
                        (NOVEL, files.novel_tasks)):
        write_jsonl(path, task_rows([t for t in tasks if t.split == split]))
    return files
