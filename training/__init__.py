"""Training the kernel policy: data, pretraining, SFT, RL (GRPO) and evaluation (see README.md)."""
