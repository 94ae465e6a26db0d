"""Batched block-diffusion decoding on token ids: per row, blocks of `block_size` positions on one grid from
absolute position 0, each denoised in up to `steps` forwards against a KV cache. Returns the generated ids and,
per token, the denoising step that unmasked it (the trajectory RL replays). On CUDA each decode forward is replayed
as a CUDA graph: a forward's few milliseconds of GPU work otherwise wait on ~25 ms of Python launching kernels.
The graphs, with the state, cache and stop-id tensors they read, are kept per model for the next call of the same
shape (`release_graphs` frees them). `SamplingConfig.compile` also fuses each layer's element-wise work with
torch.compile (`model.transformer.compiled_ops`), attends through compiled flex over the KV cache in place
(`model.attention.cached_block_mask`) and proposes tokens in fused reductions (greedy, or sampled without top-k /
top-p), before the graphs capture it; rows that decode one prompt (an RL rollout group) read its K/V from one copy
(`model.attention.SharedPrefix`)."""

from __future__ import annotations

import dataclasses
import functools
import gc
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from dice_kernels.config_io import ConfigError
from dice_kernels.model.attention import (FLEX_BLOCK, Attention, KVCache, Layout, SharedPrefix,
                                          block_diffusion_mask_mod, cached_block_mask, cached_mask_mod, dense_mask,
                                          hide_before, prefix_block_mask)
from dice_kernels.model.config import ModelConfig
from dice_kernels.model.transformer import EAGER_OPS, BlockDiffusionLM, compiled_ops
from dice_kernels.sampling.strategies import STRATEGIES, choose_unmask, exponentials, sample_tokens, transfer_count

# A CUDA graph fixes every shape, so forwards attend over a span of cache slots rounded up to a multiple of this
# (the mask hides the extra ones): one graph per (commit or not, span), ~80 captures per 4,096 tokens. The
# rounding costs at most 127 slots of attention reads, well under 1 ms a forward for SDAR-4B at batch 128.
# Sequence buffers are rounded up to it too, so calls with somewhat different prompt lengths reuse the graphs.
SPAN_STEP = 128

# Rows that share one copy of their prompt's K/V send their queries (x the query heads of a kv head) to one tile of
# inductor's flex-decoding kernel, at most this many: at 128 (8 rows of a committing forward at SDAR's GQA ratio) its
# autotuned kernel took 1.8 ms a layer on an H100 against 0.04 ms at 64, and decoding ran 1.7x slower than unshared.
SHARED_QUERY_TILE = 64


@dataclass(frozen=True)
class SamplingConfig:
    max_new_tokens: int = 4096
    block_size: int | None = None  # None: the model's (SDAR: 4)
    steps: int = 4  # denoising forwards per block, at most; block_size / steps tokens per forward at least
    strategy: str = "static"  # static | dynamic | sequential (see strategies.choose_unmask)
    threshold: float = 0.9  # dynamic: unmask everything at least this confident
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    use_cache: bool = True  # False recomputes the whole sequence every forward (a reference for tests)
    seed: int | None = None
    # CUDA with the cache: replay each decode forward as a CUDA graph (one per shape, captured when first needed)
    # instead of launching its ~1,000 kernels from Python; False: eager (CPU always runs eager)
    cuda_graphs: bool = True
    # CUDA: run each layer's two element-wise regions through torch.compile (model.transformer.compiled_ops), and
    # decode forwards' attention through compiled flex over the KV cache in place (attention.cached_block_mask),
    # and proposals as fused reductions (_compiled_greedy_proposals; _compiled_sampled when sampling without top-k /
    # top-p): fewer, fused kernels a forward, for compiles on first use (the prefill's shape, then one dynamic-length
    # compile for the decode shapes; flex and proposals: one per shape); tokens may differ from uncompiled decoding
    # by low-precision rounding. Ignored on CPU.
    compile: bool = False
    # Compiled, with no row taking a second prompt: when the prompts come in runs of one prompt repeated (an RL
    # rollout group), each forward reads a run's prompt K/V once per few rows, not once per row (`prompt_runs`);
    # tokens may differ from unshared decoding by low-precision rounding. On for RL rollouts (`rollout.share_prompts`),
    # where it was measured faster (docs/bench.md); off here, where prompts rarely repeat
    share_prompts: bool = False

    @property
    def greedy(self) -> bool:
        """Each position's token is its most likely one: no random numbers are drawn."""
        return self.temperature == 0 or self.top_k == 1

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.max_new_tokens < 1 or self.steps < 1:
            raise ConfigError("max_new_tokens and steps must be >= 1")


