"""Memory plan (`dice train sft CONFIG --plan`): the model built on the meta device (no weights, no GPU) gives the
parameter count; FSDP2 with fp32 master weights and bf16 compute gives the per-GPU bytes of states, gathered
layers and activations (per token and layer, counted from what autograd saves in this model's layers). A step's
peak is the larger of two moments: the start of the last micro-batch's backward (every activation alive) and
AdamW's update (weights, gradients, moments: the fused update keeps no temporary)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dice_kernels.model.config import ModelConfig
from dice_kernels.model.transformer import BlockDiffusionLM

GiB = 2**30
COMPUTE_BYTES = 2  # bf16 activations and gathered parameters
# Per masked token and vocabulary entry at the start of backward: the saved fp32 log-softmax, its incoming fp32
# gradient, the gradient of the logits (fp32) and its bf16 cast.
LOGIT_BYTES = 4 + 4 + 4 + 2


@dataclass(frozen=True)
class MemoryPlan:
    params: int
    layer_params: int
    gpus: int
    accumulation: int  # micro-batches per optimizer step on one GPU
    tokens: int  # tokens in one forward (the doubled [noisy | clean] micro-batch)
    masked_tokens: int
    weights: float  # bytes per GPU: fp32 master weights, sharded
    grads: float  # fp32 gradients, sharded
    adam: float  # AdamW's two fp32 moments, sharded
    gathered: float  # bf16 layers gathered at once (this one and the prefetched next; every one on one GPU, which
    #                  keeps them from forward to backward), a layer's grads, reduce buffer
    root: float  # the root unit (embeddings, final norm, lm_head) gathered for the whole step, and its bf16 grads
    activations: float  # saved for backward, without activation checkpointing
    activations_ac: float  # with it: each layer's input, plus one layer recomputed
    logits: float

    def backward_peak(self, checkpointing: bool) -> float:
        """Start of the last micro-batch's backward: weights, moments, the gradients of earlier micro-batches,
        gathered units, every saved activation and the logits."""
        acts = self.activations_ac if checkpointing else self.activations
        grads = self.grads if self.accumulation > 1 else 0.0
        return self.weights + self.adam + grads + self.gathered + self.root + acts + self.logits

    def update_peak(self) -> float:
        """AdamW's fused update (CUDA): weights, gradients and moments, updated in place."""
        return self.weights + self.grads + self.adam

    def total(self, checkpointing: bool) -> float:
        return max(self.backward_peak(checkpointing), self.update_peak())


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


def memory_plan(cfg: ModelConfig, gpus: int, row_len: int, micro_rows: int, accumulation: int = 1,
                masked_fraction: float = 0.5) -> MemoryPlan:
    """Per-GPU memory of a training step. `masked_fraction`: masked tokens per row token (E[p] = 0.5 times the
    response share; 0.5 assumes all-response rows, an upper estimate)."""
    params, layer = count_params(cfg)
    root = params - layer * cfg.num_hidden_layers
    tokens = 2 * row_len * micro_rows
    masked = int(masked_fraction * row_len * micro_rows)
    per_token = activation_bytes_per_token(cfg)
    edge = 3 * tokens * cfg.hidden_size * COMPUTE_BYTES  # embedding output, final norm in/out
    return MemoryPlan(
        params=params, layer_params=layer, gpus=gpus, accumulation=accumulation, tokens=tokens, masked_tokens=masked,
        weights=4 * params / gpus, grads=4 * params / gpus, adam=8 * params / gpus,
        gathered=layer * ((cfg.num_hidden_layers if gpus == 1 else 2) * COMPUTE_BYTES + COMPUTE_BYTES + 4),
        root=root * 2 * COMPUTE_BYTES,
        activations=cfg.num_hidden_layers * tokens * per_token + edge,
        activations_ac=cfg.num_hidden_layers * tokens * cfg.hidden_size * COMPUTE_BYTES + tokens * per_token + edge,
        logits=masked * cfg.vocab_size * LOGIT_BYTES,
    )


def format_plan(plan: MemoryPlan, gpu_memory_gib: float, checkpointing: bool) -> str:
    g = lambda b: f"{b / GiB:8.1f} GiB"  # noqa: E731
    lines = [
        f"parameters        {plan.params / 1e9:8.3f} B  ({plan.layer_params / 1e6:.1f} M per layer)",
        f"tokens / forward  {plan.tokens:8d}    ([noisy | clean] doubled), ~{plan.masked_tokens} masked; "
        f"{plan.accumulation} micro-batch(es) per step",
        f"per GPU, sharded over {plan.gpus} GPU(s):",
        f"  fp32 weights      {g(plan.weights)}",
        f"  fp32 gradients    {g(plan.grads)}",
        f"  AdamW moments     {g(plan.adam)}",
        f"  gathered layers   {g(plan.gathered)}   (bf16 weights of 2 layers, all on 1 GPU; grads, fp32 reduce buffer)",
        f"  root unit         {g(plan.root)}   (embeddings / lm_head / norm, gathered all step, + grads)",
        f"  lm_head logits    {g(plan.logits)}   (masked tokens only)",
        f"  activations       {g(plan.activations)}   without activation checkpointing",
        f"  activations (AC)  {g(plan.activations_ac)}   with activation checkpointing",
        f"  AdamW update      {g(plan.update_peak())}   (weights, grads, moments; fused, in place)",
    ]
    for ac in (False, True):
        total = plan.total(ac)
        verdict = "fits" if total <= gpu_memory_gib * GiB * 0.95 else "does NOT fit"
        chosen = "  <- this config" if ac == checkpointing else ""
        lines.append(f"peak per GPU {'with' if ac else 'without'} AC: {g(total)} of {gpu_memory_gib:g} GiB: "
                     f"{verdict}{chosen}")
    lines.append("(plus the CUDA context and allocator slack, ~1-3 GiB; 'fits' leaves 5 % headroom)")
    return "\n".join(lines)
