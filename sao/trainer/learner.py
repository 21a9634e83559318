"""`Learner.step(batch)`: one SAO optimizer step (docs/algorithm.md §5 order), synchronous and queue-free.

    step 1  v0 = critic(batch), no grad; returns R from lambda=1 skip-observation GAE on v0
    step 2  K critic steps on MSE(V, R)                          (faster value update, K=2)
    step 3  v2 = critic(batch), no grad; advantages from lambda_policy GAE on v2; whiten
    step 4  one actor step with the DIS loss                     (skipped during critic warm-up)

Critic-free algorithms (group, running mean) skip steps 1-3 and put one advantage per trajectory on
every action token; only critic-based advantages are whitened (docs/algorithm.md §7). PPO-loss algorithms (grpo,
vapo) compute pi_old once per batch, then take `ppo_epochs x ppo_minibatches` actor updates against
it; the policy version still advances by one per batch (weights are published per batch).
"""

from __future__ import annotations

import time

import torch

from sao.algo.baselines import RunningMeanBaseline, group_advantages
from sao.algo.core import explained_variance, masked_mean, masked_whiten
from sao.algo.gae import length_adaptive_lambda, skip_observation_gae, step_level_gae, step_level_values
from sao.algo.losses import dis_policy_loss, ppo_clip_loss, value_loss
from sao.algo.registry import Algorithm
from sao.config import AlgoConfig, CriticConfig, TrainConfig
from sao.models.actor import sequence_logprobs, token_entropy, token_logprobs
from sao.models.critic import critic_values, freeze_parameters
from sao.trainer.batch import Batch


def adamw(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.99))


