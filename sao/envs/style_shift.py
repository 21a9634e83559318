"""`style_shift`: online learning with a reward that changes over time (paper §4.5, small scale).

The prompt lists candidate styles; the model picks one and solves a small addition:

    user:      styles: chuuni cute plain classical
               3+4
    assistant: <style>cute</style><answer>7</answer>

Reward = (answer correct) x (chosen style is the *currently rewarded* style). The rewarded style
switches at configured trainer steps (the episode learns the step from its `EpisodeContext`), and
each phase may list different candidates. SFT demos pick a listed style uniformly at random, so the
warm-started policy has no preference and RL must find the rewarded style, then re-find it after
every switch. Each episode reports `chose_<style>` = 1 for the style it chose, which the run logs
as per-style choice rates (train batches and held-out evaluations).
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator

from pydantic import BaseModel, ConfigDict, Field, model_validator

from sao.envs.base import EpisodeContext, Message, StepResult, register_environment
from sao.envs.latency import LatencyOptions, with_latency
from sao.envs.splits import SplitOptions, is_heldout, split_side
from sao.types import Task

_STYLE = re.compile(r"<style>(.*?)</style>", re.S)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
POOL = ["cute", "chuuni", "classical", "plain", "pirate", "formal"]


class Phase(BaseModel):
    model_config = ConfigDict(extra="forbid")
    start: int = Field(ge=0, description="first trainer step of this phase")
    rewarded: str = Field(description="the style that earns reward in this phase")
    candidates: list[str] = Field(min_length=2, description="styles listed in the prompt")

    @model_validator(mode="after")
    def _listed(self) -> Phase:
        if self.rewarded not in self.candidates:
            raise ValueError(f"rewarded style {self.rewarded!r} is not among the candidates")
        return self


def _default_phases() -> list[Phase]:
    """cute -> chuuni -> classical (the paper's order). Each switch also retires the style rewarded
    before it: a tiny policy saturates on a style within a phase (p ~ 1, so its policy gradient
    vanishes) and without exploration never samples the new one while the old one is still listed."""
    return [Phase(start=0, rewarded="cute", candidates=["cute", "chuuni", "classical", "plain"]),
            Phase(start=100, rewarded="chuuni", candidates=["chuuni", "classical", "plain", "pirate"]),
            Phase(start=200, rewarded="classical", candidates=["classical", "plain", "pirate", "formal"])]


class StyleShiftOptions(SplitOptions, LatencyOptions):
    heldout_fraction: float = Field(0.2, gt=0, lt=1, description="share of the 100 sums a+b held out (hash split)")
    phases: list[Phase] = Field(default_factory=_default_phases, min_length=1, description="reward schedule")
    pool: list[str] = Field(default_factory=lambda: list(POOL), description="styles SFT demos draw candidates from")
    demo_candidates: int = Field(4, ge=2, description="candidates listed in an SFT demo prompt")
    max_operand: int = Field(9, ge=1, le=99, description="largest addend")

    @model_validator(mode="after")
    def _ordered(self) -> StyleShiftOptions:
        starts = [p.start for p in self.phases]
        if starts[0] != 0 or starts != sorted(set(starts)):
            raise ValueError("phases must start at step 0 and have increasing start steps")
        missing = {s for p in self.phases for s in p.candidates} - set(self.pool)
        if missing:
            raise ValueError(f"styles {sorted(missing)} are not in the pool (the SFT demos never show them)")
        return self

    def phase_at(self, step: int) -> Phase:
        return [p for p in self.phases if p.start <= step][-1]


def _prompt(candidates: list[str], problem: str) -> str:
    return f"styles: {' '.join(candidates)}\n{problem}"


class StyleShiftEpisode:
    def __init__(self, options: StyleShiftOptions, ctx: EpisodeContext):
        self.options, self.phase = options, options.phase_at(ctx.trainer_step)
        self.answer: int | None = None

    def reset(self, task: Task) -> list[Message]:
        self.answer = int(task.answer)
        order = list(self.phase.candidates)
        random.Random(task.id).shuffle(order)  # order varies by task, so position carries no signal
        return [{"role": "user", "content": _prompt(order, task.prompt)}]

    def step(self, action: str) -> StepResult:
        style = _STYLE.search(action)
        answer = _ANSWER.search(action)
        chosen = style.group(1).strip() if style else ""
        try:
            correct = answer is not None and int(answer.group(1).strip()) == self.answer
        except ValueError:
            correct = False
        info = {f"chose_{s}": float(chosen == s) for s in self.options.pool}
        info.update({"correct": float(correct), "style_match": float(chosen == self.phase.rewarded)})
        return StepResult("", float(correct and chosen == self.phase.rewarded), True, info)


class StyleShiftEnvironment:
    """Registered as `style_shift`."""

    Options = StyleShiftOptions
    # its actor lr (2e-4; calc's 5e-4 collapses this policy) is a recipe: examples/configs/style_shift.yaml

    def __init__(self, options: StyleShiftOptions, seed: int = 0):
        self.options, self.seed = options, seed
        self._latency_rng = random.Random(seed)  # env.options.step_latency_s (sao/envs/latency.py)

    def _heldout(self, problem: str) -> bool:  # by data_seed, not train.seed: one held-out set for every run
        return is_heldout(problem, self.options.heldout_fraction, self.options.data_seed)

    def _stream(self, seed: int, split: str, heldout: bool) -> Iterator[Task]:
        rng, m = random.Random(seed), self.options.max_operand

        def draw() -> Task:
            a, b = rng.randint(0, m), rng.randint(0, m)
            return Task(id="", prompt=f"{a}+{b}", answer=a + b)

        return split_side(draw, heldout, self._heldout, f"style-{split}")

    def train_tasks(self) -> Iterator[Task]:
        return self._stream(self.seed, "train", heldout=False)

    def eval_tasks(self, n: int) -> list[Task]:
        # ~24 distinct sums are held out at the defaults; repeats are kept (at random, as drawn), each
        # with its own id and so its own order of the candidates
        stream = self._stream(self.options.data_seed + 7919, "eval", heldout=True)
        return [next(stream) for _ in range(n)]

    def new_episode(self, ctx: EpisodeContext) -> StyleShiftEpisode:
        return with_latency(StyleShiftEpisode(self.options, ctx or EpisodeContext()), self.options, self._latency_rng)

    def demo(self, task: Task, rng: random.Random) -> list[Message]:
        candidates = rng.sample(self.options.pool, self.options.demo_candidates)
        style = rng.choice(candidates)
        return [{"role": "user", "content": _prompt(candidates, task.prompt)},
                {"role": "assistant", "content": f"<style>{style}</style><answer>{task.answer}</answer>"}]


register_environment("style_shift", StyleShiftEnvironment)
