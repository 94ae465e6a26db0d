'''Every prompt template in one place, shared by data curation (SFT rows, RL task sets) and generation so that
training and sampling see the same text: the Qwen3 chat wrapper, the end-to-end one-shot prompt (KernelBench's
layout, our wording) and the infilling prompt. Pure string functions; imports nothing.
'''

from __future__ import annotations

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
# Qwen3's template renders the final assistant turn (and its enable_thinking=False generation prompt) with an
# empty think block; SFT prompts end with it so training and sampling see the same prefix.
EMPTY_THINK = "<think>\n\n</think>\n\n"
SYSTEM_PROMPT = "You are an expert GPU programmer who writes fast, correct CUDA kernels for PyTorch programs."

EXAMPLE_MODEL = '''import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()

    def forward(self, a, b):
        return a + b


def get_inputs():
    a = torch.randn(1, 128).cuda()
    b = torch.randn(1, 128).cuda()
    return [a, b]


def get_init_inputs():
    return []
'''

EXAMPLE_MODEL_NEW = '''import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

source = """
#include <torch/extension.h>
#include <cuda_runtime.h>

__global__ void elementwise_add_kernel(const float* a, const float* b, float* out, int size) {
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx < size) {
        out[idx] = a[idx] + b[idx];
    }
}

torch::Tensor elementwise_add_cuda(torch::Tensor a, torch::Tensor b) {
    auto size = a.numel();
    auto out = torch::zeros_like(a);
    const int block_size = 256;
    const int num_blocks = (size + block_size - 1) / block_size;
    elementwise_add_kernel<<<num_blocks, block_size>>>(a.data_ptr<float>(), b.data_ptr<float>(),
                                                       out.data_ptr<float>(), size);
    return out;
}
"""

cpp_src = "torch::Tensor elementwise_add_cuda(torch::Tensor a, torch::Tensor b);"

elementwise_add = load_inline(
    name="elementwise_add",
    cpp_sources=cpp_src,
    cuda_sources=source,
    functions=["elementwise_add_cuda"],
    verbose=False,
)


class ModelNew(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.elementwise_add = elementwise_add

    def forward(self, a, b):
        return self.elementwise_add.elementwise_add_cuda(a, b)
'''

# The CPU backend cannot run CUDA: there the task is a C++ extension (load_inline with cpp_sources only).
EXAMPLE_MODEL_NEW_CPU = '''import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

source = \"\"\"
#include <torch/extension.h>

torch::Tensor elementwise_add(torch::Tensor a, torch::Tensor b) {
    auto ac = a.contiguous();
    auto bc = b.contiguous();
    auto out = torch::empty_like(ac);
    const float* pa = ac.data_ptr<float>();
    const float* pb = bc.data_ptr<float>();
    float* po = out.data_ptr<float>();
    for (int64_t i = 0; i < ac.numel(); ++i) po[i] = pa[i] + pb[i];
    return out;
}
\"\"\"

elementwise_add = load_inline(
    name="elementwise_add",
    cpp_sources=source,
    functions=["elementwise_add"],
    verbose=False,
)


class ModelNew(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.elementwise_add = elementwise_add

    def forward(self, a, b):
        return self.elementwise_add.elementwise_add(a, b)
'''

_INTRO = (
    "You write custom CUDA kernels to replace the PyTorch operators in the given architecture to get speedups.\n\n"
    "You are free to choose which operators to replace: some may stay in PyTorch. You may fuse several operators "
    "into one kernel (for example matmul + relu) or change the algorithm (for example an online softmax).\n\n"
)
_INTRO_CPU = _INTRO.replace("custom CUDA kernels", "custom C++ kernels (CPU: `load_inline` with cpp_sources "
                                                  "only, no CUDA)")


def code_block(code: str) -> str:
    return f"```python\n{code.rstrip()}\n```"


def chat_prompt(user: str, system: str | None = SYSTEM_PROMPT) -> str:
    """A Qwen3 chat prompt that ends where the assistant's answer begins."""
    head = f"{IM_START}system\n{system}{IM_END}\n" if system else ""
    return f"{head}{IM_START}user\n{user}{IM_END}\n{IM_START}assistant\n{EMPTY_THINK}"


def chat_response(answer: str) -> str:
    """The assistant turn's text after the prompt, closed by `<|im_end|>` so the model learns to stop."""
    return f"{answer}{IM_END}"


def e2e_user(reference: str, backend: str = "cuda") -> str:
    """End-to-end: instructions, the element-wise-add one-shot example, the task, and the output rules.

    backend "cpu" asks for a C++ extension (`load_inline` with cpp_sources only): the CPU harness cannot run CUDA.
    """
    if backend == "cuda":
        intro, example, kind = _INTRO, EXAMPLE_MODEL_NEW, "CUDA"
    elif backend == "cpu":
        intro, example, kind = _INTRO_CPU, EXAMPLE_MODEL_NEW_CPU, "C++"
    else:
        raise ValueError(f"backend must be 'cuda' or 'cpu', got {backend!r}")
    return (
        f"{intro}Here is an example. The given architecture:\n\n{code_block(EXAMPLE_MODEL)}\n\n"
        f"The same architecture with an inline {kind} kernel:\n\n{code_block(example)}\n\n"
        f"You are given the following architecture:\n\n{code_block(reference)}\n\n"
        f"Optimize the architecture named Model with custom {kind} operators. Name your optimized architecture "
        "ModelNew. Output the complete new code in one ```python code block. Write real code, not pseudocode; "
        "it must compile and run. Do not output testing code."
    )


def infill_user(reference: str, prefix: str, suffix: str, example: tuple[str, str, str], backend: str = "cuda") -> str:
    """Infilling: the model sees the program around the CUDA source and writes the whole program.

    `example` is the (prefix, core, suffix) cut of `EXAMPLE_MODEL_NEW` (`EXAMPLE_MODEL_NEW_CPU` for backend "cpu";
    the caller computes it with the same splitter used for the data, so the worked example always matches the real
    cut). backend "cpu" asks for a C++ source string (`load_inline` with cpp_sources only).
    """
    if backend == "cuda":
        intro, kind, decls = _INTRO, "CUDA", "the C++ declarations, "
    elif backend == "cpu":
        intro, kind, decls = _INTRO_CPU, "C++", ""
    else:
        raise ValueError(f"backend must be 'cuda' or 'cpu', got {backend!r}")
    ex_prefix, _, ex_suffix = example
    return (
        f"{intro}Part of the new program is already written: the code before the {kind} source string (prefix) and "
        f"the code after it (suffix: {decls}the load_inline call and class ModelNew). Write the "
        f"{kind} source string that fits between them and output the whole program.\n\n"
        f"Example. PyTorch code:\n\n{code_block(EXAMPLE_MODEL)}\n\nPrefix:\n\n{code_block(ex_prefix)}\n\n"
        f"Suffix:\n\n{code_block(ex_suffix)}\n\nComplete program:\n\n{code_block(''.join(example))}\n\n"
        f"Now the task. PyTorch code:\n\n{code_block(reference)}\n\nPrefix:\n\n{code_block(prefix)}\n\n"
        f"Suffix:\n\n{code_block(suffix)}\n\n"
        f"Output the complete program (prefix, your {kind} source, suffix) in one ```python code block, with "
        "the prefix and suffix unchanged."
    )
