"""Value pretraining (cold start, docs/algorithm.md §5): fit the critic to Monte-Carlo returns of trajectories
sampled from the initial policy, before RL starts, so the first actor steps see useful values. For SPPO's
prompt-value critic (algo.name=sppo) the target is what it learns in RL: the reward, by binary cross-entropy
on its output at the last prompt token."""

from __future__ import annotations

from collections.abc import Callable

import torch

from sao.algo.core import explained_variance
from sao.algo.gae import skip_observation_gae
from sao.algo.losses import prompt_value_loss, value_loss
from sao.trainer.batch import Batch
from sao.trainer.learner import adamw
from sao.trainer.packing import critic_forward


def monte_carlo_returns(batch: Batch, gamma: float = 1.0) -> torch.Tensor:
    """lambda = 1 returns (the values cancel out), (B, T)."""
    _, returns = skip_observation_gae(batch.rewards, torch.zeros_like(batch.rewards), batch.action_mask, gamma, 1.0,
                                      batch.episodes)
    return returns


def fit_critic(critic, next_batch: Callable[[], Batch], steps: int, lr: float, grad_clip: float,
               weight_decay: float, gamma: float, on_step: Callable[[int, dict], None] | None = None,
               prompt_value: bool = False) -> list[dict]:
    """`steps` optimizer steps of token-mean MSE on fresh batches (or, `prompt_value`, SPPO's cross-entropy
    of each episode's prompt value against its reward), with the RL critic's optimizer settings and the
    run's gamma; returns per-step metrics."""
    critic.train()
    opt = adamw(critic, lr, weight_decay)
    history = []
    for step in range(steps):
        batch = next_batch()
        values = critic_forward(critic, batch)  # packed rows when the batch has them
        if prompt_value:  # as the learner's SPPO phase: the head's output after the prompt, one per episode
            heads = batch.heads.nonzero().flatten()
            logits = values[heads, batch.action_mask[heads].float().argmax(1)]
            rewards = batch.scalar_rewards[heads].float()
            loss, metrics = prompt_value_loss(logits, rewards)
            ones = torch.ones_like(rewards)[:, None]
            metrics["critic/explained_variance"] = explained_variance(torch.sigmoid(logits.detach())[:, None],
                                                                      rewards[:, None], ones)
        else:
            returns = monte_carlo_returns(batch, gamma)
            loss, metrics = value_loss(values, returns, batch.action_mask)
            metrics["critic/explained_variance"] = explained_variance(values.detach(), returns, batch.action_mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        metrics["critic/grad_norm"] = float(torch.nn.utils.clip_grad_norm_(critic.parameters(), grad_clip))
        opt.step()
        history.append(metrics)
        if on_step is not None:
            on_step(step, metrics)
    return history
