"""Memory plans (`dice train sft|rl CONFIG --plan`): the model built on the meta device (no weights, no GPU) gives the
parameter count; FSDP2 with fp32 master weights and bf16 compute gives the per-GPU bytes of states, gathered
layers and activations (per token and layer, counted from what autograd saves in this model's layers). An SFT step's
peak is the larger of the start of the last micro-batch's backward (every activation alive) and AdamW's update
(weights, gradients, moments: the fused update keeps no temporary); an RL step's, of its rollouts (the weights
gathered whole, the KV cache) and its update (a replayed micro-batch, log-probs a chunk of tokens at a time)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dice_kernels.model.config import ModelConfig
from dice_kernels.model.transformer import BlockDiffusionLM
from dice_kernels.sampling.decoder import (cache_slots, committing_queries_per_kv_head, flex_blocks, row_tokens,
                                           rows_per_prompt_copy)
from dice_kernels.train.logprobs import CHUNK_TOKENS
from dice_kernels.train.rl.config import RolloutConfig
from dice_kernels.train.rl.tracerl import flex_replay_length

GiB = 2**30
COMPUTE_BYTES = 2  # bf16 activations and gathered parameters
HEADROOM = 0.95  # a plan "fits" a GPU when its peak is at most this share of the GPU's memory
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


def gathered_bytes(layer_params: int, layers: int, gpus: int) -> float:
    """bf16 layers gathered at once (this one and the prefetched next; every one on one GPU, which keeps them from
    forward to backward), a layer's bf16 gradients and its fp32 reduce buffer."""
    return layer_params * ((layers if gpus == 1 else 2) * COMPUTE_BYTES + COMPUTE_BYTES + 4)


def activation_bytes(cfg: ModelConfig, tokens: int) -> tuple[float, float]:
    """What a forward of `tokens` tokens saves for backward: (without, with activation checkpointing). With it,
    each layer's input, plus one layer recomputed; both with the embedding output and the final norm's in and out."""
    per_token = activation_bytes_per_token(cfg)
    edge = 3 * tokens * cfg.hidden_size * COMPUTE_BYTES
    return (cfg.num_hidden_layers * tokens * per_token + edge,
            cfg.num_hidden_layers * tokens * cfg.hidden_size * COMPUTE_BYTES + tokens * per_token + edge)