class Learner:
    def __init__(self, actor, critic, algo: Algorithm, algo_cfg: AlgoConfig, critic_cfg: CriticConfig,
                 train_cfg: TrainConfig):
        self.actor, self.critic, self.algo = actor.train(), critic, algo
        self.algo_cfg, self.critic_cfg, self.train_cfg = algo_cfg, critic_cfg, train_cfg
        self.actor_opt = adamw(actor, train_cfg.lr, train_cfg.weight_decay)
        self.critic_opt = None
        self.critic_updates = algo.critic_updates or critic_cfg.updates_per_step
        self.critic_version = 0  # critic optimizer steps taken so far
        self.steps_done = 0  # optimizer steps (critic-only warm-up steps included)
        self.actor_version = 0  # actor optimizer steps taken so far = policy version
        if algo.uses_critic:
            if critic is None:
                raise ValueError(f"algo.name={algo.name} needs a critic")
            critic.train()
            freeze = critic_cfg.freeze_attention if algo.freeze_attention is None else algo.freeze_attention
            if freeze:
                freeze_parameters(critic, critic_cfg.freeze_pattern)
            self.critic_opt = adamw(critic, critic_cfg.lr, train_cfg.weight_decay)
        self.running_mean = (
            RunningMeanBaseline(algo_cfg.running_mean_window, algo_cfg.running_mean_per_prompt)
            if algo.advantage == "running_mean" else None
        )

    @property
    def in_warmup(self) -> bool:
        return self.algo.uses_critic and self.steps_done < self.critic_cfg.warmup_steps

    def _values(self, batch: Batch) -> torch.Tensor:
        v = critic_values(self.critic, batch.input_ids, batch.attention_mask)  # (B, T)
        if self.algo.step_level:
            v = step_level_values(v, batch.action_mask, self.algo_cfg.step_value)
        return v

    def _critic_phase(self, batch: Batch, metrics: dict) -> torch.Tensor:
        """Steps 1-3: returns, K critic updates, then actor advantages from the updated critic."""
        mask, cfg = batch.action_mask, self.algo_cfg
        # step 1: v0 is also the forward pass of the first critic update (the critic has not changed
        # yet), so one forward serves both
        v = self._values(batch)
        v0 = v.detach()
        _, returns = skip_observation_gae(batch.rewards, v0, mask, cfg.gamma, 1.0)
        metrics["critic/explained_variance"] = explained_variance(v0, returns, mask)
        for k in range(self.critic_updates):  # step 2
            if k > 0:
                v = self._values(batch)
            loss, m = value_loss(v, returns, mask, old_values=v0, clip=self.critic_cfg.value_clip)
            self.critic_opt.zero_grad(set_to_none=True)
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(
                [p for p in self.critic.parameters() if p.requires_grad], self.critic_cfg.grad_clip)
            self.critic_opt.step()
            self.critic_version += 1
        metrics.update(m)
        metrics["critic/grad_norm"] = float(gn)
        with torch.no_grad():  # step 3
            v2 = self._values(batch)
            if self.algo.step_level:  # one advantage per turn, lambda from the number of turns (App. A.1)
                advantages, lam = step_level_gae(batch.rewards, v2, mask, cfg.gamma, cfg.lam_alpha, cfg.step_value)
            else:
                lam = length_adaptive_lambda(batch.num_action_tokens, cfg.lam_alpha)
                advantages, _ = skip_observation_gae(batch.rewards, v2, mask, cfg.gamma, lam)
        metrics["critic/version"] = self.critic_version
        metrics["critic/value_mean"] = float(masked_mean(v2, mask))
        metrics["critic/return_mean"] = float(masked_mean(returns, mask))
        metrics["critic/lambda_policy_mean"] = float(lam.mean())
        return advantages

    def _baseline_advantages(self, batch: Batch) -> torch.Tensor:
        if self.algo.grouped:
            sizes = {g: batch.group_ids.count(g) for g in batch.group_ids}
            if set(sizes.values()) != {self.algo_cfg.group_size}:  # the runtime trains whole groups only
                raise RuntimeError(f"{self.algo.name}: batch holds groups of sizes {sorted(set(sizes.values()))}, "
                                   f"expected algo.group_size={self.algo_cfg.group_size}")
            adv = group_advantages(batch.scalar_rewards, batch.group_ids)
        else:  # keyed by the prompt's content: a per-draw id would never fill its window
            adv = torch.tensor(self.running_mean.advantages(batch.scalar_rewards.tolist(), batch.prompt_keys))
        return adv[:, None] * batch.action_mask  # every action token of a trajectory

    def step(self, batch: Batch) -> dict[str, float]:
        t0 = time.perf_counter()
        mask = batch.action_mask
        metrics: dict[str, float] = {"reward/mean": float(batch.scalar_rewards.mean())}
        if self.algo.uses_critic:
            advantages = self._critic_phase(batch, metrics)
        else:
            advantages = self._baseline_advantages(batch)
        metrics["adv/mean_raw"] = float(masked_mean(advantages, mask))
        if self.algo_cfg.whiten_advantages and self.algo.uses_critic:
            advantages = masked_whiten(advantages, mask)
        warmup = self.in_warmup
        metrics["train/critic_warmup"] = float(warmup)
        if not warmup:  # step 4
            metrics.update(self._actor_step(batch, advantages))
        self.steps_done += 1
        metrics["perf/train_step_s"] = time.perf_counter() - t0
        metrics["perf/train_tokens"] = float(batch.attention_mask.sum())
        return metrics

    def _actor_step(self, batch: Batch, advantages: torch.Tensor) -> dict[str, float]:
        cfg = self.algo_cfg
        self.actor.train()  # an engine sharing this model (evaluation, sync mode) switches it to eval()
        if self.algo.policy_loss == "dis":  # one update; the ratio is against the rollout policy
            metrics = self._update(batch, advantages, None)
        else:
            with torch.no_grad():  # pi_old, once per batch: the extra forward pass DIS avoids
                old_logprobs = sequence_logprobs(self.actor, batch.input_ids, batch.attention_mask)
            gen = torch.Generator().manual_seed(self.train_cfg.seed * 1_000_003 + self.steps_done)
            rows = []
            for _ in range(cfg.ppo_epochs):
                for idx in torch.randperm(batch.size, generator=gen).chunk(cfg.ppo_minibatches):
                    rows.append(self._update(batch.rows(idx), advantages[idx], old_logprobs[idx]))
            metrics = {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}
            metrics["ppo/clipfrac_max"] = max(r["ppo/clipfrac"] for r in rows)
            metrics["ppo/updates"] = float(len(rows))
        self.actor_version += 1
        return metrics

    def _update(self, batch: Batch, advantages: torch.Tensor, old_logprobs: torch.Tensor | None) -> dict[str, float]:
        """One actor optimizer step on `batch`: DIS (old_logprobs None) or PPO clip against pi_old."""
        mask, cfg = batch.action_mask, self.algo_cfg
        logits = self.actor(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        logprobs = token_logprobs(logits, batch.input_ids)  # (B, T)
        if old_logprobs is None:
            loss, metrics = dis_policy_loss(logprobs, batch.behavior_logprobs, advantages, mask,
                                            cfg.eps_low, cfg.eps_high)
        else:
            loss, metrics = ppo_clip_loss(logprobs, old_logprobs, advantages, mask, cfg.ppo_eps_low, cfg.ppo_eps_high)
            rollout_ratio = torch.exp((logprobs.detach() - batch.behavior_logprobs) * mask)
            metrics["dis/ratio_mean"] = float(masked_mean(rollout_ratio, mask))
        if cfg.entropy_coef > 0:  # off by default: the paper uses no entropy bonus
            entropy = masked_mean(token_entropy(logits), mask)
            loss = loss - cfg.entropy_coef * entropy
        else:  # a metric only: no (B, T, V) autograd buffers kept alive through backward()
            with torch.no_grad():
                entropy = masked_mean(token_entropy(logits), mask)
        self.actor_opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(self.actor.parameters(), self.train_cfg.grad_clip)
        self.actor_opt.step()
        metrics["actor/entropy"] = float(entropy.detach())
        metrics["actor/grad_norm"] = float(gn)
        return metrics
