"""Training: the SFT objective of block diffusion (objective.py), the shared trainer infrastructure (config,
distributed, checkpointing, metrics, optim, plan; docs/training.md) and the trainers built on it (`dice train sft`,
`dice train rl`). Importing the package imports nothing heavy."""
