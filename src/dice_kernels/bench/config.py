"""`BenchConfig`: every knob of one `dice bench` run in one typed place (the CLI only fills it in)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from dice_kernels.config_io import ConfigError
from dice_kernels.harness import EvalConfig
from dice_kernels.sampling.decoder import SamplingConfig

DTYPES = ("auto", "bfloat16", "float16", "float32")
STAGES = ("all", "generate", "evaluate")


def dice_decoding() -> SamplingConfig:
    """DICE's evaluation decoding: greedy, static remasking, block 4, 4 steps (1 token per forward), 4,096 tokens."""
    return SamplingConfig(max_new_tokens=4096, block_size=4, steps=4, strategy="static", temperature=0.0)


@dataclass
class BenchConfig:
    out: Path  # the run folder; running again with the same folder resumes
    checkpoint: Path | None = None  # generate with this block-diffusion checkpoint...
    generations: Path | None = None  # ...or evaluate these files (any model's outputs, paired to tasks by name)
    tasks: Path | None = None  # KernelBench checkout, task directory or JSONL; None: the package's examples
    levels: tuple[int, ...] = ()  # keep only these KernelBench levels (empty: all)
    task_filter: tuple[str, ...] = ()  # keep only these task ids ("L1/19") or names ("19_ReLU") (empty: all)
    samples: int = 1  # generations per task (pass@k for k <= samples)
    batch_size: int = 32  # prompts decoded at once (rows); a finished row takes the next waiting prompt
    decoding: SamplingConfig = field(default_factory=dice_decoding)
    dtype: str = "auto"  # model weights: auto = the checkpoint's on GPU, float32 on CPU
    device: str = "auto"  # where the model generates: auto = cuda when present
    stage: str = "all"  # all | generate (stop after generating) | evaluate (only evaluate what exists)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def check(self) -> None:
        """Raise ValueError with a message naming the flag, for combinations that cannot run."""
        if (self.checkpoint is None) == (self.generations is None):
            raise ConfigError("give exactly one of --checkpoint DIR (generate, then evaluate) or --generations DIR "
                             "(evaluate existing model outputs)")
        if self.generations is not None and self.stage == "generate":
            raise ConfigError("--stage generate needs --checkpoint (with --generations there is nothing to generate)")
        if self.samples < 1 or self.batch_size < 1:
            raise ConfigError("--samples and --batch-size must be at least 1")
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}")
        if self.stage not in STAGES:
            raise ConfigError(f"--stage must be one of {', '.join(STAGES)}")
        self.eval.check()

    def generation_settings(self) -> dict:
        """What a generation depends on: a resumed run must match it, and every generation file records it."""
        # use_cache and cuda_graphs change how fast tokens come, not which; compile may change them by rounding, so
        # it is recorded when on (off, the settings are those recorded before it existed, and old runs resume)
        decoding = {k: v for k, v in asdict(self.decoding).items()
                    if k not in ("use_cache", "cuda_graphs") and (k != "compile" or v)}
        return {"checkpoint": str(self.checkpoint.resolve()) if self.checkpoint else None,
                "decoding": decoding, "dtype": self.dtype,
                "prompt_backend": self.eval.resolved_backend()}
