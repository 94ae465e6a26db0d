"""The SFT trainer end to end (`dice train sft` in a subprocess: data loading, packing, FSDP2, bf16, AdamW, metrics),
on random-weight SDAR shapes: the 1.7B shape at 4,096-token packed rows, and the 4B shape with activation
checkpointing. Reports tokens/s, MFU against a bf16 matmul peak measured here, the peak memory, and the memory
plan's (`--plan`) prediction of that peak.

    python benchmarks/sft_trainer.py --out sft_trainer.json
    python benchmarks/sft_trainer.py --smoke --out /tmp/t.json      # tiny model on CPU, to check the script runs

Each run trains `--steps` optimizer steps of `--rows` rows; throughput is the median over the steps after the
first `--warmup` (flex attention compiles in the first). Rows hold 4 samples of 1,024 tokens (256 prompt, 768
response), as benchmarks/sft_step.py. Model FLOPs per row: sft_step.step_flops (6 x matmul parameters per doubled
token, the lm_head on masked tokens, attention on visible pairs), with the expected masked count (E[p] = 1/2).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

from sft_step import TARGET_MFU, measure_peak_flops, step_flops  # noqa: E402

SAMPLE, PROMPT = 1024, 256
PLAN_GOAL = 0.15  # the plan should be within 15 % of the measured peak
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"]
WORDS = 1000  # the smoke tokenizer's ordinary tokens


def write_tokenizer(directory: Path, words: int) -> None:
    """A word-level tokenizer (w0 ... w{words-1}) with Qwen's special tokens and a mask token."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + [f"w{i}" for i in range(words)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   mask_token="<|MASK|>")
    fast.save_pretrained(str(directory))


def write_rows(path: Path, count: int, words: int, sample: int, prompt: int) -> None:
    g = torch.Generator().manual_seed(0)
    with path.open("w") as f:
        for _ in range(count):
            ids = torch.randint(0, words, (sample,), generator=g).tolist()
            text = [f"w{i}" for i in ids]
            f.write(json.dumps({"prompt": " ".join(text[:prompt]), "response": " ".join(text[prompt:])}) + "\n")


def run_trainer(name: str, shape: str, tokens: int, rows: int, steps: int, ac: bool, work: Path,
                timeout: float, extra: list[str]) -> dict:
    out = work / name
    sets = {"out_dir": str(out), "model.shape": shape, "model.tokenizer": str(work / "tok"),
            "data.path": str(work / "rows.jsonl"), "data.cutoff": tokens, "data.shuffle": "false",
            "train.max_steps": steps, "train.global_batch_rows": rows, "train.micro_batch_rows": 1,
            "parallel.activation_checkpointing": str(ac).lower(), "checkpoint.every_steps": 0,
            "checkpoint.at_end": "false", "metrics.progress": "false", "metrics.tensorboard": "false",
            "metrics.plot": "false", "optim.lr": 1e-5, "optim.warmup_fraction": 0.0}
    cmd = [sys.executable, "-m", "dice_kernels", "train", "sft", "tiny", *extra]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    began = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"name": name, "error": f"timed out after {timeout:.0f} s"}
    wall = time.monotonic() - began
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()] \
        if (out / "metrics.jsonl").is_file() else []
    if proc.returncode != 0 or not records:
        return {"name": name, "error": f"exit {proc.returncode}", "stderr_tail": proc.stderr[-3000:]}
    return {"name": name, "shape": shape, "tokens": tokens, "rows": rows, "ac": ac, "wall_s": wall,
            "records": records}