@dataclass
class Decoded:
    tokens: list[list[int]]  # generated ids per row, through the stop token when there is one
    unmask_steps: list[list[int]]  # per generated token: 0-based denoising step within its block
    stopped: list[bool]  # True: ended at a stop token; False: reached max_new_tokens
    forwards: int  # model forwards after the prefill
    # The rest of each row's last block, past the stop token or the max_new_tokens cut: sampled too, and seen by
    # that block's later denoising steps (a trajectory replay needs them), but not part of the response.
    tail_tokens: list[list[int]] = field(default_factory=list)
    tail_steps: list[list[int]] = field(default_factory=list)


@dataclass
class _State:
    """Per-row decoding state; every tensor has the batch as its first dimension."""

    # Updated in place only: captured CUDA graphs read these tensors at fixed addresses.
    seq: Tensor  # [B, T] prompt, then generated ids; mask id where undecided
    unmask_step: Tensor  # [B, T] step that unmasked each position, -1 elsewhere
    prompt_len: Tensor  # [B]
    start: Tensor  # [B] first position of the block being denoised
    step: Tensor  # [B] denoising step within that block
    masked_at_start: Tensor  # [B] masks the block had when it began
    commit: Tensor  # [B] bool: the previous block is final but its K/V are not in the cache yet
    # [B] forwards the row sits out before its first block (`first_block_wait`), so that its blocks end, and commit,
    # in the same forwards as a row whose prompt ends on a block boundary
    wait: Tensor
    done: Tensor  # [B] bool
    # [B] bool: a forward gave the row non-finite logits (a NaN confidence), which no strategy can decode from:
    # argmax and the sampling race would pick an arbitrary token without a word
    nonfinite: Tensor


