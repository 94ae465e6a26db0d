"""How every `dice` command reports an input error: one line on stderr naming the file or flag and what to do,
exit code 2, no traceback; and the check that the optional packages a command needs (its pip extra) are installed,
made before any work starts (a leaf module: each stage's command imports it)."""

from __future__ import annotations

import importlib

import typer

INPUT_ERROR = 2  # a mistake in what the user gave: a file, a flag, a missing package
NOTHING_PRODUCED = 1  # the command ran as asked but made nothing usable (e.g. an empty dataset)

# the modules each pip extra adds that commands import (pyproject.toml's [project.optional-dependencies])
EXTRAS = {
    "model": ("safetensors", "tokenizers", "transformers"),
    "data": ("datasketch", "pyarrow"),
    "train": ("safetensors", "tokenizers", "transformers"),
    "ray": ("ray",),
}


def fail(message: str, code: int = INPUT_ERROR) -> None:
    """Report an error in one line and end the command with `code` (2: an input error)."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def need_extra(extra: str, command: str) -> None:
    """End `command` with one line naming `pip install 'dice-kernels[extra]'` when a module of that extra is
    missing (instead of a traceback from deep inside the stage)."""
    for module in EXTRAS[extra]:
        try:
            importlib.import_module(module)
        except ImportError:
            fail(f"{command} needs the [{extra}] extra ({module} is not installed): "
                 f"pip install 'dice-kernels[{extra}]'")