def summarize(run: dict, warmup: int, peak: float, smoke: bool) -> dict:
    from dice_kernels.model import SDAR_SHAPES
    from dice_kernels.model.config import tiny_config
    from dice_kernels.train.sft.objective import pack
    from dice_kernels.train.plan import memory_plan

    if "error" in run:
        return run
    timed = run["records"][warmup:] or run["records"][-1:]
    step_s = statistics.median(r["step_s"] for r in timed)
    tokens = run["records"][-1]["tokens"]
    cfg = tiny_config(len(SPECIALS) + WORDS, SPECIALS.index("<|MASK|>")) if smoke else SDAR_SHAPES[run["shape"]]
    per_row = run["tokens"] // SAMPLE
    row = pack([(list(range(PROMPT)), list(range(SAMPLE - PROMPT)))] * per_row, cfg.block_size, 0, run["tokens"])
    masked = per_row * (SAMPLE - PROMPT) // 2
    flops = step_flops(cfg, row, masked, cfg.block_size) * run["rows"]
    measured = max((r.get("max_memory_gib", 0.0) for r in run["records"]), default=0.0)
    plan = memory_plan(cfg, 1, run["tokens"], 1, accumulation=run["rows"], masked_fraction=masked / run["tokens"])
    predicted = plan.total(run["ac"]) / 2**30
    return {"name": run["name"], "shape": run["shape"], "tokens": run["tokens"], "rows": run["rows"], "ac": run["ac"],
            "step_s": step_s, "tokens_per_s": tokens / step_s, "tflops": flops / step_s / 1e12,
            "mfu": flops / step_s / peak, "peak_memory_gib": measured, "plan_gib": predicted,
            "plan_error": (predicted - measured) / measured if measured else None, "wall_s": run["wall_s"],
            "losses": [r["loss"] for r in run["records"]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON results (rewritten after each run)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=240, help="seconds per trainer run")
    parser.add_argument("--only", default="", help="comma-separated run names (default: all)")
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU, to check the script runs")
    args = parser.parse_args()

    cuda = torch.cuda.is_available() and not args.smoke
    peak = (measure_peak_flops(torch.device("cuda"), torch.bfloat16, 8192, 50) if cuda
            else measure_peak_flops(torch.device("cpu"), torch.float32, 512, 5))
    runs = [("1.7B-4096", "1.7B", 4096, 4, False), ("1.7B-4096-ac", "1.7B", 4096, 4, True),
            ("4B-4096-ac", "4B", 4096, 2, True)]
    extra: list[str] = []
    if args.smoke:
        runs = [("tiny-256", "tiny", 256 * 4, 2, False), ("tiny-256-ac", "tiny", 256 * 4, 2, True)]
        args.steps, args.warmup = 3, 1
        extra = ["--set", "parallel.attention=dense"]
    if args.only:
        runs = [r for r in runs if r[0] in args.only.split(",")]
    report = {"benchmark": "sft_trainer", "gpu": torch.cuda.get_device_name() if cuda else None,
              "torch": torch.__version__, "peak_tflops_measured": peak / 1e12, "steps": args.steps,
              "warmup": args.warmup, "rows": []}
    with tempfile.TemporaryDirectory(prefix="sft-trainer-") as tmp:
        work = Path(tmp)
        write_tokenizer(work / "tok", WORDS)
        max_rows = max(r[3] for r in runs) * max(r[2] // SAMPLE for r in runs)
        write_rows(work / "rows.jsonl", max_rows * (args.steps + 1), WORDS, SAMPLE, PROMPT)
        for name, shape, tokens, rows, ac in runs:
            result = run_trainer(name, shape if not args.smoke else "tiny", tokens, rows, args.steps, ac, work,
                                 args.timeout, extra)
            report["rows"].append(summarize(result, args.warmup, peak, args.smoke))
            Path(args.out).write_text(json.dumps(report, indent=2))  # saved after each run

    print(f"SFT trainer (dice train sft), {report['gpu'] or 'cpu'}, torch {torch.__version__}; measured matmul peak "
          f"{peak / 1e12:.0f} TFLOP/s; median of steps {args.warmup + 1}-{args.steps}")
    print(f"{'run':<14} {'rows x tok':>11} {'s/step':>7} {'tokens/s':>9} {'TFLOP/s':>8} {'MFU':>6} "
          f"{'peak GiB':>9} {'plan GiB':>9} {'plan err':>9}")
    for r in report["rows"]:
        if "error" in r:
            print(f"{r['name']:<14} FAILED: {r['error']}")
            continue
        err = f"{r['plan_error']:+.1%}" if r["plan_error"] is not None else "-"
        print(f"{r['name']:<14} {r['rows']:>4} x {r['tokens']:<4} {r['step_s']:>7.3f} {r['tokens_per_s']:>9.0f} "
              f"{r['tflops']:>8.0f} {r['mfu']:>6.1%} {r['peak_memory_gib']:>9.1f} {r['plan_gib']:>9.1f} {err:>9}")
    print(f"targets: MFU >= {TARGET_MFU:.0%}; plan within {PLAN_GOAL:.0%} of the measured peak")
    Path(args.out).write_text(json.dumps(report, indent=2))
    if any("error" in r for r in report["rows"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
