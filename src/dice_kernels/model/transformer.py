"""The SDAR/Qwen3 decoder: GQA with q/k RMSNorm, RoPE, SwiGLU, tied or untied lm_head. Module and parameter names
mirror Hugging Face's Qwen3 (`model.layers.N.self_attn.q_proj`, ...) so a state dict maps 1:1 onto checkpoints.
There is no logit shift: the logit at position i predicts token i. How tokens attend is passed in (`Attention`).
A layer's element-wise work lives in two pure functions of tensors around the KV-cache write and attention
(`attention_inputs`, `mlp_residual`), so decoding can run them through torch.compile (`compiled_ops`)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask

from dice_kernels.model.attention import Attention, attend, attend_with_prefix, fold_gqa_mask
from dice_kernels.model.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # One fused kernel (fp32 accumulation). Qwen3 rounds to the input dtype before scaling by the weight; in
        # bf16 that differs by at most a rounding step, and decoding at small batch is bound by kernel launches.
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin [B, L, 1, head_dim] for integer positions [B, L] (computed in fp32, as transformers does), to
    broadcast over the heads of [B, L, H, head_dim] tensors. The first half of `sin` is negated: that sign of
    Qwen's rotate_half then costs no kernel in `apply_rope` (computed once a forward, not once a layer)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float) / head_dim)
    angles = positions[..., None].float() * inv_freq
    angles = torch.cat([angles, angles], dim=-1)[:, :, None]
    sin = angles.sin()
    sin[..., : head_dim // 2].neg_()
    return angles.cos().to(dtype), sin.to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Qwen's x * cos + rotate_half(x) * sin, bit for bit: rotate_half(x) = [-x2, x1] is the roll [x2, x1] with
    the sign carried by `sin` (4 kernels instead of 6)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


# A layer's two element-wise-heavy regions: pure functions of tensors (the weights are arguments), so one
# torch.compile of each serves every layer. Their ops, in their order, are those of the module-per-op layer they
# replaced (nn.Linear is F.linear without a bias), so eager results and gradients are the same bits.

def attention_inputs(x: Tensor, norm_w: Tensor, q_w: Tensor, k_w: Tensor, v_w: Tensor, q_norm_w: Tensor,
                     k_norm_w: Tensor, cos: Tensor, sin: Tensor, eps: float, heads: int,
                     kv_heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """Input RMSNorm, q/k/v projections, q/k RMSNorm and RoPE: q [B, L, heads, D], k and v [B, L, kv_heads, D]."""
    batch, length, _ = x.shape
    head_dim = q_norm_w.shape[0]
    h = F.rms_norm(x, (x.shape[-1],), norm_w, eps)
    # RoPE before the head transpose: its element-wise kernels read the contiguous projections rather than
    # transposed views (the same values; the transposed layout attention gets is unchanged)
    q = apply_rope(F.rms_norm(F.linear(h, q_w).view(batch, length, heads, head_dim), (head_dim,), q_norm_w, eps),
                   cos, sin)
    k = apply_rope(F.rms_norm(F.linear(h, k_w).view(batch, length, kv_heads, head_dim), (head_dim,), k_norm_w, eps),
                   cos, sin)
    return q, k, F.linear(h, v_w).view(batch, length, kv_heads, head_dim)


def mlp_residual(x: Tensor, attn_out: Tensor, o_w: Tensor, norm_w: Tensor, gate_w: Tensor, up_w: Tensor,
                 down_w: Tensor, eps: float) -> Tensor:
    """o_proj and its residual, post-attention RMSNorm, the SwiGLU MLP and its residual."""
    x = x + F.linear(attn_out, o_w)
    h = F.rms_norm(x, (x.shape[-1],), norm_w, eps)
    return x + F.linear(F.silu(F.linear(h, gate_w)) * F.linear(h, up_w), down_w)


@dataclass(frozen=True)
class LayerOps:
    """How a layer runs its two regions."""

    attention_inputs: Callable[..., tuple[Tensor, Tensor, Tensor]]
    mlp_residual: Callable[..., Tensor]


EAGER_OPS = LayerOps(attention_inputs, mlp_residual)


@functools.cache
def compiled_ops() -> LayerOps:
    """The two regions through torch.compile: inductor fuses each one's norms, RoPE, SiLU, product and residual adds
    (the GEMMs stay cuBLAS calls). Compiled on first use per shape family and shared by every layer; decoding asks
    for it (`SamplingConfig.compile`) and captures its CUDA graphs after a warm-up forward, so they replay the fused
    kernels."""
    return LayerOps(torch.compile(attention_inputs, fullgraph=True), torch.compile(mlp_residual, fullgraph=True))


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, attn: Attention) -> Tensor:
        """q [B, L, Hq, D], k and v [B, L, Hkv, D] -> [B, L, Hq * D]: through the KV cache when there is one."""
        batch, length = q.shape[:2]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if attn.cache is not None:
            k, v = attn.cache.write_and_read(self.layer_idx, k, v, attn.slots, attn.kv_len)
        if attn.prefix is not None:
            out = attend_with_prefix(q, k, v, attn.mask, attn.prefix, self.layer_idx)
        else:
            out = attend(q, k, v, attn.mask, cached=attn.cache is not None)
        return out.transpose(1, 2).reshape(batch, length, -1)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = SelfAttention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn: Attention, ops: LayerOps = EAGER_OPS) -> Tensor:
        """The layer through `ops`' two regions. The weights are read here, inside the layer's forward, where an
        FSDP2-sharded layer has them gathered."""
        a, mlp, eps = self.self_attn, self.mlp, self.input_layernorm.eps
        q, k, v = ops.attention_inputs(x, self.input_layernorm.weight, a.q_proj.weight, a.k_proj.weight,
                                       a.v_proj.weight, a.q_norm.weight, a.k_norm.weight, cos, sin, eps,
                                       a.num_heads, a.num_kv_heads)
        return ops.mlp_residual(x, a.attend(q, k, v, attn), a.o_proj.weight, self.post_attention_layernorm.weight,
                                mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight, eps)


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class BlockDiffusionLM(nn.Module):
    """`hidden_states` runs the decoder; `forward` adds the lm_head, optionally on a slice of positions only
    (the sampler needs logits for the current block, not for the whole 150k-vocab sequence)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Decoder(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.layer_ops = EAGER_OPS  # or compiled_ops(), which decoding switches to while it runs (`using_layer_ops`)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the lm_head when the config says so (call again after assigning weights)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @contextlib.contextmanager
    def using_layer_ops(self, ops: LayerOps) -> Iterator[None]:
        """Run the layers' regions through `ops` (e.g. `compiled_ops()`) inside the block."""
        saved, self.layer_ops = self.layer_ops, ops
        try:
            yield
        finally:
            self.layer_ops = saved

    def hidden_states(self, input_ids: Tensor, positions: Tensor, attn: Attention) -> Tensor:
        """Final-norm hidden states [B, L, hidden] of tokens `input_ids` [B, L] at RoPE `positions` [B, L]."""
        cfg = self.config
        x = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, x.dtype)
        if not isinstance(attn.mask, BlockMask):
            groups, kv_heads = cfg.num_attention_heads // cfg.num_key_value_heads, cfg.num_key_value_heads
            bias = (kv_heads, x.dtype) if attn.cache is not None else (None, None)  # small-query path: cache only
            attn = Attention(fold_gqa_mask(attn.mask, groups, *bias), attn.cache, attn.slots, attn.kv_len)
        for layer in self.model.layers:
            x = layer(x, cos, sin, attn, self.layer_ops)
        return self.model.norm(x)

    def forward(self, input_ids: Tensor, positions: Tensor, attn: Attention, keep: slice = slice(None)) -> Tensor:
        """Logits [B, L', vocab] for the positions `keep` selects (all by default)."""
        # contiguous: matmul folds a 3-D input into one GEMM only when it is, or when the weight requires grad;
        # otherwise (a slice, weights frozen for sampling) it runs a batched GEMM that reads the whole 150k-vocab
        # weight once per row: 2.3x the time of a committing decode forward at batch 128
        return self.lm_head(self.hidden_states(input_ids, positions, attn)[:, keep].contiguous())
