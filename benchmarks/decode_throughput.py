r"""Decoding throughput of the block-diffusion sampler (static, block 4, 1 and 2 tokens per forward), eager and with
CUDA graphs side by side, next to an autoregressive decode of the same model through the same KV cache and
attention code (eager). Random bf16 weights.

    python benchmarks/decode_throughput.py --out decode.json            # SDAR-4B shapes on one GPU
    python benchmarks/decode_throughput.py --smoke --out /tmp/d.json    # tiny shapes on CPU: does it run?
    python benchmarks/decode_throughput.py --batches 128 --per-forward 1 --no-autoregressive --modes graphs \
        --out d.json --profile-replays p.json                           # + GPU time and kernels of one replay
    python benchmarks/decode_throughput.py --batches 128 --per-forward 1 --no-autoregressive --modes graphs \
        --out dc.json --compile                                         # layers' regions and attention compiled
    python benchmarks/decode_throughput.py --model 1.7B --batches 128 --prompt-len 830 --new-tokens 1024 \
        --per-forward 1 --no-autoregressive --modes graphs_unshared,graphs_shared --compile --group 8 \
        --out dr.json                                                   # RL rollouts: a prompt read once per group

Tokens/s = generated tokens / wall time of the whole call (prefill included) after a short warm-up call; TFLOP/s =
the call's matmul FLOPs (`matmul_flops`: prefill, every forward's blocks, committing forwards' finished blocks, the
lm_head) / that time, to set against the GPU's matmul peak. With
graphs two calls are timed: the first captures its graphs (`graphs_first`), the second replays them (`graphs`:
the steady state of `dice bench` and RL rollouts, which decode batch after batch of one shape). The script only
uses `decode`'s public API, so it also times an older checkout (PYTHONPATH) for a before/after in one run
(`--profile-replays` also needs `sampling.decoder.kept_graphs`, from addea08 on; `--compile` needs
`SamplingConfig.compile`). With `--compile` the untimed warm-up call compiles the layers' regions (prefill and
decode shapes), from fcafdae on the cached attention (flex, autotuned) and from 980899b the greedy proposals; the
first timed call compiles only shapes the warm-up did not have, and runs one ungraphed forward before each capture.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

import torch

from dice_kernels.model import SDAR_SHAPES, Attention, BlockDiffusionLM, KVCache, Layout, ModelConfig
from dice_kernels.model.attention import (DEFAULT_FLEX_DECODING_TILE, block_diffusion_mask_mod,
                                         configure_flex_decoding, dense_mask)
from dice_kernels.sampling import SamplingConfig, decode
from dice_kernels.sampling.strategies import sample_tokens
from dice_kernels.train.flops import layer_matmul_params

TARGET_BATCH128_TPS = 3700
TARGET_SPEEDUP_2TPF = 2.0
EAGER_BATCH128_TPS = 4238  # docs/benchmarks/decode-throughput-h200-2026-11-30.md, before CUDA graphs
TARGET_GRAPHS_BATCH128_TPS = 2 * EAGER_BATCH128_TPS


@torch.inference_mode()
def autoregressive_decode(model: BlockDiffusionLM, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy next-token decoding of [B, P] prompts: one token per forward, K/V written as they come."""
    cfg, (batch, length) = model.config, prompts.shape
    device = prompts.device
    cache = KVCache(cfg.num_hidden_layers, batch, cfg.num_key_value_heads, length + new_tokens, cfg.head_dim,
                    next(model.parameters()).dtype, device)

    def step(ids: torch.Tensor, pos: torch.Tensor, needed: int) -> torch.Tensor:
        kv_len = cache.span(needed)
        keys = Layout.clean(torch.arange(kv_len, device=device).expand(batch, -1))
        mask = dense_mask(block_diffusion_mask_mod(Layout.clean(pos), keys, 1), batch, pos.shape[1], kv_len, device)
        logits = model(ids, pos, Attention(mask, cache, pos, kv_len), keep=slice(-1, None))
        return sample_tokens(logits.float(), 0.0, 0, 1.0, None)[0]

    token = step(prompts, torch.arange(length, device=device).expand(batch, -1), length)
    out = [token]
    for i in range(new_tokens - 1):
        token = step(token, torch.full((batch, 1), length + i, device=device), length + i + 1)
        out.append(token)
    return torch.cat(out, dim=1)


