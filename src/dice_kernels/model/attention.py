"""Who may attend to whom, and the kernels that apply it. The block-diffusion rule is one `mask_mod` function
of per-token metadata (`Layout`); FlexAttention evaluates it lazily (no L x L tensor), and the SDPA path (KV cache,
CPU, the dense benchmark variant) gets its boolean mask from the same function, evaluated with broadcasting. Compiled
decoding attends over the KV cache through flex too (`cached_block_mask`), and rows decoding one prompt read its K/V
from one copy (`SharedPrefix`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, create_block_mask, flex_attention

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class Layout:
    """Per-token metadata the mask is a function of; each field is [B, L].

    doc:   sample id inside a packed row; tokens only see tokens of their own sample.
    pos:   position within the sample: the RoPE position, and block index = pos // block_size, so the block
           grid starts at position 0 of every sample.
    noisy: the token belongs to a noisy (partly masked) copy of its block rather than the clean one.
    """

    doc: Tensor
    pos: Tensor
    noisy: Tensor

    @staticmethod
    def clean(pos: Tensor) -> Layout:
        """One clean sample per row (inference without a cache, or a plain causal LM with block_size 1)."""
        return Layout(doc=torch.zeros_like(pos), pos=pos, noisy=torch.zeros_like(pos, dtype=torch.bool))

    def cat(self, other: Layout) -> Layout:
        return Layout(*(torch.cat([a, b], dim=1) for a, b in
                        ((self.doc, other.doc), (self.pos, other.pos), (self.noisy, other.noisy))))


def block_diffusion_mask_mod(q: Layout, k: Layout, block_size: int) -> MaskMod:
    """The SDAR mask as a FlexAttention mask_mod (b, h, q_idx, kv_idx) -> bool.

    noisy query: sees the noisy tokens of its own block (bidirectional) and the clean tokens of earlier blocks;
    clean query: sees clean tokens of its own and earlier blocks (block-causal; block_size 1 = causal);
    all of this within one sample. A clean query never sees a noisy token.
    """

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        q_block = q.pos[b, q_idx] // block_size
        k_block = k.pos[b, kv_idx] // block_size
        k_noisy = k.noisy[b, kv_idx]
        from_noisy = torch.where(k_noisy, k_block == q_block, k_block < q_block)
        from_clean = ~k_noisy & (k_block <= q_block)
        return torch.where(q.noisy[b, q_idx], from_noisy, from_clean) & (q.doc[b, q_idx] == k.doc[b, kv_idx])

    return mask_mod


def cached_mask_mod(q_pos: Tensor, block_size: int) -> MaskMod:
    """The SDAR rule for queries over a KV cache indexed by position, as decoding fills it: every slot below a row's
    current block holds a clean token, and its slots from that block on hold the block's noisy tokens (or stale
    ones of later blocks). Over such a cache a query at position p, clean (a finished block) or noisy (the current
    block), sees exactly the slots below its block's end, (p // block_size + 1) * block_size: one comparison a
    score, where `block_diffusion_mask_mod` of the same layouts loads and divides six indices (flex evaluates it
    for every score it computes)."""
    block_end = (q_pos // block_size + 1) * block_size

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return kv_idx < block_end[b, q_idx]

    return mask_mod


def dense_mask(mask_mod: MaskMod, batch: int, q_len: int, kv_len: int, device: torch.device) -> Tensor:
    """Evaluate a mask_mod on every (query, key) pair at once: a bool [B, 1, Q, K] tensor for SDPA."""
    b = torch.arange(batch, device=device)[:, None, None]
    q_idx = torch.arange(q_len, device=device)[None, :, None]
    kv_idx = torch.arange(kv_len, device=device)[None, None, :]
    return mask_mod(b, torch.zeros((), dtype=torch.long, device=device), q_idx, kv_idx)[:, None]


# torch._dynamo compiles a function once per shape (and grad mode), up to its recompile limit (default 8); past
# it the function silently runs eager, and eager flex materialises every score (B x H x Q x K). The RL update meets
# more: (rows: a power of two) x (length: a multiple of 1,024) x (no-grad old policy, grad policy). Raised when
# compiled flex is first made, before any forward: that covers create_block_mask's compiles too.
FLEX_RECOMPILE_LIMIT = 64


def allow_flex_recompiles() -> None:
    """Raise torch._dynamo's recompile limit (process-wide) to `FLEX_RECOMPILE_LIMIT`, never lower it."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, FLEX_RECOMPILE_LIMIT)


