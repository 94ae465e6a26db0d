"""The robust check (docs/robust_check.md): the in-worker integrity monitor (integrity.py) with its file watch,
process-state and output checks, and the parent's degenerate-task flags (degenerate.py)."""
