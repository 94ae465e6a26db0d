"""SFT training-step throughput of the block-diffusion objective (SDAR-1.7B shapes, random bf16 weights): one
packed row of 4,096 tokens, run doubled (8,192), forward + backward + AdamW, with the functional FlexAttention
mask next to the same mask materialised densely for SDPA. MFU is against a bf16 matmul peak measured here.

    python benchmarks/sft_step.py --out sft.json
    python benchmarks/sft_step.py --smoke --out /tmp/s.json   # tiny shapes on CPU (dense only: no flex backward)

Model FLOPs per step: 6 x (transformer matmul parameters) x 2L tokens, 6 x hidden x vocab per masked token
(the lm_head runs on masked tokens only), and 12 x head_dim x q_heads per visible (query, key) pair per layer
(attention forward 4, backward 8). The same useful FLOPs are credited to both variants.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback

import torch

from dice_kernels.model import SDAR_SHAPES, BlockDiffusionLM, Layout, ModelConfig
from dice_kernels.model.attention import block_diffusion_mask_mod, dense_mask
from dice_kernels.train.flops import ForwardWork, forward_flops
from dice_kernels.train.sft.objective import corrupt, pack, sft_loss

TARGET_MFU = 0.40


def measure_peak_flops(device: torch.device, dtype: torch.dtype, n: int, repeats: int) -> float:
    """Achieved FLOP/s of a large square matmul: the ceiling MFU is measured against."""
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    seconds = _timed(lambda: [a @ b for _ in range(repeats)])
    return 2 * n**3 * repeats / seconds


def _timed(fn) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    began = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - began


def step_flops(cfg: ModelConfig, batch, masked_tokens: int, block_size: int) -> float:
    """Forward and backward (3 forwards' worth) of the doubled row: every token through the layers, the masked
    ones through the lm_head, attention on the pairs the mask lets through."""
    noisy = torch.ones_like(batch.response)
    layout = Layout(batch.doc, batch.positions, noisy).cat(Layout(batch.doc, batch.positions, ~noisy))
    length = layout.pos.shape[1]
    visible = int(dense_mask(block_diffusion_mask_mod(layout, layout, block_size), layout.pos.shape[0], length, length,
                             layout.pos.device).sum())
    work = ForwardWork(tokens=layout.pos.numel(), pad_tokens=0, pairs=visible, pad_pairs=0, scored=masked_tokens)
    return 3 * forward_flops(cfg, work).useful


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="where to write the JSON results")
    parser.add_argument("--model", default="1.7B", choices=sorted(SDAR_SHAPES))
    parser.add_argument("--tokens", type=int, default=4096, help="packed row length before doubling")
    parser.add_argument("--sample-len", type=int, default=1024, help="tokens per packed sample (1/4 prompt)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU, to check the script runs")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    cfg, dtype, block = SDAR_SHAPES[args.model], torch.bfloat16, 4
    backends = ["flex", "dense"]
    peak_n, peak_repeats = 8192, 50
    if args.smoke:
        cfg = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, mask_token_id=511)
        args.tokens, args.sample_len, args.steps, args.warmup = 256, 64, 2, 1
        dtype, backends, peak_n, peak_repeats = torch.float32, ["dense"], 512, 5
    peak = measure_peak_flops(device, dtype, peak_n, peak_repeats)

    torch.manual_seed(0)
    with torch.device(device):
        model = BlockDiffusionLM(cfg).to(dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    prompt_len = args.sample_len // 4
    samples = [(torch.randint(0, cfg.mask_token_id, (prompt_len,)).tolist(),
                torch.randint(0, cfg.mask_token_id, (args.sample_len - prompt_len,)).tolist())
               for _ in range(args.tokens // args.sample_len)]
    batch = pack(samples, block, pad_id=0, row_len=args.tokens)
    batch = type(batch)(**{k: v.to(device) for k, v in vars(batch).items()})
    generator = torch.Generator(device).manual_seed(0)

    def train_step(backend: str) -> int:
        c = corrupt(batch, cfg.mask_token_id, generator)
        loss = sft_loss(model, batch, c, block, backend)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return int(c.masked.sum())

    rows = []
    for backend in backends:
        try:
            masked = [train_step(backend) for _ in range(args.warmup)]  # includes flex compilation
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            seconds = _timed(lambda: masked.extend(train_step(backend) for _ in range(args.steps)))
            per_step = seconds / args.steps
            mean_masked = sum(masked[args.warmup:]) / args.steps
            flops = step_flops(cfg, batch, int(mean_masked), block)
            rows.append({"backend": backend, "seconds_per_step": per_step, "tokens_per_s": args.tokens / per_step,
                         "doubled_tokens_per_s": 2 * args.tokens / per_step, "model_tflops_per_step": flops / 1e12,
                         "achieved_tflops": flops / per_step / 1e12, "mfu": flops / per_step / peak,
                         "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None})
        except Exception as e:  # report a failing variant and keep the other one
            rows.append({"backend": backend, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
            optimizer.zero_grad(set_to_none=True)

    print(f"SFT step, model {'smoke' if args.smoke else args.model}, {args.tokens} tokens ({2 * args.tokens} doubled), "
          f"{dtype}, {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}; "
          f"measured matmul peak {peak / 1e12:.0f} TFLOP/s")
    print(f"{'mask':<6} {'s/step':>8} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6} {'mem GiB':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['backend']:<6} FAILED: {r['error']}")
        else:
            mem = f"{r['peak_memory_gib']:.1f}" if r["peak_memory_gib"] is not None else "-"
            print(f"{r['backend']:<6} {r['seconds_per_step']:>8.3f} {r['tokens_per_s']:>10.0f} "
                  f"{r['achieved_tflops']:>8.0f} {r['mfu']:>6.1%} {mem:>8}")
    print(f"target MFU >= {TARGET_MFU:.0%}")
    report = {"benchmark": "sft_step", "model": "smoke" if args.smoke else args.model, "device": str(device),
              "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None, "dtype": str(dtype),
              "torch": torch.__version__, "tokens": args.tokens, "doubled_tokens": 2 * args.tokens,
              "peak_tflops_measured": peak / 1e12, "rows": rows, "target_mfu": TARGET_MFU}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    if any("error" in r for r in rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
