"""The `dice` command: one subcommand per pipeline stage. It parses arguments and calls the stage; the work
lives in the stage packages (heavy imports happen inside the commands so `dice --help` stays fast)."""

from __future__ import annotations

import typer

from dice_kernels.bench.cli import app as bench_app
from dice_kernels.data.cli import app as data_app
from dice_kernels.demo.cli import demo
from dice_kernels.evaluation.cli import eval_cmd, report_cmd
from dice_kernels.sampling.cli import generate
from dice_kernels.train.cli import app as train_app

# plain click help (rich_markup_mode=None): rich's option table left a ~20-character help column at 80 columns
app = typer.Typer(help="dice-kernels: train diffusion LLMs to write CUDA kernels, and evaluate kernels honestly.",
                  no_args_is_help=True, add_completion=False, rich_markup_mode=None)
app.command("eval")(eval_cmd)  # stage commands live with their stage (heavy imports stay inside them)
app.command("report")(report_cmd)
app.add_typer(data_app, name="data")
app.command("generate")(generate)
app.add_typer(train_app, name="train")
app.add_typer(bench_app, name="bench")
app.command("demo")(demo)
