"""Skip-observation token-level GAE with decoupled lambda (docs/algorithm.md §4, paper Eqs. 4-5), and
the step-level variant of the ablation (paper App. A.1).

GAE runs over action tokens only, in order. Observation (and prompt, padding) positions are
skipped: the last token of action i links straight to the first token of action i+1, so an
observation never receives an advantage and never breaks the TD chain.

A segmented episode (several rows, `episodes`: sao/trainer/batch.py) is one chain across its rows: each
segment's values come from the critic on that segment's own tokens, and the last action token of
segment k links to the first of segment k+1 as across an observation, so the return is carried from
the episode's end through every segment (docs/algorithm.md §4).
"""

from __future__ import annotations

import torch


def length_adaptive_lambda(num_action_tokens: torch.Tensor, alpha: float = 1.5) -> torch.Tensor:
    """lambda_policy = clip(1 - 1/(alpha * l), 0, 1) per trajectory; l = its action-token count."""
    length = num_action_tokens.to(torch.float32).clamp(min=1.0)
    return (1.0 - 1.0 / (alpha * length)).clamp(0.0, 1.0)


def _episode_index(episodes: torch.Tensor | None, B: int, device) -> tuple[torch.Tensor, int]:
    """(each row's episode as 0..E-1, E); rows without `episodes` are an episode each."""
    if episodes is None:
        return torch.arange(B, device=device), B
    uniq, inverse = torch.unique(episodes.to(device), return_inverse=True)
    return inverse, len(uniq)


def episode_totals(per_row: torch.Tensor, episodes: torch.Tensor | None) -> torch.Tensor:
    """(B,) the sum of `per_row` over each row's episode (per_row itself without segments)."""
    if episodes is None:
        return per_row
    e, E = _episode_index(episodes, per_row.shape[0], per_row.device)
    return torch.zeros(E, dtype=per_row.dtype, device=per_row.device).index_add_(0, e, per_row)[e]


