"""`dice generate`: a checkpoint directory and a prompt (or a KernelBench task file) in, generated program out,
optionally handed straight to `dice eval`. Heavy imports happen inside the command."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import typer

from dice_kernels.cli_errors import fail, need_extra

_DTYPES = ("auto", "bfloat16", "float16", "float32")



def generate(
    checkpoint: Optional[str] = typer.Option(None, "--checkpoint", "-c",
                                             help="Hugging Face checkpoint directory (config.json, *.safetensors, "
                                                  "tokenizer.json), model_type sdar or qwen3, or a Hub id "
                                                  "(JetLM/SDAR-4B-Chat) already in the Hugging Face cache."),
    random_init: bool = typer.Option(False, "--random-init",
                                     help="Instead of a checkpoint: a tiny random model with a byte tokenizer "
                                          "(nothing to download; its output is noise, which shows the pipeline "
                                          "end to end: prompt, decoding, --out, --eval)."),
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="Prompt text (sent as a chat user turn)."),
    task: Optional[Path] = typer.Option(None, "--task", "-t", exists=True, dir_okay=False,
                                        help="KernelBench task file (Model, get_inputs, get_init_inputs): builds "
                                             "the one-shot 'write ModelNew with CUDA kernels' prompt."),
    out: Optional[Path] = typer.Option(None, "--out", "-o",
                                       help="Save the raw model output here (.md or .txt: `dice eval` extracts "
                                            "the first ```python block from it)."),
    run_eval: bool = typer.Option(False, "--eval", help="Then run `dice eval --task TASK OUT` (needs --task)."),
    max_new_tokens: int = typer.Option(4096, help="Stop after this many new tokens."),
    block_size: Optional[int] = typer.Option(None, help="Tokens per diffusion block (default: the checkpoint's; "
                                                        "SDAR uses 4)."),
    steps: int = typer.Option(4, help="Denoising forwards per block: block_size / steps tokens per forward."),
    strategy: str = typer.Option("static", help="Which masked tokens to commit each step: static (most "
                                                "confident), dynamic (all above --threshold), sequential "
                                                "(left to right)."),
    threshold: float = typer.Option(0.9, help="Confidence threshold of the dynamic strategy."),
    temperature: float = typer.Option(0.0, help="0 = greedy (DICE's evaluation setting); RL used 1.0."),
    top_k: int = typer.Option(0, help="Sample among the k most likely tokens (0 = off)."),
    top_p: float = typer.Option(1.0, help="Nucleus sampling mass (1 = off)."),
    seed: Optional[int] = typer.Option(None, help="Random seed for sampling."),
    raw: bool = typer.Option(False, "--raw", help="Feed the prompt as is, without the chat template."),
    dtype: str = typer.Option("auto", help=f"One of {', '.join(_DTYPES)}; auto = the checkpoint's dtype on "
                                           "GPU, float32 on CPU. DICE benchmarked in float16."),
    device: str = typer.Option("auto", help="cuda, cpu, cuda:1, ... (auto: cuda if available)."),
) -> None:
    """Generate a program with a block-diffusion (SDAR) checkpoint. On a CPU, a task's prompt asks for a C++
    extension (what the CPU harness runs), on a GPU for CUDA.

    \b
    Examples:
      dice generate -c ckpt/SDAR-4B-Chat --task level1/19_ReLU.py --out relu.md --eval
      dice generate -c ckpt/SDAR-4B-Chat -p "Write a CUDA kernel for a 2D transpose." --temperature 1.0 --seed 0
      dice generate --random-init --task level1/19_ReLU.py --max-new-tokens 64 --eval   # no weights needed
    """
    if (prompt is None) == (task is None):
        fail("give exactly one of --prompt or --task")
    if run_eval and task is None:
        fail("--eval needs --task")
    if out is not None and out.suffix == ".py":
        fail("--out saves the raw model output, which `dice eval` reads as code when the file ends in .py; use .md "
              "or .txt so it extracts the first ```python block")
    if dtype not in _DTYPES:
        fail(f"--dtype must be one of {', '.join(_DTYPES)}")
    if (checkpoint is None) == (not random_init):
        fail("give a model: --checkpoint DIR, or --random-init for a tiny random one")
    need_extra("model", "dice generate")

    import torch

    from dice_kernels.model.checkpoint import CheckpointError, resolve_checkpoint

    from dice_kernels.prompts import SYSTEM_PROMPT, e2e_user
    from dice_kernels.sampling.decoder import SamplingConfig
    from dice_kernels.sampling.generate import Generator
    from dice_kernels.tasks.loader import load_task_file

    cfg = SamplingConfig(max_new_tokens=max_new_tokens, block_size=block_size, steps=steps, strategy=strategy,
                         threshold=threshold, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    torch_dtype = (None if dev.type == "cuda" else torch.float32) if dtype == "auto" else getattr(torch, dtype)
    backend = "cuda" if dev.type == "cuda" else "cpu"  # what the harness will run the answer on
    text = e2e_user(load_task_file(task).code, backend) if task is not None else prompt

    try:
        generator = (Generator.from_checkpoint(resolve_checkpoint(checkpoint), dtype=torch_dtype, device=dev)
                     if checkpoint is not None else _random_generator(dev, seed))
    except CheckpointError as e:  # its message starts with the folder it names
        fail(f"--checkpoint {e}")
    except (OSError, ValueError) as e:  # the checkpoint's other files: config values, tokenizer
        fail(f"--checkpoint {checkpoint}: {e}")
    began = time.perf_counter()
    # a task prompt gets the same system message as the SFT and RL data, so sampling sees what training saw
    result = generator([text], cfg, chat=not raw, system=SYSTEM_PROMPT if task is not None else None)[0]
    seconds = time.perf_counter() - began
    typer.echo(result.text)
    typer.echo(f"[{len(result.token_ids)} tokens in {seconds:.1f}s, "
               f"{'stopped' if result.stopped else 'hit --max-new-tokens'}]", err=True)

    solution = out
    if run_eval and solution is None:
        solution = Path(tempfile.mkdtemp(prefix="dice-generate-")) / "solution.md"
    if solution is not None:
        solution.parent.mkdir(parents=True, exist_ok=True)
        solution.write_text(result.text)
    if run_eval:
        dice = shutil.which("dice")
        command = [dice] if dice else [sys.executable, "-c", "from dice_kernels.cli import app; app()"]
        raise typer.Exit(subprocess.call([*command, "eval", "--task", str(task), str(solution), "--backend", backend]))


def _random_generator(device, seed: int | None):
    """A tiny random model (model.config.tiny_config) over a byte tokenizer: `dice generate` without weights."""
    import torch

    from dice_kernels.model.config import tiny_config
    from dice_kernels.model.tokenizer import byte_tokenizer
    from dice_kernels.model.transformer import BlockDiffusionLM
    from dice_kernels.sampling.generate import Generator

    tokenizer = byte_tokenizer()
    torch.manual_seed(0 if seed is None else seed)
    model = BlockDiffusionLM(tiny_config(len(tokenizer), tokenizer.mask_token_id)).to(device).eval()
    return Generator(model, tokenizer)
