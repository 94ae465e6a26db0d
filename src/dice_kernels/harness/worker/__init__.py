"""The sandboxed worker process, the only one that executes task or candidate code: its main (main.py, started as
`python -m dice_kernels.harness.worker.main` or forked from the fork server), the model calls it makes
(model_calls.py) and the seeded inputs of each trial (trial_inputs.py)."""
