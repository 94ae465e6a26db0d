"""`python -m dice_kernels` runs the `dice` command (for environments where the console script is absent)."""

from dice_kernels.cli import app

app(prog_name="dice")
