"""Policy and value losses. Each returns `(loss, metrics)`; metrics are detached floats.

With a distributed `reduce` (sao/algo/core.py) the loss is this rank's share (local sum / global token
count) and every metric is global, so N ranks reproduce one process (sao/trainer/distributed.py).
"""

from __future__ import annotations

import torch

from sao.algo.core import LOCAL, Reducer, masked_mean, token_count, token_mean_loss


def dis_mask(logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, action_mask: torch.Tensor,
             eps_low: float, eps_high: float) -> tuple[torch.Tensor, ...]:
    """DIS's token mask (docs/algorithm.md §3): (log-ratio, ratio, masked low, masked high), each (B, T).
    A token is masked low when r_t <= 1 - eps_low and high when r_t >= 1 + eps_high (action tokens only)."""
    on = action_mask.bool()
    # torch.where, not `* mask`: an overflowing ratio (exp of a log-ratio > 88 in fp32 is inf) or a
    # -inf log-prob off the mask times 0 is NaN, and one NaN poisons the whole gradient
    logratio = torch.where(on, logprobs - behavior_logprobs, 0.0)
    ratio = torch.exp(logratio)
    return logratio, ratio, (ratio <= 1.0 - eps_low) & on, (ratio >= 1.0 + eps_high) & on


def dis_policy_loss(
    logprobs: torch.Tensor,  # (B, T) log pi_theta(a_t|s_t), with grad
    behavior_logprobs: torch.Tensor,  # (B, T) log pi_rollout(a_t|s_t) recorded by the engine
    advantages: torch.Tensor,  # (B, T)
    action_mask: torch.Tensor,  # (B, T)
    eps_low: float,
    eps_high: float,
    reduce: Reducer = LOCAL,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Direct double-sided importance sampling (docs/algorithm.md §3, paper Eqs. 1-3).

    r_t = exp(logpi_theta - behavior_logprob)                 no pi_old: one ratio covers staleness
    w_t = r_t if 1 - eps_low < r_t < 1 + eps_high else 0      strict, both sides, any advantage sign
    loss = -sum_t sg(w_t) sg(A_t) logpi_theta(a_t|s_t) m_t / sum_t m_t
    Masked tokens stay in the denominator (token mean over all action tokens of the batch).
    """
    on = action_mask.bool()
    logratio, ratio, low, high = dis_mask(logprobs.detach(), behavior_logprobs, action_mask, eps_low, eps_high)
    keep = ~low & ~high & on
    weight = torch.where(keep, ratio, 0.0).detach()
    pg_terms = torch.where(keep, weight * advantages.detach() * logprobs, 0.0)
    pg_loss = -pg_terms.sum() / token_count(action_mask, reduce)
    # approx KL(pi_rollout || pi_theta), k3 estimator over tokens sampled from pi_rollout: (r - 1) - log r
    approx_kl = masked_mean(torch.where(on, ratio - 1.0 - logratio, 0.0), action_mask, reduce)
    metrics = {
        "dis/masked_low_frac": float(masked_mean(low.float(), action_mask, reduce)),
        "dis/masked_high_frac": float(masked_mean(high.float(), action_mask, reduce)),
        "dis/ratio_mean": float(masked_mean(ratio, action_mask, reduce)),
        "dis/approx_kl": float(approx_kl),
        "loss/policy": float(reduce.sum(pg_loss.detach())),
    }
    return pg_loss, metrics


def ppo_clip_loss(
    logprobs: torch.Tensor,  # (B, T) current policy, with grad
    old_logprobs: torch.Tensor,  # (B, T) trainer snapshot before this update (pi_old)
    advantages: torch.Tensor,  # (B, T)
    action_mask: torch.Tensor,  # (B, T)
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    reduce: Reducer = LOCAL,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clip(-higher) surrogate against pi_old, token-mean over action tokens (GRPO, VAPO)."""
    logratio = logprobs - old_logprobs
    ratio = torch.exp(logratio)
    surr1 = ratio * advantages
    surr2 = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages
    pg_loss = token_mean_loss(-torch.minimum(surr1, surr2), action_mask, reduce)
    clipped = ((ratio < 1.0 - eps_low) | (ratio > 1.0 + eps_high)).float()
    metrics = {
        "ppo/clipfrac": float(masked_mean(clipped, action_mask, reduce)),
        "ppo/approx_kl": float(masked_mean(((ratio - 1) - logratio).detach(), action_mask, reduce)),
        "loss/policy": float(reduce.sum(pg_loss.detach())),
    }
    return pg_loss, metrics


def value_loss(
    values: torch.Tensor,  # (B, T) V_phi, with grad
    returns: torch.Tensor,  # (B, T) targets R
    action_mask: torch.Tensor,  # (B, T)
    old_values: torch.Tensor | None = None,
    clip: float | None = None,
    reduce: Reducer = LOCAL,
    weights: torch.Tensor | None = None,  # (B, T) per-token weights, no grad (pact's importance weights)
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-mean MSE (V - R)^2 over action tokens (docs/algorithm.md §5); optional PPO-style value clipping;
    optional per-token weights (the token-mean's denominator stays the count of action tokens)."""
    err = (values - returns) ** 2
    if clip is not None and old_values is not None:
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        err = torch.maximum(err, (clipped - returns) ** 2)
    if weights is not None:
        err = err * weights.detach()
    loss = 0.5 * token_mean_loss(err, action_mask, reduce)
    return loss, {"critic/value_loss": float(reduce.sum(loss.detach()))}


def prompt_value_advantages(logits: torch.Tensor, rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SPPO's sequence-level advantage (docs/algorithm.md §7): the critic's logit at each episode's last prompt
    token is the prompt's value V(x) = sigmoid(logit), the chance the policy solves it; A = R - V(x), one
    per episode, not normalised. Returns (A, V), each (E,)."""
    value = torch.sigmoid(logits.detach().float())
    return rewards.float() - value, value


def prompt_value_loss(logits: torch.Tensor, rewards: torch.Tensor,
                      reduce: Reducer = LOCAL) -> tuple[torch.Tensor, dict[str, float]]:
    """SPPO's value loss: binary cross-entropy of sigmoid(logit) against the episode's reward R in [0, 1], the
    mean over episodes (this rank's share of the global mean with a distributed `reduce`)."""
    bce = torch.nn.functional.binary_cross_entropy_with_logits(logits.float(), rewards.float(), reduction="sum")
    n = reduce.sum(torch.tensor(float(rewards.numel()), device=logits.device)).clamp(min=1.0)
    loss = bce / n
    return loss, {"critic/value_loss": float(reduce.sum(loss.detach()))}