def profile_replays(model: BlockDiffusionLM, path: str) -> None:
    """Where a decode forward's GPU time goes: each kept graph's replay time by CUDA events (median of 10), then the
    kernels of one replay of the widest span, plain and committing, summed by name (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    from dice_kernels.sampling.decoder import kept_graphs

    graphs, report = kept_graphs(model), {"replay_ms": {}, "kernels": {}}
    for (commit, span), graph in sorted(graphs.items()):
        times = []
        for _ in range(10):
            began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            began.record()
            graph.replay()
            ended.record()
            ended.synchronize()
            times.append(began.elapsed_time(ended))
        report["replay_ms"][f"{'commit' if commit else 'plain'}_{span}"] = sorted(times)[len(times) // 2]
    widest = max((span for _, span in graphs), default=0)
    for commit in (False, True):
        if (commit, widest) not in graphs:
            continue
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graphs[commit, widest].replay()
            torch.cuda.synchronize()
        rows = sorted(({"name": e.key, "count": e.count, "us": e.device_time_total} for e in prof.key_averages()
                       if e.device_time_total > 0), key=lambda r: -r["us"])
        report["kernels"][f"{'commit' if commit else 'plain'}_{widest}"] = {
            "kernels": sum(r["count"] for r in rows), "us": sum(r["us"] for r in rows), "rows": rows}
        print(f"one {'committing' if commit else 'plain'} replay, span {widest}: {sum(r['count'] for r in rows)} "
              f"kernels, {sum(r['us'] for r in rows) / 1e3:.2f} ms; largest:")
        for r in rows[:12]:
            print(f"  {r['us']:8.0f} us {r['count']:4d}x  {r['name'][:100]}")
    print("replay ms (median of 10):", report["replay_ms"])
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


def matmul_flops(cfg: ModelConfig, rows: int, prefill_rows: int, prompt_len: int, new_tokens: int, block: int,
                 forwards: int) -> float:
    """The matmul FLOPs of one call of this benchmark's shape (every prompt `prompt_len` tokens, no stop token, so
    the rows stay in step): the prefill of each prompt's whole blocks (`prefill_rows` prompts: one per run when a
    run's rows share it), then per forward every row's block through the layers and the lm_head, and in each
    forward that commits (the first of every decode block after the first) the finished block through the layers
    again. Attention's own FLOPs are left out (~3 % here; its cost is reading the KV cache)."""
    prefill = prompt_len // block * block
    committing = -(-(prompt_len + new_tokens) // block) - prefill // block - 1
    per_token, per_logit = 2 * layer_matmul_params(cfg), 2 * cfg.hidden_size * cfg.vocab_size
    return (per_token * (prefill_rows * prefill + rows * block * (forwards + committing))
            + per_logit * rows * block * forwards)


def _timed(fn):
    """(seconds, fn()) with the GPU drained before and after."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    began = time.perf_counter()
    value = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - began, value


def add_flex_tile_option(parser: argparse.ArgumentParser, applies_with: str) -> None:
    """`--flex-tile` (this benchmark's and rl_step.py's): the compiled flex-decoding kernels' tile."""
    parser.add_argument("--flex-tile", default=DEFAULT_FLEX_DECODING_TILE, metavar="TILE",
                        help=f"with {applies_with}: the flex-decoding kernels' tile: BLOCK_N,STAGES,WARPS fixed "
                             "(default %(default)s), inductor (inductor's own default tile) or auto (autotuned at the "
                             "first compile; model.attention.configure_flex_decoding)")


def apply_flex_tile(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Set the parsed `--flex-tile` before anything compiles; a malformed one is the parser's error."""
    try:
        configure_flex_decoding(args.flex_tile)
    except ValueError as e:
        parser.error(str(e))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="where to write the JSON results")
    parser.add_argument("--model", default="4B", choices=sorted(SDAR_SHAPES))
    parser.add_argument("--batches", default="1,32,128")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--per-forward", default="1,2", help="tokens per forward of the block sampler (block 4)")
    parser.add_argument("--autoregressive", action=argparse.BooleanOptionalAction, default=True,
                        help="also time the autoregressive decode")
    parser.add_argument("--modes", default="eager,graphs",
                        help="block-sampler modes to time: eager, graphs, graphs_shared and graphs_unshared (graphs "
                             "with and without SamplingConfig.share_prompts: a run's prompt K/V read once per few rows)")
    parser.add_argument("--group", type=int, default=1,
                        help="each prompt decoded by this many consecutive rows, as an RL rollout group (compiled "
                             "decoding reads a run's prompt K/V once); the batch holds batch / group prompts")
    parser.add_argument("--sdpa-only", action="store_true",
                        help="decode attention through SDPA, as before the matmul path (model.attention.SMALL_QUERY=0)")
    parser.add_argument("--compile", action="store_true",
                        help="fuse each layer's element-wise regions, attention and greedy proposals with "
                             "torch.compile (SamplingConfig.compile, CUDA only); the untimed warm-up call compiles them")
    add_flex_tile_option(parser, "--compile")
    parser.add_argument("--profile-replays", metavar="JSON",
                        help="after timing (GPU, graphs): GPU time of each graph the last batch kept, and "
                             "torch.profiler's kernel table of one replay of the widest span, to this file")
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU, to check the script runs")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    cfg = SDAR_SHAPES[args.model]
    dtype = torch.bfloat16
    if args.smoke:
        cfg = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, mask_token_id=511)
        args.batches, args.prompt_len, args.new_tokens, dtype = "1,4", 16, 16, torch.float32
    import dice_kernels.model.attention as attention
    if args.sdpa_only:
        attention.SMALL_QUERY = 0
    apply_flex_tile(parser, args)
    torch.manual_seed(0)
    with torch.device(device):
        model = BlockDiffusionLM(cfg).to(dtype).eval()
    batches = [int(b) for b in args.batches.split(",")]

    rows = []
    for batch in batches:
        if batch % args.group:
            parser.error(f"--group {args.group} does not divide batch {batch}")
        prompts = torch.randint(0, cfg.mask_token_id, (batch // args.group, args.prompt_len), device=device)
        prompts = prompts.repeat_interleave(args.group, dim=0)
        prompt_lists = prompts.tolist()
        runs = {}
        for per_forward in (int(k) for k in args.per_forward.split(",")):
            for mode in args.modes.split(","):
                # older checkouts lack compile and share_prompts
                sampling = SamplingConfig(max_new_tokens=args.new_tokens, block_size=4, steps=4 // per_forward,
                                          strategy="static", cuda_graphs=mode != "eager",
                                          **({"compile": True} if args.compile else {}),
                                          **({"share_prompts": mode == "graphs_shared"} if "shared" in mode else {}))
                decode(model, prompt_lists, replace(sampling, max_new_tokens=16), [])  # warm-up
                name = f"block4_{per_forward}tok_{mode}"
                if mode != "eager":
                    seconds, out = _timed(lambda: decode(model, prompt_lists, sampling, []))
                    runs[name + "_first"] = (seconds, out.forwards)
                seconds, out = _timed(lambda: decode(model, prompt_lists, sampling, []))
                runs[name] = (seconds, out.forwards)
        if args.autoregressive:
            autoregressive_decode(model, prompts, 16)  # warm-up
            seconds, _ = _timed(lambda: autoregressive_decode(model, prompts, args.new_tokens))
            runs["autoregressive"] = (seconds, args.new_tokens)
        for mode, (seconds, forwards) in runs.items():
            prefill_rows = batch // args.group if mode == "graphs_shared" else batch
            flops = (matmul_flops(cfg, batch, prefill_rows, args.prompt_len, args.new_tokens, 4, forwards)
                     if mode != "autoregressive" else float("nan"))
            rows.append({"batch": batch, "mode": mode, "seconds": seconds, "forwards": forwards,
                         "tokens_per_s": batch * args.new_tokens / seconds, "ms_per_forward": 1e3 * seconds / forwards,
                         "matmul_tflop": flops / 1e12, "matmul_tflops_per_s": flops / seconds / 1e12})
            print(f"measured: batch {batch} {mode} {seconds:.2f} s", flush=True)  # partial results if cut short

    def tps(batch: int, mode: str) -> float:
        return next((r["tokens_per_s"] for r in rows if r["batch"] == batch and r["mode"] == mode), float("nan"))

    speedups = {b: tps(b, "block4_2tok_eager") / tps(b, "autoregressive") for b in batches}
    graph_gain = {b: tps(b, "block4_1tok_graphs") / tps(b, "block4_1tok_eager") for b in batches}
    print(f"model {args.model if not args.smoke else 'smoke'} on {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, "
          f"prompt {args.prompt_len}, new tokens {args.new_tokens}, {dtype}, prompts in runs of {args.group}")
    print(f"{'batch':>5}  {'mode':<26} {'forwards':>8} {'ms/fwd':>8} {'tokens/s':>10} {'matmul TFLOP':>12} "
          f"{'TFLOP/s':>8}")
    for r in rows:
        print(f"{r['batch']:>5}  {r['mode']:<26} {r['forwards']:>8} {r['ms_per_forward']:>8.2f} {r['tokens_per_s']:>10.0f} "
              f"{r['matmul_tflop']:>12.1f} {r['matmul_tflops_per_s']:>8.1f}")
    for b, s in speedups.items():
        print(f"batch {b}: 2 tokens/forward (eager) vs autoregressive: {s:.2f}x (target >= {TARGET_SPEEDUP_2TPF}x); "
              f"1 token/forward, graphs vs eager: {graph_gain[b]:.2f}x")
    targets = {}
    if 128 in batches:
        targets["batch128_1tok_eager_tokens_per_s"] = {"value": tps(128, "block4_1tok_eager"),
                                                       "target": TARGET_BATCH128_TPS}
        targets["batch128_1tok_graphs_tokens_per_s"] = {"value": tps(128, "block4_1tok_graphs"),
                                                        "target": TARGET_GRAPHS_BATCH128_TPS}
        print(f"batch 128 at 1 token/forward: eager {tps(128, 'block4_1tok_eager'):.0f} tokens/s (target >= "
              f"{TARGET_BATCH128_TPS}), graphs {tps(128, 'block4_1tok_graphs'):.0f} tokens/s (target >= "
              f"{TARGET_GRAPHS_BATCH128_TPS}: 2x the eager decoder's {EAGER_BATCH128_TPS} of 2026-11-30)")
    report = {
        "benchmark": "decode_throughput", "model": "smoke" if args.smoke else args.model, "device": str(device),
        "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None, "dtype": str(dtype),
        "torch": torch.__version__, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "group": args.group,
        "sdpa_only": args.sdpa_only, "compile": args.compile, "flex_tile": args.flex_tile, "modes": args.modes,
        "rows": rows, "speedup_2tok_vs_ar": speedups, "graphs_vs_eager_1tok": graph_gain, "targets": targets,
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    if args.profile_replays and device.type == "cuda":
        profile_replays(model, args.profile_replays)


if __name__ == "__main__":
    main()
