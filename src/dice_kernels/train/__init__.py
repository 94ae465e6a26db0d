"""Training: the trainers (`dice train sft` in sft/, `dice train rl` in rl/) and what they share (docs/training.md):
the sections of their configs (config.py), the process group and sharding (distributed.py), the initial model
(model_setup.py), resumable states and exports (checkpointing.py), the run around the steps (run_loop.py), metrics,
the optimizer, the memory plan and FLOP counts. Importing the package imports nothing heavy."""
