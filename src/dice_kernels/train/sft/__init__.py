"""Supervised fine-tuning (`dice train sft`): the trainer (trainer.py: `SFTConfig`, `run_sft`), SDAR's
block-diffusion objective (objective.py) and the packed, tokenized CuKe rows it trains on (data.py)."""