def row_tokens(longest: int, max_new: int, block: int) -> int:
    """A row's token buffer: room for a prompt of `longest` tokens and `max_new` new ones, in whole spans and blocks.
    Positions past a row's limit stay masked and unread; the rounding only makes shapes recur across calls."""
    total = -(-(longest + max_new) // SPAN_STEP) * SPAN_STEP
    return -(-total // block) * block


def flex_blocks(slots: int) -> int:
    """`slots` rounded up to whole flex blocks: inductor's flex-decoding kernel failed every autotuned config (illegal
    memory access) over a 1,284-slot cache on an H100, the rollouts of 16 KernelBench prompts with 256 new tokens."""
    return -(-slots // FLEX_BLOCK) * FLEX_BLOCK


def cache_slots(row_len: int, block: int) -> int:
    """KV-cache slots of a row of `row_len` tokens: those, and a scratch block where padding queries write."""
    return flex_blocks(row_len + block)


def _initial_state(prompts: list[list[int]], block: int, steps: int, max_new: int, mask_id: int,
                   device: torch.device, longest: int) -> _State:
    """The rows' state for `prompts`, with room for a prompt of `longest` tokens (a later one may take a row)."""
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    total = row_tokens(longest, max_new, block)
    seq = torch.full((len(prompts), total), mask_id, dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        seq[row, : len(prompt)] = torch.tensor(prompt, device=device)
    start, masked = first_block(lengths, block)
    zeros = torch.zeros_like(lengths)
    return _State(seq=seq, unmask_step=torch.full_like(seq, -1), prompt_len=lengths, start=start, step=zeros,
                  masked_at_start=masked, commit=zeros.bool(), wait=first_block_wait(masked, block, steps),
                  done=zeros.bool(), nonfinite=zeros.bool())


def first_block(length: int | Tensor, block: int) -> tuple[int | Tensor, int | Tensor]:
    """(start, masks) of the first decode block of a prompt of `length` tokens (an int or a tensor of them): the
    prompt is prefilled up to its last whole block; its remainder opens the first decode block unmasked."""
    start = length // block * block
    return start, start + block - length


def first_block_wait(masks: int | Tensor, block: int, steps: int) -> int | Tensor:
    """Forwards a row whose first decode block has `masks` masks sits out before it: a block takes one forward per
    step that has a token to unmask (at one token a step, fewer for a block the prompt partly fills), and a
    forward in which any row commits a block runs twice the queries for every row. Rows that end their blocks in
    the same forwards share those committing forwards: with static unmasking every later block takes `steps`
    forwards, so a batch stays in step and one forward in `steps` commits, where prompts of mixed lengths left it
    committing in nearly every forward (docs/model.md). Outputs are unchanged: a row computes nothing while it
    waits."""
    full = min(block, steps)
    return full - (masks.clamp(max=steps) if isinstance(masks, Tensor) else min(masks, steps))


def _refill_row(state: _State, row: int, prompt: list[int], block: int, steps: int, mask_id: int) -> int:
    """Give `row` a new prompt, in place (graphs read the state's tensors at fixed addresses), as `_initial_state`
    would have; returns its first decode block's position, the prompt's slots to prefill."""
    start, masked = first_block(len(prompt), block)
    state.seq[row].fill_(mask_id)
    state.seq[row, : len(prompt)] = torch.tensor(prompt, device=state.seq.device)
    state.unmask_step[row].fill_(-1)
    for field_, value in ((state.prompt_len, len(prompt)), (state.start, start), (state.step, 0),
                          (state.masked_at_start, masked), (state.commit, False),
                          (state.wait, first_block_wait(masked, block, steps)), (state.done, False)):
        field_[row] = value
    return start


class _CachedForward:
    """Logits of each row's current block from a KV cache: one prefill, then block-sized forwards, each followed by
    the denoising step: `propose` tokens from the logits, `advance` the state with them. On CUDA a forward (and, when
    `propose` draws no random numbers, its denoising step too) is replayed from a CUDA graph captured the first time
    its shape comes up.

    Committing a finished block costs no extra forward. Its K/V must come from its *final* tokens, and the last
    denoising forward saw some of them still masked; so the finished block rides along as clean queries in the
    first forward of the next block: written to its slots, seen block-causally by itself and by the new block.
    """

    # Set by each decode call; graphs captured in an earlier call replay the greedy steps they recorded, which read
    # the kept state and stop ids.
    propose: Callable[[Tensor], tuple[Tensor, Tensor]]
    advance: Callable[[Tensor, Tensor], None]

    def __init__(self, model: BlockDiffusionLM, state: _State, block: int, graphs: bool, graph_denoise: bool,
                 compiled: bool, run: int = 1, prompt_slots: int = 0):
        cfg, seq = model.config, state.seq
        # compiled: the layers run compiled regions, and decode forwards attend through flex (`_forward`)
        self.model, self.block, self.graph_denoise, self.compiled = model, block, graph_denoise, compiled
        self.scratch = seq.shape[1]  # slots [T, T + block): where padding queries write
        # (any_commit, span) -> graph; None: eager. Every graph draws its temporaries from one memory pool, and
        # those that leave a sampled step to the host write their logits to one buffer: they run one at a time, and
        # each forward's logits are used up before the next forward.
        self.graphs: dict[tuple[bool, int], torch.cuda.CUDAGraph] | None = {} if graphs and seq.is_cuda else None
        self.pool, self.logits, self.warmed = None, None, False
        slots = cache_slots(seq.shape[1], block)
        dtype = next(model.parameters()).dtype
        self.cache = KVCache(cfg.num_hidden_layers, seq.shape[0], cfg.num_key_value_heads, slots, cfg.head_dim,
                             dtype, seq.device)
        # run > 1 (compiled only): runs of `run` rows decode one prompt, whose slots before the first decode block live
        # here (room for `prompt_slots`, whole flex blocks) once per `self.run` rows, not in the rows' cache
        self.run = rows_per_prompt_copy(run, committing_queries_per_kv_head(cfg, block))
        self.prompts = None
        if self.run > 1:
            prompt_slots = flex_blocks(prompt_slots)
            self.prompts = KVCache(cfg.num_hidden_layers, seq.shape[0] // self.run, cfg.num_key_value_heads, prompt_slots,
                                   cfg.head_dim, dtype, seq.device)

    def prefill(self, state: _State) -> None:
        """Write the K/V of every row's prompt up to the furthest row's first decode block."""
        prefill = int(state.start.max())
        if prefill:
            # Rows with shorter prompts prefill tokens past their own start too: those slots lie in blocks
            # their current block cannot see, and are overwritten before they become visible.
            if self.prompts is not None:  # once per run: its rows' prompts are the same
                self._write_clean(state.seq[:: self.run, :prefill], self.prompts)
            else:
                self._write_clean(state.seq[:, :prefill], self.cache)

    def prefill_row(self, state: _State, row: int, length: int) -> None:
        """Write the K/V of `row`'s new prompt up to its first decode block (`length` slots) into that row's cache.
        Its slots past that hold the previous response's K/V: later blocks, hidden until its own overwrite them.
        Eager layer ops: a compiled region would compile once per prompt length."""
        assert self.prompts is None, "rows that share a prompt never take another"
        if length:
            with self.model.using_layer_ops(EAGER_OPS):
                self._write_clean(state.seq[row: row + 1, :length], self.cache.row(row))

    def _write_clean(self, ids: Tensor, cache: KVCache) -> None:
        """One forward of clean tokens `ids` [B, L] at positions 0..L-1, writing their K/V to `cache` slots 0..L-1."""
        length = ids.shape[1]
        pos = torch.arange(length, device=ids.device).expand_as(ids)
        layout = Layout.clean(pos)
        mask = dense_mask(block_diffusion_mask_mod(layout, layout, self.block), *ids.shape, length, ids.device)
        self.model.hidden_states(ids, pos, Attention(mask, cache, pos, length))

    def __call__(self, state: _State, any_commit: bool, kv_len: int) -> None:
        """One decoding step: the forward, then `denoise`; `kv_len`: cache slots the furthest row needs."""
        # eager forwards use the graphs' spans too: the same shapes give the same kernels, hence the same tokens
        span = min(-(-kv_len // SPAN_STEP) * SPAN_STEP, self.cache.k.shape[3])
        if self.graphs is None:
            self.advance(*self.propose(self._forward(state, any_commit, span)))
            return
        key = (any_commit, span)
        if key not in self.graphs:
            self.graphs[key] = self._capture(state, any_commit, span)
        self.graphs[key].replay()
        if not self.graph_denoise:
            self.advance(*self.propose(self.logits))

    def _capture(self, state: _State, any_commit: bool, span: int) -> torch.cuda.CUDAGraph:
        """Record one forward of this shape. Inputs are the state's tensors and the cache, read at replay time."""
        if not self.warmed or self.compiled:
            # Lazy initialisation (cuBLAS handles and workspaces; compiling and autotuning a shape torch.compile
            # has not seen) cannot happen inside a capture: run the forward (and a greedy proposal, which changes
            # no state) once first, on a side stream as capture does. It only rewrites the current blocks' cache
            # slots.
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                logits = self._forward(state, any_commit, span)
                if self.graph_denoise:
                    self.propose(logits)
            if not self.graph_denoise and self.logits is None:  # one buffer for every graph's logits
                self.logits = torch.empty_like(logits)
            torch.cuda.current_stream().wait_stream(side)
            self.warmed = True
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._forward(state, any_commit, span)
            if self.graph_denoise:  # its ~40 small kernels otherwise cost a few ms of launches per forward
                self.advance(*self.propose(logits))
            else:
                self.logits.copy_(logits)
        self.pool = self.pool or graph.pool()
        return graph

    def _forward(self, state: _State, any_commit: bool, kv_len: int) -> Tensor:
        block, offsets = self.block, torch.arange(self.block, device=state.seq.device)
        cur = state.start[:, None] + offsets
        q_pos, q_slots = cur, cur
        if any_commit:
            # Rows committing send the finished block as clean queries; the others send a copy of their current
            # block as padding, whose K/V go to scratch slots.
            commit = state.commit[:, None]
            first_pos = torch.where(commit, cur - block, cur)
            q_pos = torch.cat([first_pos, cur], 1)
            q_slots = torch.cat([torch.where(commit, cur - block, self.scratch + offsets), cur], 1)
        # Compiled, attention reads the whole cache (flex skips the key blocks past kv_len unread), so its shapes are
        # the same for every span and one compile serves them all; eager, the dense mask covers the span only.
        slots = self.cache.k.shape[3] if self.compiled else kv_len
        # Cache slot = position: slots below a row's current block hold clean tokens (a committing row's finished
        # block among them, written by this forward), the current block's its noisy ones, later slots stale data
        # and scratch, which the rule hides.
        mask_mod = cached_mask_mod(q_pos, block)
        prefix = None
        if self.prompts is not None:
            # a row's slots before its first decode block hold its run's prompt: read from the run's copy
            shared = first_block(state.prompt_len, block)[0]
            mask_mod = hide_before(mask_mod, shared)
            prefix = SharedPrefix(self.prompts, prefix_block_mask(shared[:: self.run], self.run * q_pos.shape[1],
                                                                  self.prompts.k.shape[3]))
        if self.compiled:
            skip = None if prefix is None else shared
            mask = cached_block_mask(mask_mod, *q_pos.shape, kv_len, slots, cur.device, skip=skip)
        else:
            mask = dense_mask(mask_mod, *q_pos.shape, kv_len, cur.device)
        ids = state.seq.gather(1, q_pos)
        return self.model(ids, q_pos, Attention(mask, self.cache, q_slots, slots, prefix=prefix),
                          keep=slice(-block, None))


def _uncached_forward(model: BlockDiffusionLM, state: _State, block: int, kv_len: int) -> Tensor:
    """The same logits without a cache: the whole sequence up to the furthest current block, every forward."""
    pos = torch.arange(kv_len, device=state.seq.device).expand(state.seq.shape[0], -1)
    start = state.start[:, None]
    layout = Layout(doc=torch.zeros_like(pos), pos=pos, noisy=(pos >= start) & (pos < start + block))
    mask = dense_mask(block_diffusion_mask_mod(layout, layout, block), *pos.shape, kv_len, pos.device)
    hidden = model.hidden_states(state.seq[:, :kv_len], pos, Attention(mask))
    cur = start + torch.arange(block, device=pos.device)
    return model.lm_head(hidden.gather(1, cur[..., None].expand(-1, -1, hidden.shape[-1])))


def _proposals(logits: Tensor, *, mask_id: int, temperature: float, top_k: int, top_p: float,
               generator: torch.Generator | None, draws: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Each position's token and its confidence from the block's logits [B, block, V], computed in fp32; the mask
    token is never a prediction. Sampled from `draws` when given (`sample_tokens`)."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    logits[..., mask_id] = float("-inf")
    return sample_tokens(logits, temperature, top_k, top_p, generator, draws)


def _greedy_by_logsumexp(logits: Tensor, mask_id: int) -> tuple[Tensor, Tensor]:
    """Greedy `_proposals` as two reductions of the logits, for compiling: the most likely token, and its
    probability exp(max - logsumexp) rather than the max of the softmax (equal up to rounding). Compiled, it took
    155 us against the compiled softmax's 240 at batch 128 x block 4 x SDAR's 151,936 logits (1x H100, the same
    tokens)."""
    logits = logits.float()
    logits[..., mask_id] = float("-inf")
    best, tokens = logits.max(-1)
    return tokens, (best - torch.logsumexp(logits, -1)).exp()


@functools.cache
def _compiled_greedy_proposals() -> Callable[..., tuple[Tensor, Tensor]]:
    """Greedy proposals through torch.compile (`_greedy_by_logsumexp`): reductions over the bf16 logits instead of
    eager's fp32 copy, probabilities and max (~0.7 ms of a 12 ms forward at batch 128, for a 150k vocabulary). One
    compile per logits shape."""
    return torch.compile(_greedy_by_logsumexp, dynamic=False, fullgraph=True)


@functools.cache
def _compiled_sampled() -> Callable[..., tuple[Tensor, Tensor]]:
    """`_proposals` through torch.compile, for sampling from given draws: fused passes over the bf16 logits and the
    draws, where eager writes and rereads fp32 copies, scaled logits and probabilities (~10 passes over 300 MB at
    batch 128). One compile per logits shape and temperature."""
    return torch.compile(_proposals, dynamic=False, fullgraph=True)


def _compiled_sampled_proposals(logits: Tensor, *, mask_id: int, temperature: float,
                                generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    draws = exponentials(logits.shape, generator, logits.device)  # eager: the random stream of uncompiled sampling
    return _compiled_sampled()(logits, mask_id=mask_id, temperature=temperature, top_k=0, top_p=1.0, generator=None,
                               draws=draws)


def _proposer(cfg: SamplingConfig, mask_id: int, generator: torch.Generator | None,
              compiled: bool) -> Callable[[Tensor], tuple[Tensor, Tensor]]:
    """`_proposals` for these settings; compiled when decoding compiles, greedy or sampled without filters."""
    if compiled and cfg.greedy:
        return functools.partial(_compiled_greedy_proposals(), mask_id=mask_id)
    if compiled and cfg.top_k == 0 and cfg.top_p == 1.0:
        return functools.partial(_compiled_sampled_proposals, mask_id=mask_id, temperature=cfg.temperature,
                                 generator=generator)
    return functools.partial(_proposals, mask_id=mask_id, temperature=cfg.temperature, top_k=cfg.top_k,
                             top_p=cfg.top_p, generator=generator)


def _denoise_step(state: _State, tokens: Tensor, confidence: Tensor, *, cfg: SamplingConfig, block: int,
                  mask_id: int, stop_ids: Tensor) -> None:
    """Unmask some positions of each row's block with their proposed `tokens` (by `confidence`), and move rows whose
    block is final to the next one."""
    state.nonfinite |= confidence.isnan().any(-1)
    cur = state.start[:, None] + torch.arange(block, device=tokens.device)
    tokens_now = state.seq.gather(1, cur)
    masked = tokens_now == mask_id
    count = transfer_count(state.masked_at_start, state.step, cfg.steps)
    waiting = state.wait > 0
    chosen = choose_unmask(confidence, masked, count, cfg.strategy, cfg.threshold) & ~(state.done | waiting)[:, None]
    state.seq.scatter_(1, cur, torch.where(chosen, tokens, tokens_now))
    steps_now = state.unmask_step.gather(1, cur)
    state.unmask_step.scatter_(1, cur, torch.where(chosen, state.step[:, None], steps_now))
    state.step += ~waiting
    state.wait -= waiting.long()

    finished = ~(masked & ~chosen).any(-1) & ~state.done
    generated = cur >= state.prompt_len[:, None]
    # a comparison with every stop id rather than torch.isin, whose sorting path syncs (not allowed in a graph)
    hit_stop = ((state.seq.gather(1, cur)[..., None] == stop_ids).any(-1) & generated).any(-1)
    at_limit = state.start + block >= state.prompt_len + cfg.max_new_tokens
    state.done |= finished & (hit_stop | at_limit)
    advance = finished & ~state.done
    state.commit.copy_(advance)
    state.start += block * advance
    state.step.masked_fill_(advance, 0)
    state.masked_at_start.masked_fill_(advance, block)


def _compiles(cfg: SamplingConfig, device: torch.device) -> bool:
    """Whether this decode runs compiled: `SamplingConfig.compile`, on CUDA only."""
    return cfg.compile and device.type == "cuda"


@dataclass
class _Workspace:
    """What a model's captured graphs read (state, KV cache, stop ids), kept for the next call of the same key."""

    key: tuple
    state: _State
    stops: Tensor
    forward: _CachedForward


# One workspace per model (the latest key): its KV cache is the size of the call's (release_graphs frees it).
_WORKSPACES: weakref.WeakKeyDictionary[BlockDiffusionLM, _Workspace] = weakref.WeakKeyDictionary()


def kept_graphs(model: BlockDiffusionLM) -> dict[tuple[bool, int], torch.cuda.CUDAGraph]:
    """The graphs kept for `model`'s next call, by (some row commits, attended span); empty if none. Replaying one
    reruns a forward (and a greedy denoising step) on the kept state: for profiling, after the call."""
    kept = _WORKSPACES.get(model)
    return dict(kept.forward.graphs or {}) if kept is not None else {}


def release_graphs(model: BlockDiffusionLM) -> None:
    """Free the CUDA graphs, KV cache and buffers `decode` keeps for `model` (e.g. before a training update)."""
    _WORKSPACES.pop(model, None)
    # A torch.compile'd frame that calls flex_attention keeps its inputs in a reference cycle (pytorch issue
    # #195866; torch 2.13 too): compiled decoding's views of the KV cache, each holding the whole cache, outlive
    # their calls until the cycle collector reaches them, which it need not do before the update allocates. The
    # cache of 128 rows of 2,176 slots at SDAR-4B's shape is 38 GiB: about what an RL step's update found taken when
    # it ran out of an H100's memory there.
    gc.collect()


def committing_queries_per_kv_head(cfg: ModelConfig, block: int) -> int:
    """The queries a row sends each kv head in a committing forward: two blocks, times the query heads sharing it
    (GQA-folded, as flex decoding tiles them)."""
    return 2 * block * cfg.num_attention_heads // cfg.num_key_value_heads


def rows_per_prompt_copy(run: int, queries_per_row: int) -> int:
    """How many rows of a run of `run` rows decoding one prompt read one copy of it: the most that divide the run and
    fit `SHARED_QUERY_TILE` with `queries_per_row` (a committing forward's, GQA-folded) each."""
    return max(d for d in range(1, run + 1) if run % d == 0 and (d == 1 or d * queries_per_row <= SHARED_QUERY_TILE))


def prompt_runs(prompts: list[list[int]], block: int) -> int:
    """The length of the runs of one prompt repeated that `prompts` consists of (an RL rollout group's size), when
    every run is that long and every prompt fills a block (its shared slots: those before its first decode block);
    else 1."""
    run = 1
    while run < len(prompts) and prompts[run] == prompts[0]:
        run += 1
    if run == 1 or len(prompts) % run or min(map(len, prompts)) < block:
        return 1
    same = all(prompts[i] == prompts[i - i % run] for i in range(len(prompts)))
    return run if same else 1


def _workspace(model: BlockDiffusionLM, state: _State, stop_ids: list[int], cfg: SamplingConfig,
               block: int, run: int = 1) -> _Workspace:
    """The model's kept workspace when everything its graphs baked in matches (batch and buffer length, the
    settings, the stop ids, the weights' addresses), refilled with this call's state; else a new one, kept when
    graphs are on. Greedy steps draw no random numbers, so they are replayed from the graph with the forward."""
    params = tuple(p.data_ptr() for p in model.parameters())
    key = (tuple(state.seq.shape), dataclasses.replace(cfg, seed=None), tuple(stop_ids), block, run, params)
    kept = _WORKSPACES.get(model)
    if kept is not None and kept.key == key:
        for f in dataclasses.fields(_State):
            getattr(kept.state, f.name).copy_(getattr(state, f.name))
        return kept
    _WORKSPACES.pop(model, None)  # its cache and graphs go before the new ones are allocated
    stops = torch.tensor(stop_ids, dtype=torch.long, device=state.seq.device)
    forward = _CachedForward(model, state, block, cfg.cuda_graphs, graph_denoise=cfg.greedy,
                             compiled=_compiles(cfg, state.seq.device), run=run,
                             prompt_slots=state.seq.shape[1] - cfg.max_new_tokens)
    space = _Workspace(key, state, stops, forward)
    if forward.graphs is not None:
        _WORKSPACES[model] = space
    return space


@torch.inference_mode()
def decode(model: BlockDiffusionLM, prompts: list[list[int]], cfg: SamplingConfig, stop_ids: list[int],
           rows: int | None = None, on_response: Callable[[int, Response], None] | None = None) -> Decoded:
    """Generate after each prompt (token ids, any lengths) until a stop token or `max_new_tokens`. `rows`: decode at
    most this many prompts at once; a row whose response has ended takes the next waiting prompt, so the batch does
    not wait for its longest response. Results come in prompt order either way; `on_response(i, response)` gets
    prompt i's as soon as its row is collected (when the row takes a waiting prompt, else at the end), so a caller
    can keep each one before the call returns."""
    device = next(model.parameters()).device
    block, mask_id = cfg.block_size or model.config.block_size, model.config.mask_token_id
    if mask_id is None:
        raise ValueError("the checkpoint defines no mask token: set mask_token_id in its config.json")
    if not prompts or min(len(p) for p in prompts) == 0:
        raise ValueError("every prompt needs at least one token")
    width = min(rows or len(prompts), len(prompts))
    state = _initial_state(prompts[:width], block, cfg.steps, cfg.max_new_tokens, mask_id, device,
                           max(map(len, prompts)))
    ops = compiled_ops() if _compiles(cfg, device) else model.layer_ops
    with model.using_layer_ops(ops):  # graphs captured now record the compiled kernels
        return _decode(model, state, cfg, stop_ids, block, mask_id, prompts, on_response)


def _decode(model: BlockDiffusionLM, state: _State, cfg: SamplingConfig, stop_ids: list[int], block: int,
            mask_id: int, prompts: list[list[int]], on_response: Callable[[int, Response], None] | None) -> Decoded:
    """The forwards of one `decode` call, with the model's layer ops already chosen; the state holds the first
    prompts, and a row that is done takes the next waiting one."""
    device = state.seq.device
    generator = None if cfg.seed is None else torch.Generator(device).manual_seed(cfg.seed)
    compiled, width = _compiles(cfg, device), state.seq.shape[0]
    cached = None
    if cfg.use_cache:
        # one prompt per row for the whole call (none waiting), compiled: a run of rows can share its prompt's K/V
        shares = cfg.share_prompts and compiled and width == len(prompts)
        space = _workspace(model, state, stop_ids, cfg, block, prompt_runs(prompts, block) if shares else 1)
        state, stops, cached = space.state, space.stops, space.forward
        cached.prefill(state)
    else:
        stops = torch.tensor(stop_ids, dtype=torch.long, device=device)
    propose = _proposer(cfg, mask_id, generator, compiled)
    advance = functools.partial(_denoise_step, state, cfg=cfg, block=block, mask_id=mask_id, stop_ids=stops)
    if cached is not None:
        cached.propose, cached.advance = propose, advance
    rows = _Rows(prompts, holds=list(range(width)), results=[None] * len(prompts), next_prompt=width,
                 stop_set=set(stop_ids), on_response=on_response)
    max_forwards = (state.seq.shape[1] // block + 1) * cfg.steps * -(-len(prompts) // width)
    forwards = 0
    while True:
        # The one host sync per forward: the loop condition and the shapes of the next forward (with prompts
        # waiting, also which rows are done).
        all_done, any_commit, furthest, nonfinite, *done = _loop_flags(state, rows.waiting)
        if nonfinite:
            raise RuntimeError(f"the model gave non-finite logits (NaN or inf) after {forwards} decoding forward(s): "
                               "its weights or activations overflowed or hold NaN (check the checkpoint, and try "
                               "float32 or bfloat16 where float16 was used)")
        if any(done) and rows.refill(state, done, cached, cfg, block, mask_id):
            all_done, any_commit, furthest, _ = _loop_flags(state, False)
        if all_done:
            break
        if forwards == max_forwards:
            raise RuntimeError("block-diffusion decoding did not finish (a block never lost its masks)")
        kv_len = furthest + block
        if cached is not None:
            cached(state, bool(any_commit), kv_len)
        else:
            advance(*propose(_uncached_forward(model, state, block, kv_len)))
        forwards += 1
    return rows.collect(state, cfg.max_new_tokens, block, forwards)


def _loop_flags(state: _State, with_done: bool) -> list[int]:
    """In one host sync: whether every row is done, whether any commits, the furthest row's block start, whether any
    row got non-finite logits and, with `with_done`, each row's done flag."""
    flags = torch.stack([state.done.all(), state.commit.any(), state.start.max(), state.nonfinite.any()])
    return (torch.cat([flags, state.done.long()]) if with_done else flags).tolist()


@dataclass
class Response:
    """One prompt's part of `Decoded`, also handed to `decode`'s `on_response` as soon as that prompt is done."""

    tokens: list[int]
    unmask_steps: list[int]
    stopped: bool
    tail_tokens: list[int]
    tail_steps: list[int]


@dataclass
class _Rows:
    """Which prompt each row decodes, the responses collected so far, and the prompts still waiting for a row."""

    prompts: list[list[int]]
    holds: list[int]
    results: list[Response | None]
    next_prompt: int
    stop_set: set[int]
    on_response: Callable[[int, Response], None] | None = None

    def _done(self, prompt: int, response: Response) -> None:
        self.results[prompt] = response
        if self.on_response is not None:
            self.on_response(prompt, response)

    @property
    def waiting(self) -> bool:
        return self.next_prompt < len(self.prompts)

    def refill(self, state: _State, done: list[int], cached: _CachedForward | None, cfg: SamplingConfig, block: int,
               mask_id: int) -> bool:
        """Collect the responses of rows that are done, and give each the next waiting prompt (prefilled into its
        cache row). Whether any row took a new prompt."""
        refilled = False
        for row, is_done in enumerate(done):
            if not is_done or not self.waiting:
                continue
            self._done(self.holds[row], _response(state.seq[row].tolist(), state.unmask_step[row].tolist(),
                                                  len(self.prompts[self.holds[row]]), self.stop_set, cfg.max_new_tokens,
                                                  block))
            self.holds[row], self.next_prompt, refilled = self.next_prompt, self.next_prompt + 1, True
            length = _refill_row(state, row, self.prompts[self.holds[row]], block, cfg.steps, mask_id)
            if cached is not None:
                cached.prefill_row(state, row, length)
        return refilled

    def collect(self, state: _State, max_new: int, block: int, forwards: int) -> Decoded:
        """Every response in prompt order, once no row is decoding."""
        seq, steps = state.seq.tolist(), state.unmask_step.tolist()
        for row, prompt in enumerate(self.holds):
            self._done(prompt, _response(seq[row], steps[row], len(self.prompts[prompt]), self.stop_set, max_new,
                                         block))
        out = Decoded(tokens=[], unmask_steps=[], stopped=[], forwards=forwards)
        for r in self.results:
            out.tokens.append(r.tokens)
            out.unmask_steps.append(r.unmask_steps)
            out.stopped.append(r.stopped)
            out.tail_tokens.append(r.tail_tokens)
            out.tail_steps.append(r.tail_steps)
        return out


def _response(seq: list[int], steps: list[int], n: int, stop_set: set[int], max_new: int, block: int) -> Response:
    """A row's response from its ids and unmask steps (host lists), its prompt `n` tokens long."""
    ids = seq[n: n + max_new]
    end = next((i + 1 for i, t in enumerate(ids) if t in stop_set), None)
    cut = n + len(ids[:end])
    block_end = -(-cut // block) * block  # that block finished whole: every position in it was unmasked
    return Response(tokens=ids[:end], unmask_steps=steps[n: cut], stopped=end is not None,
                     tail_tokens=seq[cut: block_end], tail_steps=steps[cut: block_end])
