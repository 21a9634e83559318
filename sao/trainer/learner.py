"""`Learner.step(batch)`: one SAO optimizer step (docs/algorithm.md §5 order), synchronous and queue-free.

The one-process side of the trainer seam (sao/trainer/protocol.py): the runtime calls `step`,
`export_weights`, `state_dict`/`load_state_dict` and `save_pretrained`, and reads `version`; it never
reaches into the models or optimizers.

    step 1  v0 = critic(batch), no grad; returns R from lambda=1 skip-observation GAE on v0
    step 2  K critic steps on MSE(V, R)                          (faster value update, K=2)
    step 3  v2 = critic(batch), no grad; advantages from lambda_policy GAE on v2; whiten
    step 4  one actor step with the DIS loss                     (skipped during critic warm-up, and
                                                                  on a batch whose rewards are all equal)

Critic-free algorithms (group, running mean) skip steps 1-3 and put one advantage per trajectory on
every action token; only critic-based advantages are whitened (docs/algorithm.md §7). PPO-loss algorithms (grpo,
vapo) compute pi_old once per batch, then take `ppo_epochs x ppo_minibatches` actor updates against
it; the policy version still advances by one per batch (weights are published per batch).

Model passes per SAO step (docs/performance.md): critic forward+backward x K (the first forward
also gives v0), one no-grad critic forward (v2), one actor forward+backward. They run on packed
rows (sao/trainer/packing.py) when `train.pack` is on, so their cost follows real tokens.

Guard: an optimizer update whose loss or gradient norm is not finite is skipped (weights and
optimizer state untouched) and counted; `train.max_nonfinite_steps` consecutive steps with a
skipped update stop the run with `NonFiniteError`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from sao.algo.baselines import RunningMeanBaseline, group_advantages, negative_token_filter, outcome_advantages
from sao.algo.core import LOCAL, explained_variance, masked_mean, masked_var, masked_whiten, stale_tokens, token_mean_loss
from sao.algo.gae import episode_totals, length_adaptive_lambda, skip_observation_gae, step_level_gae, step_level_values
from sao.algo.losses import dis_policy_loss, ppo_clip_loss, prompt_value_advantages, prompt_value_loss, value_loss
from sao.algo.registry import Advantage, Algorithm, PolicyLoss
from sao.config import AlgoConfig, CriticConfig, TrainConfig
from sao.device import autocast, to_device
from sao.errors import RunStopped
from sao.models.critic import freeze_parameters
from sao.trainer.batch import Batch
from sao.trainer.packing import actor_logprobs, critic_forward, pack
from sao.trainer.trace import StepTrace


class NonFiniteError(RunStopped):
    """Too many consecutive optimizer steps had a non-finite loss or gradient: the run cannot go on."""


def _lap(metrics: dict, key: str, since: float) -> float:
    """Add the time since `since` to metrics[key]; return now (per-pass cost, docs/performance.md)."""
    now = time.perf_counter()
    metrics[key] = metrics.get(key, 0.0) + now - since
    return now


def per_row(per_episode: torch.Tensor, batch: Batch) -> torch.Tensor:
    """(E,) values, one per episode in batch order, as (B,): every row of an episode gets its value."""
    if batch.episodes is None:
        return per_episode
    return per_episode.to(batch.episodes.device)[batch.heads.long().cumsum(0).to(batch.episodes.device) - 1]


def adamw(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.99))


class Learner:
    """Actor and critic in this process (critic.placement=colocated), or the actor here and the critic
    on its own process, `critic_group` (sao/trainer/critic_ranks.py), which runs steps 1-3 of each batch,
    one batch ahead when the runtime hands it the next batch early (`look_ahead`). A critic rank's own
    learner has no actor (`actor=None`) and runs only `critic_phase`."""

    def __init__(self, actor, critic, algo: Algorithm, algo_cfg: AlgoConfig, critic_cfg: CriticConfig,
                 train_cfg: TrainConfig, dtype: torch.dtype = torch.float32, critic_group=None,
                 critic_elsewhere: bool = False):
        self.actor, self.critic, self.algo = actor.train() if actor is not None else None, critic, algo
        self.critic_group = critic_group
        # the models' device; bf16 = autocast over the float32 master weights the optimizers update (sao/device.py)
        self.device, self.dtype = next((actor if actor is not None else critic).parameters()).device, dtype
        self.algo_cfg, self.critic_cfg, self.train_cfg = algo_cfg, critic_cfg, train_cfg
        self.actor_opt = adamw(actor, train_cfg.lr, train_cfg.weight_decay) if actor is not None else None
        self.critic_opt = None
        self.critic_updates = algo.critic_updates or critic_cfg.updates_per_step
        self.critic_version = 0  # critic optimizer steps taken so far
        self.steps_done = 0  # optimizer steps (critic-only warm-up steps included)
        self.actor_version = 0  # actor optimizer steps taken so far = policy version
        self.skipped_total = 0  # optimizer updates skipped for a non-finite loss or gradient
        self.consecutive_skipped = 0  # steps in a row with a skipped update
        self.skipped_in_step = 0
        self.reduce = LOCAL  # global sums over trainer ranks (sao/trainer/distributed.py); identity here
        # called before each model pass: the async loop sets the thread count by what the rollout side
        # is doing (sao/runtime/threads.py); it only reads a counter, never receives. None in sync mode
        self.before_pass: Callable[[], None] | None = None
        self.trace: StepTrace | None = None  # this step's per-token record, when the batch asks (trace_rows)
        self._after_actor: tuple[torch.Tensor, torch.Tensor] | None = None  # pact: (v0, returns) for the critic
        # critic_elsewhere: a trainer rank beside critic ranks, given each step's critic results by its driver
        if algo.uses_critic and critic_group is None and not critic_elsewhere:
            if critic is None:
                raise ValueError(f"algo.name={algo.name} needs a critic")
            critic.train()
            freeze = critic_cfg.freeze_attention if algo.freeze_attention is None else algo.freeze_attention
            if freeze:
                freeze_parameters(critic, critic_cfg.freeze_pattern)
            self.critic_opt = adamw(critic, critic_cfg.lr, train_cfg.weight_decay)
        self.running_mean = (
            RunningMeanBaseline(algo_cfg.running_mean_window, algo_cfg.running_mean_per_prompt)
            if algo.advantage is Advantage.RUNNING_MEAN else None
        )

    @property
    def in_warmup(self) -> bool:
        return self.algo.uses_critic and self.steps_done < self.critic_cfg.warmup_steps

    def _pass_boundary(self) -> None:
        if self.before_pass is not None:
            self.before_pass()

    def _packed(self, batch: Batch) -> Batch:
        if self.train_cfg.pack and batch.packing is None:
            # planned on the CPU (per-row Python loop), then moved to the batch's device
            batch.packing = to_device(pack(batch.input_ids.cpu(), batch.attention_mask.cpu()), batch.input_ids.device)
        return batch

    def _values(self, batch: Batch) -> torch.Tensor:
        self._pass_boundary()
        v = critic_forward(self.critic, self._packed(batch))  # (B, T)
        if self.algo.step_level:
            v = step_level_values(v, batch.action_mask, self.algo_cfg.step_value)
        return v

    def _prompt_value_phase(self, batch: Batch, metrics: dict) -> torch.Tensor:
        """SPPO (algo.name=sppo, docs/algorithm.md §7): each episode's value V(x) = sigmoid of the critic's
        output at its last prompt token (it has seen the prompt only), A = R - V(x) on every action token
        of the episode, from the critic before its K updates of binary cross-entropy against R."""
        t = time.perf_counter()
        device = batch.action_mask.device
        heads = batch.heads.nonzero().flatten().to(device)  # an episode's first row holds its prompt
        rewards = batch.scalar_rewards.to(device)[heads].float()
        self._rewards_in_unit(rewards, "its value is the chance of solving the prompt, trained by binary cross-entropy")
        # V(s_t) at t is the head's output at t-1 (sao/models/critic.py): at the first action token it has
        # read the whole prompt and nothing after it
        last_prompt = batch.action_mask[heads].float().argmax(1)
        prompts = self._prompts(batch, heads, last_prompt)
        logits = self._prompt_logits(prompts, last_prompt)
        t = _lap(metrics, "perf/critic_forward_s", t)
        episode_adv, value = prompt_value_advantages(logits, rewards)
        ones = torch.ones_like(value)[:, None]
        metrics["critic/explained_variance"] = explained_variance(value[:, None], rewards[:, None], ones, self.reduce)
        if self.trace is not None:
            self.trace.put("prompt_value", per_row(value.cpu(), batch))
        self._critic_updates(lambda: self._prompt_logits(prompts, last_prompt),
                             lambda out: prompt_value_loss(out, rewards, self.reduce), metrics, t, first=logits)
        metrics["critic/version"] = self.critic_version
        metrics["critic/value_mean"] = float(self.reduce.mean(value))
        metrics["critic/return_mean"] = float(self.reduce.mean(rewards))
        return per_row(episode_adv.cpu(), batch).to(device)[:, None] * batch.action_mask

    @staticmethod
    def _prompts(batch: Batch, heads: torch.Tensor, first_action: torch.Tensor) -> Batch:
        """Each episode's first row cut after its prompt: the value at the first action token reads nothing
        later (a causal critic), so the critic's passes need not run over the whole episode."""
        rows = batch.rows(heads)
        cut = int(first_action.max()) + 1 if rows.size else 1
        return Batch(rows.input_ids[:, :cut], rows.attention_mask[:, :cut], rows.action_mask[:, :cut],
                     rows.behavior_logprobs[:, :cut], rows.rewards[:, :cut], rows.scalar_rewards,
                     rows.num_action_tokens, rows.prompt_keys, rows.group_ids)

    def _prompt_logits(self, prompts: Batch, first_action: torch.Tensor) -> torch.Tensor:
        """The critic's output after each prompt (V(s_t) at the first action token), one per episode."""
        v = self._values(prompts)
        return v[torch.arange(prompts.size, device=v.device), first_action]

    def _rewards_in_unit(self, rewards: torch.Tensor, why: str) -> None:
        """Stop the run on a reward outside [0, 1] (on any rank: every rank takes the same branch)."""
        outside = ((rewards < 0) | (rewards > 1)).any().float()
        if float(self.reduce.max(outside)) > 0:
            raise RunStopped(f"algo.name={self.algo.name}: a reward outside [0, 1] (e.g. "
                             f"{float(rewards[(rewards < 0) | (rewards > 1)][0]) if outside else 'on another rank'}); "
                             f"{why}")

    def _critic_updates(self, forward, loss_of, metrics: dict, t: float, first: torch.Tensor | None = None,
                        lap_forward: bool = True) -> float:
        """The K critic updates (critic.updates) every critic-based algorithm makes: `forward()` the critic's
        output, `loss_of(output)` -> (loss, metrics), one optimizer step each; `first` is the first update's
        output when the caller's forward pass already made it. Times go to perf/critic_forward_s (when
        `lap_forward`, else with the backward) and perf/critic_backward_s (backward + clip + optimizer step);
        the last update's metrics and grad norm go to `metrics`. Returns the time of the last lap."""
        gn, m = None, {}
        for k in range(self.critic_updates):
            out = first if k == 0 and first is not None else forward()
            if lap_forward and out is not first:
                t = _lap(metrics, "perf/critic_forward_s", t)
            loss, m = loss_of(out)
            gn = self._apply(self.critic_opt, loss, self.critic_cfg.grad_clip)
            self.critic_version += gn is not None
            t = _lap(metrics, "perf/critic_backward_s", t)
        metrics.update(m)
        metrics["critic/grad_norm"] = float("nan") if gn is None else gn
        return t

    def _critic_phase(self, batch: Batch, metrics: dict) -> torch.Tensor:
        """Steps 1-3: returns, K critic updates, then actor advantages from the updated critic."""
        if self.algo.advantage is Advantage.PROMPT_VALUE:
            return self._prompt_value_phase(batch, metrics)
        if self.algo.actor_first:
            return self._actor_first_advantages(batch, metrics)
        mask, cfg = batch.action_mask, self.algo_cfg
        t = time.perf_counter()
        # step 1: v0 is also the forward pass of the first critic update (the critic has not changed
        # yet), so one forward serves both
        v = self._values(batch)
        v0 = v.detach()
        t = _lap(metrics, "perf/critic_forward_s", t)
        _, returns = skip_observation_gae(batch.rewards, v0, mask, cfg.gamma, 1.0, batch.episodes)
        if self.trace is not None:
            self.trace.put("v_before", v0)
            self.trace.put("return", returns)
        metrics["critic/explained_variance"] = explained_variance(v0, returns, mask, self.reduce)
        t = _lap(metrics, "perf/gae_s", t)
        t = self._critic_updates(  # step 2
            lambda: self._values(batch), lambda out: value_loss(out, returns, mask, old_values=v0,
                                                                clip=self.critic_cfg.value_clip, reduce=self.reduce),
            metrics, t, first=v)
        with torch.inference_mode():  # step 3
            v2 = self._values(batch)
        t = _lap(metrics, "perf/critic_v2_s", t)
        if self.algo.step_level:  # one advantage per turn, lambda from the number of turns (App. A.1)
            advantages, lam = step_level_gae(batch.rewards, v2, mask, cfg.gamma, cfg.lam_alpha, cfg.step_value,
                                             batch.episodes)
        else:  # l = the episode's action tokens (all its segments')
            lam = length_adaptive_lambda(episode_totals(batch.num_action_tokens, batch.episodes), cfg.lam_alpha)
            advantages, _ = skip_observation_gae(batch.rewards, v2, mask, cfg.gamma, lam, batch.episodes)
        _lap(metrics, "perf/gae_s", t)
        if self.trace is not None:
            self.trace.put("v_after", v2)
            if lam.dim() == 1:
                self.trace.put("lambda", lam)
        metrics["critic/version"] = self.critic_version
        metrics["critic/value_mean"] = float(masked_mean(v2, mask, self.reduce))
        metrics["critic/return_mean"] = float(masked_mean(returns, mask, self.reduce))
        metrics["critic/lambda_policy_mean"] = float(self.reduce.mean(lam))
        return advantages

    def _actor_first_advantages(self, batch: Batch, metrics: dict) -> torch.Tensor:
        """pact (docs/algorithm.md §7): advantages from GAE on v0, the critic before any update on this batch;
        its updates wait for the actor's step (`_importance_corrected_critic`)."""
        mask, cfg = batch.action_mask, self.algo_cfg
        t = time.perf_counter()
        with torch.no_grad():
            v0 = self._values(batch).detach()
        t = _lap(metrics, "perf/critic_forward_s", t)
        _, returns = skip_observation_gae(batch.rewards, v0, mask, cfg.gamma, 1.0, batch.episodes)
        lam = length_adaptive_lambda(episode_totals(batch.num_action_tokens, batch.episodes), cfg.lam_alpha)
        advantages, _ = skip_observation_gae(batch.rewards, v0, mask, cfg.gamma, lam, batch.episodes)
        _lap(metrics, "perf/gae_s", t)
        metrics["critic/explained_variance"] = explained_variance(v0, returns, mask, self.reduce)
        metrics["critic/value_mean"] = float(masked_mean(v0, mask, self.reduce))
        metrics["critic/return_mean"] = float(masked_mean(returns, mask, self.reduce))
        metrics["critic/lambda_policy_mean"] = float(self.reduce.mean(lam))
        if self.trace is not None:
            self.trace.put("v_before", v0)
            self.trace.put("return", returns)
            self.trace.put("lambda", lam)
        self._after_actor = (v0, returns)
        return advantages

    def _importance_corrected_critic(self, batch: Batch, v0: torch.Tensor, returns: torch.Tensor) -> dict[str, float]:
        """pact, after the actor's step: K critic steps on the squared errors weighted per token by
        min(pi_new / pi_rollout, algo.pact_weight_clip), pi_new the actor as it is now."""
        mask, metrics = batch.action_mask, {}
        t = time.perf_counter()
        self._pass_boundary()
        with torch.no_grad():
            logprobs, _ = actor_logprobs(self.actor, self._packed(batch))
            ratio = torch.exp(torch.where(mask.bool(), logprobs.float() - batch.behavior_logprobs.float(), 0.0))
            weights = ratio.clamp(max=self.algo_cfg.pact_weight_clip) * mask
        metrics["critic/is_weight_mean"] = float(masked_mean(weights, mask, self.reduce))
        t = _lap(metrics, "perf/critic_forward_s", t)
        self._critic_updates(lambda: self._values(batch),
                             lambda out: value_loss(out, returns, mask, old_values=v0, clip=self.critic_cfg.value_clip,
                                                    reduce=self.reduce, weights=weights), metrics, t, lap_forward=False)
        metrics["critic/version"] = self.critic_version
        if self.trace is not None:
            self.trace.put("critic_weight", weights)
        return metrics

    def critic_phase(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float], int]:
        """Steps 1-3 alone, on a critic rank: (advantages before whitening (B, T) on the CPU, the critic's
        metrics, updates skipped for a non-finite loss). The same math as inside `step`."""
        self.skipped_in_step, metrics = 0, {"perf/critic_began_at": time.time()}  # a wall clock both sides share
        t = time.perf_counter()
        with autocast(self.device, self.dtype):
            batch = to_device(batch, self.device)
            self.trace = self._start_trace(batch)
            advantages = self._critic_phase(batch, metrics)
        if self.trace is not None:
            metrics["trace"], self.trace = self.trace.critic_part(), None
        metrics["perf/critic_phase_s"] = time.perf_counter() - t
        metrics["perf/critic_ended_at"] = time.time()
        return advantages.float().cpu(), metrics, self.skipped_in_step

    def _critic_advantages(self, batch: Batch, metrics: dict) -> torch.Tensor:
        """Steps 1-3 here, or their result from the critic's own process."""
        if self.critic_group is None:
            return self._critic_phase(batch, metrics)
        t = time.perf_counter()
        advantages, critic_metrics, skipped = self.critic_group.result()
        metrics["perf/critic_wait_s"] = time.perf_counter() - t  # what of the critic's time was not hidden
        part = critic_metrics.pop("trace", None)
        if self.trace is not None and part:
            self.trace.merge(part)
        metrics.update(critic_metrics)
        self.skipped_in_step += skipped
        return advantages.to(self.device)

    def _baseline_advantages(self, batch: Batch) -> torch.Tensor:
        """One advantage per episode (over episodes, not segments), on every action token of it."""
        heads = batch.heads.nonzero().flatten().tolist()
        if self.algo.grouped:
            groups = [batch.group_ids[i] for i in heads]
            sizes = {g: groups.count(g) for g in groups}
            if set(sizes.values()) != {self.algo_cfg.group_size}:  # the runtime trains whole groups only
                raise RuntimeError(f"{self.algo.name}: batch holds groups of sizes {sorted(set(sizes.values()))}, "
                                   f"expected algo.group_size={self.algo_cfg.group_size}")
            adv = per_row(group_advantages(batch.scalar_rewards[heads], groups), batch)
            if self.trace is not None:
                self.trace.put_rows("group", [batch.group_ids[i] for i in self.trace.local])
                self.trace.put("group_adv", adv)
        elif self.algo.advantage is Advantage.OUTCOME:
            rewards = batch.scalar_rewards[heads].float()
            self._rewards_in_unit(rewards, "C-RF's advantage 2R - 1 is +1 for a solved task and -1 for a failed one")
            adv = per_row(outcome_advantages(rewards), batch)
        else:  # keyed by the prompt's content: a per-draw id would never fill its window
            adv = per_row(torch.tensor(self.running_mean.advantages(batch.scalar_rewards[heads].tolist(),
                                                                    [batch.prompt_keys[i] for i in heads])), batch)
        return adv.to(batch.action_mask.device)[:, None] * batch.action_mask  # every action token of an episode

    def _apply(self, opt: torch.optim.Optimizer, loss: torch.Tensor, clip: float) -> float | None:
        """backward, clip, step; returns the gradient norm, or None when the update was skipped because
        the loss or the gradient is not finite (no step: weights and optimizer state stay as they were)."""
        opt.zero_grad(set_to_none=True)
        params = [p for group in opt.param_groups for p in group["params"]]
        if torch.isfinite(self.reduce.sum(loss.detach())):  # every rank takes the same branch
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(params, clip)
            if torch.isfinite(gn):
                opt.step()
                return float(gn)
            opt.zero_grad(set_to_none=True)
        self.skipped_in_step += 1
        return None

    def guard_state(self) -> dict[str, int]:
        """The guard's counters, for checkpoints: a resumed run keeps counting a run of skipped steps."""
        return {"skipped_total": self.skipped_total, "consecutive_skipped": self.consecutive_skipped}

    def load_guard_state(self, state: dict) -> None:
        self.skipped_total = int(state.get("skipped_total", 0))
        self.consecutive_skipped = int(state.get("consecutive_skipped", 0))

    def _guard(self, metrics: dict) -> None:
        """Count steps with a skipped update; too many in a row stop the run."""
        skipped = metrics["guard/skipped_updates"] = self.skipped_in_step
        self.skipped_total += skipped
        self.consecutive_skipped = self.consecutive_skipped + 1 if skipped else 0
        metrics["guard/skipped_updates_total"] = self.skipped_total
        limit = self.train_cfg.max_nonfinite_steps
        if self.consecutive_skipped >= limit:
            raise NonFiniteError(
                f"{self.consecutive_skipped} optimizer steps in a row had a non-finite loss or gradient "
                f"(train.max_nonfinite_steps={limit}); stopping. Check the rewards, or lower train.lr/critic.lr")

    @property
    def looks_ahead(self) -> bool:
        """True when the runtime should hand over the next batch early (`look_ahead`): the critic runs
        on its own process and can compute it while the actor steps on this one."""
        return self.critic_group is not None

    def look_ahead(self, batch: Batch) -> None:
        """Start steps 1-3 on `batch` now; the next `step` calls take the batches in the order given."""
        self.critic_group.submit(batch)

    def step(self, batch: Batch) -> dict[str, float]:
        if self.critic_group is not None:
            self.critic_group.expect(batch)  # handed over early, or sent now
        return self._train(batch)

    def _train(self, batch: Batch) -> dict[str, float]:
        with autocast(self.device, self.dtype):
            return self._step(to_device(batch, self.device))

    def _start_trace(self, batch: Batch) -> StepTrace | None:
        if not batch.trace_rows:
            return None
        local = self._trace_rows(batch)
        return StepTrace(batch, local, self._global_rows(local))

    def _trace_rows(self, batch: Batch) -> list[int]:
        """This learner's rows of `batch` that are traced (a sharded learner holds some of the batch)."""
        return list(range(min(batch.trace_rows, batch.size)))

    def _global_rows(self, local: list[int]) -> list[int]:
        return local

    def _trace_records(self, actor: str) -> list[dict]:
        """The traced rows' records (a sharded learner gathers every rank's onto each)."""
        return self.trace.records(actor)

    def _step(self, batch: Batch) -> dict[str, float]:
        t0 = time.perf_counter()
        mask = batch.action_mask
        self.skipped_in_step = 0
        self.trace = self._start_trace(batch)
        heads = batch.heads.to(batch.scalar_rewards.device)  # one reward per episode, not per segment
        metrics: dict[str, float] = {"reward/mean": float(self.reduce.mean(batch.scalar_rewards[heads]))}
        if self.algo.uses_critic:
            advantages = self._critic_advantages(batch, metrics)
        else:
            advantages = self._baseline_advantages(batch)
        metrics["adv/mean_raw"] = float(masked_mean(advantages, mask, self.reduce))
        metrics["adv/std_raw"] = float(masked_var(advantages, mask, self.reduce).clamp(min=0).sqrt())
        if self.trace is not None:
            self.trace.put("adv_raw", advantages)
        if self.algo_cfg.whiten_advantages and self.algo.whitens:
            if self.trace is not None:  # the statistics masked_whiten uses
                self.trace.extra["whiten"] = {"mean": metrics["adv/mean_raw"],
                                              "std": max(metrics["adv/std_raw"], self.algo_cfg.whiten_min_std)}
            advantages = masked_whiten(advantages, mask, min_std=self.algo_cfg.whiten_min_std, reduce=self.reduce)
        if self.algo_cfg.max_token_lag is not None and batch.versions is not None:  # per-token staleness bound
            stale = stale_tokens(batch.versions, mask, self.actor_version, self.algo_cfg.max_token_lag)
            metrics["lag/masked_token_frac"] = float(masked_mean(stale.float(), mask, self.reduce))
            advantages = torch.where(stale, 0.0, advantages)  # no gradient; still in the token-mean denominator
            if self.trace is not None:
                self.trace.put("stale", stale.float())
        loss_mask = mask
        if self.algo.negative_filter:  # a failed episode's likely tokens leave the loss (and its denominator)
            kept = negative_token_filter(advantages, batch.behavior_logprobs, mask, self.algo_cfg.ntf_keep)
            loss_mask = mask * kept
            metrics["ntf/filtered_token_frac"] = float(1.0 - self.reduce.sum(loss_mask.sum())
                                                       / self.reduce.sum(mask.sum()).clamp(min=1.0))
            if self.trace is not None:
                self.trace.put("ntf_kept", kept.float())
        if self.trace is not None:
            self.trace.put("adv", advantages)
        warmup = self.in_warmup
        metrics["train/critic_warmup"] = float(warmup)
        uniform = self.algo.uses_critic and self.algo_cfg.skip_uniform_rewards and self._uniform_rewards(batch)
        metrics["actor/uniform_skipped"] = float(uniform and not warmup)
        version = self.actor_version
        if not warmup and not uniform:  # step 4
            self._pass_boundary()
            t = time.perf_counter()
            metrics.update(self._actor_step(batch, advantages, loss_mask))
            _lap(metrics, "perf/actor_s", t)  # forward + backward + optimizer step
        if self._after_actor is not None:  # pact: the critic's updates follow the actor's
            metrics.update(self._importance_corrected_critic(batch, *self._after_actor))
            self._after_actor = None
        self.steps_done += 1
        self._guard(metrics)
        if self.trace is not None:
            actor = ("warmup" if warmup else "uniform" if uniform else
                     "stepped" if self.actor_version > version else "not applied")
            metrics["trace"], self.trace = self._trace_records(actor), None
        metrics["perf/train_step_s"] = time.perf_counter() - t0
        metrics["perf/train_tokens"] = float(self.reduce.sum(batch.attention_mask.sum()))
        positions = float(self.reduce.sum(torch.tensor(float(self._packed(batch).positions))))
        metrics["perf/train_positions"] = positions  # what each full-batch model pass computes
        metrics["perf/padded_frac"] = 1.0 - metrics["perf/train_tokens"] / positions
        return metrics

    def _uniform_rewards(self, batch: Batch) -> bool:
        """Every reward of the batch (all ranks' rows) is the same: no reward contrast to learn from."""
        r = batch.scalar_rewards.float()
        return float(self.reduce.max(r.max()) + self.reduce.max(-r.min())) == 0.0

    def _actor_step(self, batch: Batch, advantages: torch.Tensor, loss_mask: torch.Tensor) -> dict[str, float]:
        """The actor's update(s) on `batch`; the loss is over `loss_mask`'s tokens (the action tokens, less
        any crf_ntf filtered)."""
        cfg = self.algo_cfg
        self.actor.train()  # an engine sharing this model (evaluation, sync mode) switches it to eval()
        if self.algo.policy_loss is PolicyLoss.DIS:  # one update; the ratio is against the rollout policy
            metrics = self._update(batch, advantages, None, loss_mask)
        else:
            with torch.no_grad():  # pi_old, once per batch: the extra forward pass DIS avoids
                old_logprobs, _ = actor_logprobs(self.actor, self._packed(batch))
            if self.trace is not None:
                self.trace.put_policy(old_logprobs, None)
            live = self._live_parity(old_logprobs, batch)
            gen = torch.Generator().manual_seed(self.train_cfg.seed * 1_000_003 + self.steps_done)
            rows = []
            for _ in range(cfg.ppo_epochs):
                for idx in self._minibatches(batch, gen):
                    rows.append(self._update(batch.rows(idx), advantages[idx], old_logprobs[idx], loss_mask[idx]))
            metrics = {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}
            metrics["ppo/clipfrac_max"] = max(r["ppo/clipfrac"] for r in rows)
            metrics["ppo/updates"] = float(len(rows))
            metrics.update(live)
        self.actor_version += metrics.pop("applied") > 0  # weights unchanged when every update was skipped
        return metrics

    def _minibatches(self, batch: Batch, gen: torch.Generator) -> list[torch.Tensor]:
        """Row indices of each PPO minibatch: a random split of the batch (one epoch)."""
        return list(torch.randperm(batch.size, generator=gen).chunk(self.algo_cfg.ppo_minibatches))

    def _live_parity(self, logprobs: torch.Tensor, batch: Batch) -> dict[str, float]:
        """Engine vs trainer on the tokens the engine sampled with the weights the trainer holds now
        (version == actor_version): max |log-prob difference|, which should stay at numerical noise.
        A live parity check on the engine that actually ran (vLLM included) and on its weight transport."""
        if batch.versions is None:
            return {}
        on = batch.action_mask.bool() & (batch.versions == self.actor_version)
        n = int(self.reduce.sum(on.sum()))
        if not n:
            return {}
        diff = self.reduce.max(torch.where(on, (logprobs.float() - batch.behavior_logprobs.float()).abs(), 0.0).max())
        return {"parity/live_max_abs_diff": float(diff), "parity/live_tokens": float(n)}

    def _update(self, batch: Batch, advantages: torch.Tensor, old_logprobs: torch.Tensor | None,
                loss_mask: torch.Tensor) -> dict[str, float]:
        """One actor optimizer step on `batch`: DIS (old_logprobs None) or PPO clip against pi_old, the loss
        a token mean over `loss_mask`."""
        mask, cfg = batch.action_mask, self.algo_cfg
        logprobs, entropy = actor_logprobs(self.actor, self._packed(batch), entropy_grad=cfg.entropy_coef > 0)
        if old_logprobs is None:
            loss, metrics = dis_policy_loss(logprobs, batch.behavior_logprobs, advantages, loss_mask,
                                            cfg.eps_low, cfg.eps_high, self.reduce)
            if self.trace is not None and batch is self.trace.batch:  # the one DIS update, on the whole batch
                self.trace.put_policy(logprobs, (cfg.eps_low, cfg.eps_high))
            metrics.update(self._live_parity(logprobs.detach(), batch))
        else:
            loss, metrics = ppo_clip_loss(logprobs, old_logprobs, advantages, loss_mask, cfg.ppo_eps_low, cfg.ppo_eps_high,
                                          self.reduce)
            rollout_ratio = torch.exp(torch.where(mask.bool(), logprobs.detach() - batch.behavior_logprobs, 0.0))
            metrics["dis/ratio_mean"] = float(masked_mean(rollout_ratio, mask, self.reduce))
        if cfg.entropy_coef > 0:  # off by default: the paper uses no entropy bonus
            loss = loss - cfg.entropy_coef * token_mean_loss(entropy, loss_mask, self.reduce)
        entropy = masked_mean(entropy.detach(), mask, self.reduce)  # the metric
        gn = self._apply(self.actor_opt, loss, self.train_cfg.grad_clip)
        metrics["actor/entropy"] = float(entropy.detach())
        metrics["actor/grad_norm"] = float("nan") if gn is None else gn
        metrics["applied"] = float(gn is not None)
        return metrics

    # --- the trainer seam (sao/trainer/protocol.py) ---------------------------------------------------

    @property
    def version(self) -> int:
        """The policy version: actor optimizer steps taken (what engines and tokens are stamped with)."""
        return self.actor_version

    def export_weights(self) -> list[torch.Tensor]:
        """Full actor weights in the engines' parameter order (merged for a LoRA actor)."""
        from sao.models.lora import engine_parameters

        return engine_parameters(self.actor)

    def logprobs(self, batch: Batch) -> torch.Tensor:
        """Log-probs of `batch`'s tokens under the current actor, no grad (the parity gate's side). (B, T-1)"""
        from sao.models.actor import sequence_logprobs

        batch = to_device(batch, self.device)
        with torch.no_grad(), autocast(self.device, self.dtype):
            return sequence_logprobs(self.actor, batch.input_ids, batch.attention_mask)

    def critic_state(self) -> dict:
        return {"critic_version": self.critic_version,
                "critic_opt": self.critic_opt.state_dict() if self.critic_opt is not None else None}

    def load_critic_state(self, state: dict) -> None:
        self.critic_version = state["critic_version"]
        if self.critic_opt is not None and state["critic_opt"] is not None:
            self.critic_opt.load_state_dict(state["critic_opt"])

    def save_critic(self, folder) -> None:
        """The critic's HF folder (a critic rank's command, sao/trainer/critic_ranks.py)."""
        self.critic.save_pretrained(folder)

    def state_dict(self) -> dict:
        """Everything a resume needs besides the weights (those travel as HF folders, `save_pretrained`).
        The same whatever critic.placement: a checkpoint resumes colocated or separate."""
        critic = self.critic_group.state_dict() if self.critic_group is not None else self.critic_state()
        return {
            "actor_version": self.actor_version, **critic,
            "steps_done": self.steps_done, "guard": self.guard_state(),
            "actor_opt": self.actor_opt.state_dict(),
            "running_mean": self.running_mean.state_dict() if self.running_mean is not None else None,
        }

    def load_state_dict(self, state: dict) -> None:
        if "sharded" in state:  # saved by N ranks: build_trainer loaded their shards into this learner
            return
        self.actor_version, self.steps_done = state["actor_version"], state["steps_done"]
        self.load_guard_state(state.get("guard", {}))
        self.actor_opt.load_state_dict(state["actor_opt"])
        critic = {"critic_version": state["critic_version"], "critic_opt": state["critic_opt"]}
        if self.critic_group is not None:
            self.critic_group.load_state_dict(critic)
        else:
            self.load_critic_state(critic)
        if self.running_mean is not None and state["running_mean"]:
            self.running_mean.load_state_dict(state["running_mean"])

    def save_pretrained(self, folder, tokenizer, merged: bool = False) -> None:
        """HF folders: actor/ (a LoRA actor writes its adapter; `merged` adds actor_merged/), critic/."""
        from pathlib import Path

        from sao.models.lora import is_peft, save_merged_model

        folder = Path(folder)
        self.actor.save_pretrained(folder / "actor")
        tokenizer.save_pretrained(folder / "actor")
        if merged and is_peft(self.actor):
            save_merged_model(self.actor, folder / "actor_merged")
            tokenizer.save_pretrained(folder / "actor_merged")
        if self.critic_group is not None:
            self.critic_group.save_pretrained(folder / "critic")
            tokenizer.save_pretrained(folder / "critic")
        elif self.critic is not None:
            self.critic.save_pretrained(folder / "critic")
            tokenizer.save_pretrained(folder / "critic")

    def close(self) -> None:
        """Stop the critic's process, if the critic has one. Idempotent."""
        if self.critic_group is not None:
            self.critic_group.close()
