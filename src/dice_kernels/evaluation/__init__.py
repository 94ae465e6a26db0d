"""The `dice eval` command's run directories (evaluation/cli.py)."""
