"""Training: `Learner.step(batch)` (synchronous, sees no queue), SFT warm start, critic pretraining."""
