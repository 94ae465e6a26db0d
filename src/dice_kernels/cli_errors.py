"""How every `dice` command reports an input error: one line on stderr naming the file or flag and what to do,
exit code 2, no traceback (a leaf module: each stage's command imports it)."""

from __future__ import annotations

import typer


def fail(message: str) -> None:
    """Report an input error and end the command with exit code 2."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)