def memory_plan(cfg: ModelConfig, gpus: int, row_len: int, micro_rows: int, accumulation: int = 1,
                masked_fraction: float = 0.5) -> MemoryPlan:
    """Per-GPU memory of an SFT step. `masked_fraction`: masked tokens per row token (E[p] = 0.5 times the
    response share; 0.5 assumes all-response rows, an upper estimate)."""
    params, layer = count_params(cfg)
    root = params - layer * cfg.num_hidden_layers
    tokens = 2 * row_len * micro_rows
    masked = int(masked_fraction * row_len * micro_rows)
    activations, activations_ac = activation_bytes(cfg, tokens)
    return MemoryPlan(
        params=params, layer_params=layer, gpus=gpus, accumulation=accumulation, tokens=tokens, masked_tokens=masked,
        weights=4 * params / gpus, grads=4 * params / gpus, adam=8 * params / gpus,
        gathered=gathered_bytes(layer, cfg.num_hidden_layers, gpus), root=root * 2 * COMPUTE_BYTES,
        activations=activations, activations_ac=activations_ac, logits=masked * cfg.vocab_size * LOGIT_BYTES,
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
        verdict = "fits" if total <= gpu_memory_gib * GiB * HEADROOM else "does NOT fit"
        chosen = "  <- this config" if ac == checkpointing else ""
        lines.append(f"peak per GPU {'with' if ac else 'without'} AC: {g(total)} of {gpu_memory_gib:g} GiB: "
                     f"{verdict}{chosen}")
    lines.append("(plus the CUDA context and allocator slack, ~1-3 GiB; 'fits' leaves 5 % headroom)")
    return "\n".join(lines)


@dataclass(frozen=True)
class RLMemoryPlan:
    """Per-GPU bytes of an RL step: the states held throughout, then each phase's own. The lengths are upper
    estimates (every row reaches the longest prompt plus `max_new_tokens`, every block is decoded in all its
    denoising steps); not counted: the compiled decoder's ~0.6 GiB, the CUDA context and the allocator's slack."""

    params: int
    gpus: int
    rollout_rows: int  # rows decoded together
    kv_slots: int  # KV-cache slots a row: the longest prompt and every new token, in whole flex blocks
    prompt_copies: int  # shared copies of the groups' prompts (compiled decoding, `rollout.share_prompts`)
    micro_rows: int
    replay_tokens: int  # a replayed row: clean context and a noisy copy of each block per step, padded for flex
    share_weights: bool
    weights: float  # fp32 master weights, sharded
    adam: float  # AdamW's two fp32 moments (from the first optimizer step on), sharded
    # rolling out
    rollout_weights: float  # bf16 weights whole on every GPU: gathered in place, or the policy's copy
    refresh: float  # the copy's refresh: the fp32 state dict gathered whole (several GPUs, before the KV cache)
    kv_cache: float
    prefill: float  # the prompts' forward that fills the cache, all at once: a layer's largest live temporaries
    decoder: float  # a forward's logits (bf16, fp32, the CUDA graphs' buffer)
    # updating
    grads: float  # fp32 gradients, sharded, accumulated over the micro-batches
    gathered: float
    root: float
    activations: float
    activations_ac: float
    logprobs: float  # a chunk's logits and gradients, the lm_head's gradient summed in fp32, the scored hiddens
    policy_copy: float  # the rollout policy's copy, kept through the update (without `share_weights`)

    def rollout_peak(self) -> float:
        return (self.weights + self.adam + self.rollout_weights
                + max(self.refresh, self.kv_cache + max(self.prefill, self.decoder)))

    def rollout_rows_within(self, budget: float) -> int:
        """The most rows decoded together whose rollouts fit `budget` bytes (0: none)."""
        # shared prompt copies and their prefill counted per row: an upper bound
        per_row = (self.kv_cache + max(self.prefill, self.decoder)) / self.rollout_rows
        free = budget - self.weights - self.adam - self.rollout_weights
        return max(0, int(free // per_row))

    def update_peak(self, checkpointing: bool) -> float:
        acts = self.activations_ac if checkpointing else self.activations
        return (self.weights + self.adam + self.grads + self.gathered + self.root + acts + self.logprobs
                + self.policy_copy)

    def total(self, checkpointing: bool) -> float:
        return max(self.rollout_peak(), self.update_peak(checkpointing))

    def fits(self, gpu_memory_gib: float, checkpointing: bool) -> bool:
        return self.total(checkpointing) <= gpu_memory_gib * GiB * HEADROOM


def rl_memory_plan(cfg: ModelConfig, gpus: int, prompt_tokens: int, rollout: RolloutConfig,
                   micro_rows: int) -> RLMemoryPlan:
    """Per-GPU memory of an RL step: a rank's rollouts (its share of `rollout.tasks_per_step` x `group`, up to
    `batch_rows` decoded together, prompts of up to `prompt_tokens`), then the TraceRL update, `micro_rows` replayed
    responses a forward."""
    params, layer = count_params(cfg)
    block, new = rollout.block_size, rollout.max_new_tokens
    share = -(-rollout.tasks_per_step * rollout.group // gpus)  # this rank's rollouts
    rows = min(rollout.batch_rows, share)
    seq = row_tokens(prompt_tokens, new, block)
    slots = cache_slots(seq, block)
    kv_per_slot = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * COMPUTE_BYTES
    # compiled decoding of whole groups at once: a copy of a group's prompt per few rows, beside the rows' own cache
    # (which still has room for the prompt: a row of an uncompiled or refilled batch holds its own)
    shared = rollout.compile and rollout.share_prompts and rollout.group > 1 and rows == share
    copies = rows // rows_per_prompt_copy(rollout.group, committing_queries_per_kv_head(cfg, block)) if shared else 0
    replay = flex_replay_length(prompt_tokens + new * (1 + rollout.steps))
    scored = micro_rows * new
    chunk = min(CHUNK_TOKENS, scored)
    activations, activations_ac = activation_bytes(cfg, micro_rows * replay)
    copy = COMPUTE_BYTES * params
    return RLMemoryPlan(
        params=params, gpus=gpus, rollout_rows=rows, kv_slots=slots, prompt_copies=copies, micro_rows=micro_rows,
        replay_tokens=replay, share_weights=rollout.share_weights,
        weights=4 * params / gpus, adam=8 * params / gpus,
        rollout_weights=copy, refresh=4 * params if gpus > 1 and not rollout.share_weights else 0.0,
        kv_cache=(rows * slots + copies * flex_blocks(seq - new)) * kv_per_slot,
        # one forward over every row's prompt (each copy's, when shared); its MLP holds the most at once: the
        # residual stream, its norm, and the gate, up and activated projections
        prefill=(copies or rows) * prompt_tokens * (2 * cfg.hidden_size + 3 * cfg.intermediate_size) * COMPUTE_BYTES,
        decoder=rows * block * cfg.vocab_size * (COMPUTE_BYTES + 4 + 4),
        grads=4 * params / gpus, gathered=gathered_bytes(layer, cfg.num_hidden_layers, gpus),
        root=(params - layer * cfg.num_hidden_layers) * 2 * COMPUTE_BYTES,
        activations=activations, activations_ac=activations_ac,
        logprobs=(chunk * cfg.vocab_size * (COMPUTE_BYTES + 4 + COMPUTE_BYTES)
                  + cfg.vocab_size * cfg.hidden_size * (4 + COMPUTE_BYTES) + 2 * scored * cfg.hidden_size * COMPUTE_BYTES),
        policy_copy=0.0 if rollout.share_weights else copy,
    )


def rl_fit_advice(plan: RLMemoryPlan, gpu_memory_gib: float, checkpointing: bool) -> list[str]:
    """What to change where a step does not fit one GPU of `gpu_memory_gib` GiB (nothing where it fits)."""
    budget, advice = gpu_memory_gib * GiB * HEADROOM, []
    if plan.rollout_peak() > budget:
        rows = plan.rollout_rows_within(budget)
        advice.append(f"rollouts fit with rollout.batch_rows = {rows} (or fewer)" if rows else
                      "rollouts do not fit at any rollout.batch_rows: shard over more GPUs")
    if plan.update_peak(checkpointing) > budget:
        advice.append("the update does not fit: lower update.micro_rows"
                      + ("" if checkpointing else ", turn on parallel.activation_checkpointing")
                      + " or shard over more GPUs")
    return advice


def format_rl_plan(plan: RLMemoryPlan, gpu_memory_gib: float, checkpointing: bool) -> str:
    g = lambda b: f"{b / GiB:8.1f} GiB"  # noqa: E731
    weights_how = ("the trained model's, gathered in place (rollout.share_weights)" if plan.share_weights
                   else "the rollout policy's copy")
    lines = [
        f"parameters        {plan.params / 1e9:8.3f} B",
        f"per GPU, sharded over {plan.gpus} GPU(s), held through the step:",
        f"  fp32 weights      {g(plan.weights)}",
        f"  AdamW moments     {g(plan.adam)}",
        f"rolling out, {plan.rollout_rows} rows at once, {plan.kv_slots} cache slots a row"
        + (f", {plan.prompt_copies} shared prompt copies:" if plan.prompt_copies else ":"),
        f"  bf16 weights      {g(plan.rollout_weights)}   (all of them: {weights_how})",
    ]
    if plan.refresh:
        lines.append(f"  copy's refresh    {g(plan.refresh)}   (the fp32 state dict gathered whole, before decoding)")
    lines += [
        f"  KV cache          {g(plan.kv_cache)}",
        f"  prefill           {g(plan.prefill)}   (the prompts' forward, all at once, before decoding)",
        f"  decoder logits    {g(plan.decoder)}",
        f"  rollout peak      {g(plan.rollout_peak())}",
        f"updating, {plan.micro_rows} replayed row(s) a forward of up to {plan.replay_tokens} tokens "
        "(context and a noisy copy of each block per step):",
        f"  fp32 gradients    {g(plan.grads)}",
        f"  gathered layers   {g(plan.gathered)}   (bf16 weights of 2 layers, all on 1 GPU; grads, fp32 reduce buffer)",
        f"  root unit         {g(plan.root)}   (embeddings / lm_head / norm, gathered all step, + grads)",
        f"  activations       {g(plan.activations)}   without activation checkpointing",
        f"  activations (AC)  {g(plan.activations_ac)}   with activation checkpointing",
        f"  log-probs         {g(plan.logprobs)}   (a chunk of logits, the lm_head's fp32 gradient)",
    ]
    if plan.policy_copy:
        lines.append(f"  policy's copy     {g(plan.policy_copy)}   (kept through the update: rollout.share_weights "
                     "is off)")
    lines += [f"  update peak       {g(plan.update_peak(False))}   without activation checkpointing",
              f"  update peak (AC)  {g(plan.update_peak(True))}   with it"]
    for ac in (False, True):
        verdict = "fits" if plan.fits(gpu_memory_gib, ac) else "does NOT fit"
        chosen = "  <- this config" if ac == checkpointing else ""
        lines.append(f"step peak per GPU {'with' if ac else 'without'} AC: {g(plan.total(ac))} of {gpu_memory_gib:g} "
                     f"GiB: {verdict}{chosen}")
    lines += rl_fit_advice(plan, gpu_memory_gib, checkpointing)
    lines.append("(plus the CUDA context, compiled kernels and allocator slack, ~1-3 GiB; 'fits' leaves 5 % headroom;"
                 " every row as long as the config allows)")
    return "\n".join(lines)