def skip_observation_gae(
    rewards: torch.Tensor,  # (B, T) reward on the last action token, 0 elsewhere
    values: torch.Tensor,  # (B, T) V(s_t) at action positions
    action_mask: torch.Tensor,  # (B, T) 1 on action tokens
    gamma: float,
    lam: float | torch.Tensor,  # scalar or (B,)
    episodes: torch.Tensor | None = None,  # (B,) rows of one episode, in order; None: every row its own
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (advantages, returns), both (B, T), zero off the action mask; the same numbers as
    `skip_observation_gae_reference`, with the loop over action tokens only (A, not T steps).

    The action tokens of each episode (a row, or its rows in order) are gathered in order into (E, A),
    where the chain has no gaps: delta_i = r_i + gamma * V_{i+1} - V_i (V = 0 past the last one:
    terminal) and A_i = delta_i + gamma * lam * A_{i+1}. An episode's rows share one lambda (its first
    row's).
    """
    B, T = rewards.shape
    dev = values.device
    mask = action_mask.to(torch.bool)
    lam_t = torch.as_tensor(lam, dtype=values.dtype).expand(B) if not torch.is_tensor(lam) else lam.to(values.dtype)
    e, E = _episode_index(episodes, B, dev)
    counts = mask.sum(1)  # action tokens per row
    per_episode = torch.nn.functional.one_hot(e, E) * counts[:, None]  # (B, E)
    earlier = per_episode.cumsum(0)[torch.arange(B, device=dev), e] - counts  # in the episode's earlier rows
    rows, cols = mask.nonzero(as_tuple=True)  # action tokens, row-major: in order within a row
    rank = earlier[rows] + mask.cumsum(1)[rows, cols] - 1  # index of each among its episode's action tokens
    key = e[rows]
    A = int(rank.max()) + 1 if rank.numel() else 0
    v = torch.zeros(E, A + 1, dtype=values.dtype, device=dev)  # one extra column: the terminal V = 0
    r = torch.zeros(E, A, dtype=values.dtype, device=dev)
    v[key, rank] = values[rows, cols]
    r[key, rank] = rewards[rows, cols].to(values.dtype)
    delta = r + gamma * v[:, 1:] - v[:, :-1]  # (E, A); 0 past each episode's last action token
    first = torch.full((E,), B, device=dev).scatter_reduce_(0, e, torch.arange(B, device=dev), "amin")
    lam_e = lam_t.to(dev)[first] if B else lam_t.to(dev)  # each episode's first row's
    c = gamma * lam_e  # (E,)
    adv = torch.empty_like(delta)
    nxt = torch.zeros(E, dtype=values.dtype, device=dev)
    for i in reversed(range(A)):
        nxt = delta[:, i] + c * nxt
        adv[:, i] = nxt
    advantages = torch.zeros_like(values)
    advantages[rows, cols] = adv[key, rank]
    returns = (advantages + values) * action_mask
    return advantages, returns


def skip_observation_gae_reference(
    rewards: torch.Tensor,  # (B, T) reward on the last action token, 0 elsewhere
    values: torch.Tensor,  # (B, T) V(s_t) at action positions
    action_mask: torch.Tensor,  # (B, T) 1 on action tokens
    gamma: float,
    lam: float | torch.Tensor,  # scalar or (B,)
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence as written, one position at a time (the reference `skip_observation_gae` is
    tested against). Return (advantages, returns), both (B, T) and zero off the action mask.

    for p in reversed(action positions):
        delta_p = r_p + gamma * V_next - V_p
        A_p     = delta_p + gamma * lam * A_next
        V_next, A_next = V_p, A_p            (start: V_next = 0, A_next = 0, terminal)
    returns R_p = A_p + V_p.
    """
    B, T = rewards.shape
    mask = action_mask.to(torch.bool)
    lam_t = torch.as_tensor(lam, dtype=values.dtype).expand(B) if not torch.is_tensor(lam) else lam.to(values.dtype)
    advantages = torch.zeros_like(values)
    next_value = torch.zeros(B, dtype=values.dtype)  # (B,)
    next_adv = torch.zeros(B, dtype=values.dtype)  # (B,)
    for t in reversed(range(T)):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam_t * next_adv
        advantages[:, t] = torch.where(m, adv, torch.zeros_like(adv))
        next_value = torch.where(m, values[:, t], next_value)
        next_adv = torch.where(m, adv, next_adv)
    returns = (advantages + values) * action_mask
    return advantages, returns


def turn_spans(action_mask_row: torch.Tensor) -> list[list[int]]:
    """Positions of each turn: a turn is a maximal run of consecutive action tokens."""
    runs: list[list[int]] = []
    for p in action_mask_row.nonzero().flatten().tolist():
        if runs and p == runs[-1][-1] + 1:
            runs[-1].append(p)
        else:
            runs.append([p])
    return runs


STEP_VALUE_MODES = ("state", "mean", "last")


def _turn_value(values_row: torch.Tensor, run: list[int], mode: str) -> torch.Tensor:
    if mode == "state":
        return values_row[run[0]]
    return values_row[run[-1]] if mode == "last" else values_row[run].mean()


def step_level_values(values: torch.Tensor, action_mask: torch.Tensor, mode: str = "state") -> torch.Tensor:
    """Ablation (paper App. A.1): one value per turn, broadcast over that turn's action tokens.

    `values[:, t]` is V(prefix before token t) (sao/models/critic.py), so `mode`:
    - "state": the value of the state the turn starts from, read at the last token before it (the
      paper's last-token value of a step's state); what a step-level MDP's V(s_i) is;
    - "mean": the mean over the turn's action tokens;
    - "last": the value before the turn's last action token. It has seen almost the whole action, so
      in a one-turn episode the advantage R - V is close to 0 and the policy gets no signal (measured:
      `sao bench ablation`, held-out 0.33 -> 0.25); kept to show why "state" is the default.
    """
    if mode not in STEP_VALUE_MODES:
        raise ValueError(f"step-level value mode must be one of {', '.join(STEP_VALUE_MODES)}, got {mode!r}")
    out = torch.zeros_like(values)
    for b in range(values.shape[0]):
        for run in turn_spans(action_mask[b]):
            out[b, run] = _turn_value(values[b], run, mode)
    return out


def step_level_gae(
    rewards: torch.Tensor,  # (B, T) reward on the last action token, 0 elsewhere
    values: torch.Tensor,  # (B, T) V at action positions (per token or already per turn)
    action_mask: torch.Tensor,  # (B, T)
    gamma: float,
    alpha: float,
    mode: str = "state",
    episodes: torch.Tensor | None = None,  # (B,) rows of one episode, in order; None: every row its own
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step-level GAE (paper App. A.1): one advantage per turn, broadcast to that turn's action tokens.

    Per episode (a row, or its rows in order) with turns i = 0..n-1, V_i = the turn's value (`mode`),
    r_i = reward inside turn i, lambda = clip(1 - 1/(alpha * n), 0, 1) from the number of turns n (not tokens):
        for i in reversed(range(n)):
            delta_i = r_i + gamma * V_{i+1} - V_i        (V_n = 0: terminal)
            A_i     = delta_i + gamma * lambda * A_{i+1}
    Returns (advantages (B, T), lambdas (B,)).
    """
    advantages = torch.zeros_like(values)
    lambdas = torch.zeros(values.shape[0], dtype=values.dtype)
    e, E = _episode_index(episodes, values.shape[0], torch.device("cpu"))
    for k in range(E):
        rows = (e == k).nonzero().flatten().tolist()
        turns = [(b, run) for b in rows for run in turn_spans(action_mask[b])]
        lam = float(length_adaptive_lambda(torch.tensor(float(len(turns))), alpha))
        lambdas[rows] = lam
        next_value, next_adv = 0.0, 0.0
        for b, run in reversed(turns):
            v = float(_turn_value(values[b], run, mode))
            adv = float(rewards[b, run].sum()) + gamma * next_value - v + gamma * lam * next_adv
            advantages[b, run] = adv
            next_value, next_adv = v, adv
    return advantages, lambdas
