"""The agent loop (env <-> engine <-> tokenizer -> Trajectory) and the rollout worker."""
