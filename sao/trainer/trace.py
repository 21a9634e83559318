"""What the trainer computed per action token, for the first few rows of a batch (`Batch.trace_rows`).

The runtime asks for it on the steps that dump sample trajectories (`output.trace_trajectories` of
them, sao/runtime/loop.py); the learner fills a `StepTrace` as it steps and returns its records under
the metrics key "trace"; the runtime joins them with the trajectories and writes traces/step_N.jsonl
(sao/runtime/run_dir.py), which `sao view` shows.

One record per traced row. Per-token lists have one entry per real token of the row (prompt and
observations included, so they align with `token_ids`); entries off the action mask are None:

    row                  the row's index in the step's batch (the runtime's trajectory order)
    actor                "stepped", "warmup" (critic warm-up), "uniform" (all rewards equal,
                         algo.skip_uniform_rewards) or "not applied" (a non-finite update was skipped)
    reward               the trajectory's outcome reward
    version              the policy version that sampled each action token
    behavior_logprob     the rollout policy's log-prob the engine recorded
    logprob              the current policy's log-prob the actor's loss used (PPO losses: pi_old)
    ratio                exp(logprob - behavior_logprob), the DIS ratio
    dis                  -1 masked low, +1 masked high, 0 kept (algorithms with the DIS loss)
    v_before, v_after    the critic's V(s_t) before its K updates (v0) and after them (v2)
    return               R_t of lambda=1 skip-observation GAE on v0 (the critic's target)
    adv_raw, adv         the advantage before and after whitening (critic-free: the trajectory's
                         baseline advantage on every action token); 0 on stale tokens
    stale                1 on tokens older than algo.max_token_lag versions (no gradient), when set
    critic_weight        pact: the critic's per-token importance weight min(pi_new / pi_rollout, clip)
    ntf_kept             crf_ntf: 1 on the tokens in the loss, 0 on a failed episode's filtered tokens
    lambda               the row's lambda_policy (length-adaptive)
    whiten               {"mean", "std"}: the batch statistics whitening used (std after its floor)
    group, group_adv     GRPO-style algorithms: the row's group and its group-relative advantage
    prompt_value         sppo: the episode's V(x) = sigmoid of the critic's output after the prompt (before its updates)

Values are rounded to 6 significant digits: a trace is for reading, the tests recompute from it with
that tolerance.
"""

from __future__ import annotations

import torch

from sao.algo.losses import dis_mask


def _r(x: float) -> float:
    return float(f"{x:.6g}")


class StepTrace:
    """Per-token values of `local` rows of a batch (indices into the batch the learner holds), which are
    rows `global_rows` of the step's whole batch."""

    def __init__(self, batch, local: list[int], global_rows: list[int]):
        self.batch, self.local, self.global_rows = batch, local, global_rows
        self.tokens: dict[str, list] = {}  # name -> per row, per token
        self.scalars: dict[str, list] = {}  # name -> per row
        self.extra: dict = {}  # batch-level values every record carries (the whitening statistics)

    def put(self, name: str, values: torch.Tensor) -> None:
        """(B, T) values of the whole held batch, kept on action tokens; (B,) values, one per row."""
        values = values.detach().float().cpu()
        if values.dim() == 1:
            self.scalars[name] = [_r(float(values[i])) for i in self.local]
            return
        mask, lengths = self.batch.action_mask.cpu(), self.batch.attention_mask.sum(1).tolist()
        self.tokens[name] = [[_r(v) if m else None for v, m in zip(values[i, : lengths[i]].tolist(),
                                                                 mask[i, : lengths[i]].tolist())]
                             for i in self.local]

    def put_rows(self, name: str, rows: list) -> None:
        """Values computed elsewhere for the same rows (the critic's own process)."""
        (self.tokens if rows and isinstance(rows[0], list) else self.scalars)[name] = rows

    def critic_part(self) -> dict:
        """What a critic process recorded, to hand to the actor's side (`merge`)."""
        return {**self.tokens, **self.scalars}

    def merge(self, part: dict) -> None:
        for name, rows in part.items():
            self.put_rows(name, rows)

    def put_policy(self, logprobs: torch.Tensor, eps: tuple[float, float] | None) -> None:
        """The actor's log-probs the loss used, the ratio to the rollout policy and, with `eps`
        (eps_low, eps_high) for the DIS loss, the mask it applied: from the same tensors, not re-rounded."""
        b = self.batch
        _, ratio, low, high = dis_mask(logprobs.detach().float(), b.behavior_logprobs.float(), b.action_mask,
                                       *(eps or (1.0, 1.0)))
        self.put("logprob", logprobs)
        self.put("ratio", ratio)
        if eps is not None:
            self.put("dis", high.float() - low.float())

    def records(self, actor: str) -> list[dict]:
        b = self.batch
        if b.versions is not None:
            self.put("version", b.versions.float())
        self.put("behavior_logprob", b.behavior_logprobs)
        self.put("reward", b.scalar_rewards)
        out = []
        for k, g in enumerate(self.global_rows):
            rec = {"row": g, "actor": actor, **self.extra}
            rec.update({name: rows[k] for name, rows in self.scalars.items()})
            rec.update({name: rows[k] for name, rows in self.tokens.items()})
            for name in ("version", "dis", "stale", "ntf_kept"):
                if name in rec:
                    rec[name] = [None if v is None else int(v) for v in rec[name]]
            out.append(rec)
        return out
