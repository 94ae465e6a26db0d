"""Training: the SFT objective of block diffusion (objective.py); RL and the training loops build on it."""
