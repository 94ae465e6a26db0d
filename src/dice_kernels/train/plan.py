"""Memory plan (`dice train sft CONFIG --plan`): the model built on the meta device (no weights, no GPU) gives the
parameter count; FSDP2 with fp32 master weights and bf16 compute gives the per-GPU bytes of states, gathered
layers and activations (per token and layer, counted from what autograd saves in this model's layers)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dice_kernels.model.config import ModelConfig
from dice_kernels.model.transformer import BlockDiffusionLM

GiB = 2**30
COMPUTE_BYTES = 2  # bf16 activations and gathered parameters
# Per masked token and vocabulary entry: bf16 logits, their fp32 copy, the saved log-softmax, and in backward
# the fp32 gradient and its bf16 cast.
LOGIT_BYTES = 2 + 4 + 4 + 4 + 2


@dataclass(frozen=True)
class MemoryPlan:
    params: int
    layer_params: int
    gpus: int
    tokens: int  # tokens in one forward (the doubled [noisy | clean] micro-batch)
    masked_tokens: int
    states: float  # bytes per GPU: fp32 params + fp32 grads + AdamW moments, sharded
    gathered: float  # bf16 layers all-gathered at once (this one and the prefetched next) and their grads
    root: float  # the root unit (embeddings, final norm, lm_head) gathered for the whole step, and its grads
    activations: float  # saved for backward, without activation checkpointing
    activations_ac: float  # with it: each layer's input, plus one layer recomputed
    logits: float

    def total(self, checkpointing: bool) -> float:
        acts = self.activations_ac if checkpointing else self.activations
        return self.states + self.gathered + self.root + acts + self.logits


def count_params(cfg: ModelConfig) -> tuple[int, int]:
    """(unique parameters, parameters of one decoder layer) of the model, built on the meta device."""
    with torch.device("meta"):
        model = BlockDiffusionLM(cfg)
    unique = {id(p): p.numel() for p in model.parameters()}
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    return sum(unique.values()), layer


def activation_bytes_per_token(cfg: ModelConfig) -> float:
    """What one decoder layer saves for backward per token (bf16, fused flex attention):
    norm inputs and outputs (4 x hidden), q before/after norm+RoPE, attention output and o_proj input
    (4 x q width), k before/after, v (3 x kv width), MLP gate, up, silu and product (4 x intermediate);
    plus fp32 RMSNorm statistics and the attention log-sum-exp."""
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    saved = 4 * cfg.hidden_size + 4 * q + 3 * kv + 4 * cfg.intermediate_size
    stats = 4 * (2 + cfg.num_attention_heads + cfg.num_key_value_heads + cfg.num_attention_heads)
    return COMPUTE_BYTES * saved + stats


def memory_plan(cfg: ModelConfig, gpus: int, row_len: int, micro_rows: int,
                masked_fraction: float = 0.5) -> MemoryPlan:
    """Per-GPU memory of one training step. `masked_fraction`: masked tokens per row token (E[p] = 0.5 times the
    response share; 0.5 assumes all-response rows, an upper estimate)."""
    params, layer = count_params(cfg)
    root = params - layer * cfg.num_hidden_layers
    tokens = 2 * row_len * micro_rows
    masked = int(masked_fraction * row_len * micro_rows)
    per_token = activation_bytes_per_token(cfg)
    layers = cfg.num_hidden_layers
    edge = 3 * tokens * cfg.hidden_size * COMPUTE_BYTES  # embedding output, final norm in/out
    return MemoryPlan(
        params=params, layer_params=layer, gpus=gpus, tokens=tokens, masked_tokens=masked,
        states=16 * params / gpus,
        gathered=2 * 2 * layer * COMPUTE_BYTES,
        root=2 * root * COMPUTE_BYTES,
        activations=layers * tokens * per_token + edge,
        activations_ac=layers * tokens * cfg.hidden_size * COMPUTE_BYTES + tokens * per_token + edge,
        logits=masked * cfg.vocab_size * LOGIT_BYTES,
    )


def format_plan(plan: MemoryPlan, gpu_memory_gib: float, checkpointing: bool) -> str:
    g = lambda b: f"{b / GiB:8.1f} GiB"  # noqa: E731
    lines = [
        f"parameters        {plan.params / 1e9:8.3f} B  ({plan.layer_params / 1e6:.1f} M per layer)",
        f"tokens / forward  {plan.tokens:8d}    ([noisy | clean] doubled), ~{plan.masked_tokens} masked",
        f"per GPU, sharded over {plan.gpus} GPU(s):",
        f"  fp32 weights      {g(4 * plan.params / plan.gpus)}",
        f"  fp32 gradients    {g(4 * plan.params / plan.gpus)}",
        f"  AdamW moments     {g(8 * plan.params / plan.gpus)}",
        f"  gathered layers   {g(plan.gathered)}   (bf16 weights + grads, 2 layers in flight)",
        f"  root unit         {g(plan.root)}   (embeddings / lm_head / norm, gathered all step)",
        f"  lm_head logits    {g(plan.logits)}   (masked tokens only)",
        f"  activations       {g(plan.activations)}   without activation checkpointing",
        f"  activations (AC)  {g(plan.activations_ac)}   with activation checkpointing",
    ]
    for ac in (False, True):
        total = plan.total(ac)
        verdict = "fits" if total <= gpu_memory_gib * GiB * 0.95 else "does NOT fit"
        chosen = "  <- this config" if ac == checkpointing else ""
        lines.append(f"total per GPU {'with' if ac else 'without'} AC: {g(total)} of {gpu_memory_gib:g} GiB: "
                     f"{verdict}{chosen}")
    lines.append("(plus the CUDA context and allocator slack, ~1-3 GiB; 'fits' leaves 5 % headroom)")
    return "\n".join(lines)
