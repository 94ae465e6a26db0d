"""The recipe at small scale (`dice demo`): a synthetic, verified task world (world.py), a tokenizer trained on it
(tokenizer.py), and the driver that runs SFT, infilling RL, end-to-end RL and the benchmark through the real
trainers and harness (run.py), with its settings per scale in config.py."""
