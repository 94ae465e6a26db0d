"""BiC-RL (`dice train rl`): the run config (config.py), the trainer (trainer.py: `RLStep`, `run_rl`), and the
step's parts in order: the curriculum's tasks, the rollouts, the reward service (reward.py; over a Ray cluster,
reward_fanout.py), group-relative advantages and TraceRL's trajectory replay (tracerl.py)."""