def flex_block_mask(mask_mod: MaskMod, batch: int, q_len: int, kv_len: int, device: torch.device) -> BlockMask:
    """FlexAttention's block-sparse view of a mask_mod. On CUDA the mask_mod is compiled and evaluated tile by
    tile, so no Q x K tensor is ever materialised; on CPU (tests) it is evaluated eagerly."""
    return create_block_mask(mask_mod, batch, None, q_len, kv_len, device=device, _compile=device.type == "cuda")


# flex's tile of key slots (its default sparse block size); the decoding mask lists key blocks of this many slots.
FLEX_BLOCK = 128


def cached_block_mask(mask_mod: MaskMod, batch: int, q_len: int, kv_len: int | Tensor, slots: int,
                      device: torch.device, skip: Tensor | None = None) -> BlockMask:
    """A flex `BlockMask` for `q_len` cached queries attending over the whole cache, slots [0, `slots`), of which only
    [0, kv_len) may be visible (`kv_len`: one bound, or one per row): the key blocks below kv_len are listed (as
    partial blocks: `mask_mod` decides within them), the later ones skipped without being read; so are the key
    blocks wholly below `skip` [batch], a row's slots another attention reads (`SharedPrefix`). The key length is
    the cache's for every kv_len, so one compile of the attention serves every span. Built from tensors only (no
    compile, no host sync): capturable in a CUDA graph. `mask_mod` must hide every slot at or past kv_len (and
    below skip) itself too: eager flex (CPU) ignores the block list."""
    blocks = -(-slots // FLEX_BLOCK)
    first = (torch.zeros(batch, dtype=torch.int32, device=device) if skip is None
             else (skip // FLEX_BLOCK).to(torch.int32))
    listed = (-(-kv_len // FLEX_BLOCK) - first).to(torch.int32)[:, None, None]
    order = (torch.arange(blocks, dtype=torch.int32, device=device) + first[:, None]).clamp(max=blocks - 1)
    return BlockMask.from_kv_blocks(listed, order[:, None, None], BLOCK_SIZE=FLEX_BLOCK, mask_mod=mask_mod,
                                    seq_lengths=(q_len, slots), compute_q_blocks=False)


def hide_before(mask_mod: MaskMod, first: Tensor) -> MaskMod:
    """`mask_mod` with each row's slots below `first` [B] hidden as well."""

    def hidden_before(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return mask_mod(b, h, q_idx, kv_idx) & (kv_idx >= first[b])

    return hidden_before


def prefix_block_mask(lengths: Tensor, q_len: int, slots: int) -> BlockMask:
    """Every query of run r sees slots [0, lengths[r]) of its prefix copy, which holds `slots` slots."""

    def within_prefix(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return kv_idx < lengths[b]

    return cached_block_mask(within_prefix, lengths.shape[0], q_len, lengths, slots, lengths.device)


class KVCache:
    """Keys and values of every layer, indexed by slot. The sampler uses slot = absolute position, plus a few
    scratch slots past the end for padding queries whose K/V must go nowhere."""

    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, slots: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        # Zeros, not empty: slots never written may still fall inside the attended range (masked out), and
        # 0 * NaN from uninitialised memory would poison the softmax-weighted sum.
        shape = (num_layers, batch, num_kv_heads, slots, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def row(self, row: int) -> KVCache:
        """Batch row `row`'s cache as a batch of one: a view, so writes land in this cache."""
        view = object.__new__(KVCache)
        view.k, view.v = self.k[:, row: row + 1], self.v[:, row: row + 1]
        return view

    def span(self, needed: int) -> int:
        """How many slots to attend over to cover [0, needed): rounded up to a multiple of 16, which SDPA's
        memory-efficient kernel wants for its mask (else it pads a copy every call), capped at capacity. The extra
        slots lie in later blocks, which the mask hides."""
        return min(-(-needed // 16) * 16, self.k.shape[3])

    def write_and_read(self, layer: int, k: Tensor, v: Tensor, slots: Tensor, kv_len: int) -> tuple[Tensor, Tensor]:
        """Store this forward's k/v [B, Hkv, Q, D] at `slots` [B, Q]; return the keys/values of slots [0, kv_len)."""
        index = slots[:, None, :, None].expand_as(k)
        self.k[layer].scatter_(2, index, k)
        self.v[layer].scatter_(2, index, v)
        return self.k[layer, :, :, :kv_len], self.v[layer, :, :, :kv_len]


@dataclass(frozen=True)
class SharedPrefix:
    """Rows that decode one prompt (an RL rollout group) see the same K/V in their first slots: `cache` holds those
    slots once per G consecutive rows (its batch: B / G), and `mask` (`prefix_block_mask`) lets those rows' G x Q
    queries see the prompt's part of them. The batch's own cache lists none of those slots (`cached_block_mask`'s
    skip), so a forward reads the prompt once per G rows instead of once per row."""

    cache: KVCache
    mask: BlockMask


@dataclass
class Attention:
    """How the tokens of one forward attend.

    mask:   a flex `BlockMask` (with a cache: a `cached_block_mask`), or a dense bool [B, 1, Q, K] (SDPA path);
    cache:  if given, each layer writes its K/V to `slots` [B, Q] and attends over cache slots [0, kv_len),
            so K is the cache, not the forward's own tokens;
    prefix: if given (with a flex mask over the cache), the cache's first slots are read from it instead.
    """

    mask: BlockMask | Tensor
    cache: KVCache | None = None
    slots: Tensor | None = None
    kv_len: int = 0
    prefix: SharedPrefix | None = None


# Up to this many queries per kv head (GQA-folded), a cached forward attends with two batched matmuls instead of
# SDPA: decoding sends 4-32, and SDPA's fused kernels (cuDNN on Hopper) tile queries by 64 or more and read the
# boolean mask in every layer. Module-level so a benchmark can set it to 0 to compare.
SMALL_QUERY = 64


def fold_gqa_mask(mask: Tensor, groups: int, kv_heads: int | None = None, dtype: torch.dtype | None = None) -> Tensor:
    """Once per forward: repeat a bool [B, 1, Q, K] mask along the query axis to match `attend`'s GQA folding.
    With `kv_heads` and `dtype` (a cached forward with few queries) return instead the additive bias of `attend`'s
    matmul path: 0 where visible, -inf elsewhere, [B * kv_heads, groups * Q, K]."""
    folded = mask.repeat(1, 1, groups, 1) if groups > 1 else mask
    if kv_heads is None or dtype is None or folded.shape[2] > SMALL_QUERY:
        return folded
    bias = torch.zeros((folded.shape[0], kv_heads, *folded.shape[2:]), dtype=dtype, device=mask.device)
    return bias.masked_fill_(~folded, float("-inf")).flatten(0, 1)


@functools.cache
def _compiled_flex() -> Callable:
    allow_flex_recompiles()
    return torch.compile(flex_attention, dynamic=False)


def _flex_gqa(q: Tensor, k: Tensor, v: Tensor, block_mask: BlockMask,
              kernel_options: dict[str, int] | None = None) -> Tensor:
    return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True, kernel_options=kernel_options)


# How compiled decoding's flex kernels get their tile. Not autotuned (max_autotune): at the RL rollouts' shape inductor's
# autotuning died with an illegal memory access (or found no valid choice) in most fresh processes on H100s. A fixed
# tile instead (flex's kernel_options), the one autotuning chose at SDAR-4B's decode shape: against inductor's default
# tile it decoded 1.17x faster at the rollouts' shape and 1.14x at the 4B shape, and ran clean at both (H100,
# docs/bench.md). Module-level, set by `configure_flex_decoding` before the first compile, so a benchmark can compare.
DEFAULT_FLEX_DECODING_TILE = "32,3,2"  # BLOCK_N, num_stages, num_warps
FLEX_DECODING_AUTOTUNE = False
FLEX_DECODING_TILE: dict[str, int] | None = None  # set below from DEFAULT_FLEX_DECODING_TILE


def configure_flex_decoding(tile: str = DEFAULT_FLEX_DECODING_TILE) -> None:
    """Choose how compiled decoding's flex kernels get their tile: a fixed "BLOCK_N,num_stages,num_warps" (the
    default, "32,3,2"), "inductor" (inductor's own default tile) or "auto" (autotuned when first compiled). Call
    before the process's first compiled decode."""
    global FLEX_DECODING_AUTOTUNE, FLEX_DECODING_TILE
    FLEX_DECODING_AUTOTUNE, FLEX_DECODING_TILE = tile == "auto", None
    if tile not in ("inductor", "auto"):
        try:
            block_n, stages, warps = (int(x) for x in tile.split(","))
        except ValueError:
            raise ValueError(f"flex-decoding tile {tile!r}: expected inductor, auto or BLOCK_N,num_stages,num_warps "
                             f"(e.g. {DEFAULT_FLEX_DECODING_TILE})") from None
        FLEX_DECODING_TILE = {"BLOCK_N": block_n, "num_stages": stages, "num_warps": warps}


configure_flex_decoding()


@functools.cache
def _compiled_small_query_flex() -> Callable:
    """Flex for a few queries over a KV cache (`cached_block_mask`): inductor lowers it to its flex-decoding kernel,
    which packs the query heads of a kv head into one tile, so one kernel reads each key and value once and applies
    scale, mask and softmax on the way (instead of the matmul path's GEMM, softmax, GEMM and a dense bias a forward).
    With FLEX_DECODING_AUTOTUNE, max_autotune times its few tile configs at compile time; the tile is a call argument
    (FLEX_DECODING_TILE), so the compile follows it.
    Its own code object, so its compiles (one per query count, batch and cache length) have their own torch._dynamo
    recompile limit rather than sharing training's."""
    return torch.compile(_flex_gqa, dynamic=False, fullgraph=True, options={"max_autotune": FLEX_DECODING_AUTOTUNE})


def _prefix_then_rest(q: Tensor, k: Tensor, v: Tensor, mask: BlockMask, prefix_k: Tensor, prefix_v: Tensor,
                      prefix_mask: BlockMask, kernel_options: dict[str, int] | None = None) -> Tensor:
    """Attention over a shared prefix and over each row's own slots, merged by their log-sum-exps: the softmax over
    both sets of keys at once. A run's rows send their queries as one row of group x Q queries over its prefix."""
    batch, heads, queries, dim = q.shape
    runs = prefix_k.shape[0]
    grouped = q.reshape(runs, batch // runs, heads, queries, dim).transpose(1, 2).reshape(runs, heads, -1, dim)
    lse = AuxRequest(lse=True)
    out_p, aux_p = flex_attention(grouped, prefix_k, prefix_v, block_mask=prefix_mask, enable_gqa=True, return_aux=lse,
                                  kernel_options=kernel_options)
    out_r, aux_r = flex_attention(q, k, v, block_mask=mask, enable_gqa=True, return_aux=lse,
                                  kernel_options=kernel_options)
    out_p = out_p.reshape(runs, heads, -1, queries, dim).transpose(1, 2).reshape(batch, heads, queries, dim)
    lse_p = aux_p.lse.reshape(runs, heads, -1, queries).transpose(1, 2).reshape(batch, heads, queries)
    both = torch.logaddexp(lse_p, aux_r.lse)
    merged = out_p.float() * (lse_p - both).exp()[..., None] + out_r.float() * (aux_r.lse - both).exp()[..., None]
    return merged.to(q.dtype)


@functools.cache
def _compiled_prefix_then_rest() -> Callable:
    """`_prefix_then_rest` through torch.compile, as `_compiled_small_query_flex`: two flex-decoding kernels and the
    merge fused into one element-wise pass."""
    return torch.compile(_prefix_then_rest, dynamic=False, fullgraph=True,
                         options={"max_autotune": FLEX_DECODING_AUTOTUNE})


def attend_with_prefix(q: Tensor, k: Tensor, v: Tensor, mask: BlockMask, prefix: SharedPrefix, layer: int) -> Tensor:
    """`attend` over a KV cache whose first slots are read from `prefix` (layer `layer` of its cache)."""
    if not q.is_cuda:
        return _prefix_then_rest(q, k, v, mask, prefix.cache.k[layer], prefix.cache.v[layer], prefix.mask)
    return _compiled_prefix_then_rest()(q, k, v, mask, prefix.cache.k[layer], prefix.cache.v[layer], prefix.mask,
                                        FLEX_DECODING_TILE)


def attend(q: Tensor, k: Tensor, v: Tensor, mask: BlockMask | Tensor, cached: bool = False) -> Tensor:
    """Attention of q [B, Hq, Q, D] over k, v [B, Hkv, K, D]; a dense `mask` comes from `fold_gqa_mask`: a bool
    mask for SDPA, or a float bias for the matmul path. `cached`: k and v are a KV cache (a `cached_block_mask`)."""
    if isinstance(mask, BlockMask):
        # Eager flex runs on CPU (forward only) by materialising scores; on CUDA it must be compiled to be fused.
        if not q.is_cuda:
            return _flex_gqa(q, k, v, mask)
        if cached:
            return _compiled_small_query_flex()(q, k, v, mask, FLEX_DECODING_TILE)
        return _compiled_flex()(q, k, v, block_mask=mask, enable_gqa=True)
    # GQA without copying K/V: the G query heads that share a kv head become G x Q queries of that head.
    # Works with every SDPA backend (enable_gqa does not) and suits decoding, where Q is tiny.
    batch, q_heads, q_len, head_dim = q.shape
    kv_heads = k.shape[1]
    q = q.reshape(batch, kv_heads, -1, head_dim)
    if mask.dtype == torch.bool:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    else:
        # scale, bias and q.k in one GEMM (bf16 scores, as transformers' eager attention), softmax accumulated
        # in fp32, then the values: three kernels reading K and V once. K/V are cache slices: flatten is a view.
        scores = torch.baddbmm(mask, q.flatten(0, 1), k.flatten(0, 1).transpose(1, 2), alpha=head_dim**-0.5)
        out = torch.bmm(scores.softmax(-1), v.flatten(0, 1))
    return out.reshape(batch, q_heads, q_len, head_dim)
