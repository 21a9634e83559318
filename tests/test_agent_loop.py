"""The agent loop: exact token sequences, masks, reward on the last action token, statuses."""

import asyncio

import pytest

from sao.envs import make_environment
from sao.envs.base import StepResult
from sao.rollout.agent_loop import EpisodeLimits, run_episode
from sao.types import Generation, SamplingParams, Status, Task


class ScriptedEngine:
    """Replays fixed assistant turns, so the test can check every token the loop appends."""

    def __init__(self, codec, turns, version=7):
        self.codec, self.turns, self.version, self.prompts = codec, list(turns), version, []
        self.sessions, self.released = [], []

    async def generate(self, prompt_ids, params, session=None):
        self.prompts.append(list(prompt_ids))
        self.sessions.append(session)
        ids = self.codec.action_ids(self.turns.pop(0))[: params.max_new_tokens]
        stop = ids[-1] == self.codec.eos_id
        return Generation(ids, [-0.5] * len(ids), [self.version] * len(ids), "stop" if stop else "length")

    def release(self, session):
        self.released.append(session)


def _run(env, task, engine, codec, **limits):
    return asyncio.run(run_episode(env, task, engine, codec, SamplingParams(), EpisodeLimits(**limits)))


def test_two_turn_episode_tokens_mask_and_reward(tiny):
    _, codec = tiny
    env = make_environment("calc", {}, seed=0).new_episode(None)
    engine = ScriptedEngine(codec, ["<calc>6*7</calc>", "<answer>42</answer>"])
    traj = _run(env, Task("t", "6*7", 42), engine, codec)
    conv = [{"role": "user", "content": "6*7"}]
    p = codec.prompt_ids(conv)
    a1, o1 = codec.action_ids("<calc>6*7</calc>"), codec.observation_ids("<result>42</result>")
    a2 = codec.action_ids("<answer>42</answer>")
    assert traj.token_ids == p + a1 + o1 + a2  # tokens in, tokens out: nothing re-tokenized
    assert traj.action_mask == [0] * len(p) + [1] * len(a1) + [0] * len(o1) + [1] * len(a2)
    assert engine.prompts[1] == p + a1 + o1  # the second turn continues from exactly those tokens
    assert engine.sessions == [traj.id] * 2 and engine.released == [traj.id]  # one KV session per episode
    assert traj.behavior_logprobs == [0.0] * len(p) + [-0.5] * len(a1) + [0.0] * len(o1) + [-0.5] * len(a2)
    assert [v for v, m in zip(traj.token_versions, traj.action_mask) if m] == [7] * (len(a1) + len(a2))
    assert (traj.status, traj.reward, traj.turns, traj.prompt_len) == (Status.OK, 1.0, 2, len(p))
    # the trainer puts the reward on the last action token, never on an observation or padding
    from sao.trainer.batch import collate

    batch = collate([traj], codec.tokenizer.pad_token_id)
    assert batch.rewards[0].nonzero().flatten().tolist() == [len(traj.token_ids) - 1]
    assert batch.action_mask[0, -1] == 1


def test_turn_limit_truncates(tiny):
    _, codec = tiny
    env = make_environment("calc", {}, seed=0).new_episode(None)
    traj = _run(env, Task("t", "1+1", 2), ScriptedEngine(codec, ["<calc>1+1</calc>"] * 3), codec, max_turns=3)
    assert traj.status == Status.TRUNCATED and traj.turns == 3 and traj.reward == 0.0


def test_action_token_limit_truncates(tiny):
    _, codec = tiny
    env = make_environment("calc", {}, seed=0).new_episode(None)
    traj = _run(env, Task("t", "1+1", 2), ScriptedEngine(codec, ["<answer>2</answer>"]), codec, max_action_tokens=2)
    assert traj.status == Status.TRUNCATED and traj.status_reason == "action token limit"


class Boom:
    def reset(self, task):
        return [{"role": "user", "content": "x"}]

    def step(self, action):
        raise RuntimeError("tool backend is down")


class Slow:
    def reset(self, task):
        return [{"role": "user", "content": "x"}]

    async def step(self, action):
        await asyncio.sleep(5)
        return StepResult("", 1.0, True)


@pytest.mark.parametrize("env,status,reason", [(Boom(), Status.ENV_ERROR, "RuntimeError: tool backend is down"),
                                               (Slow(), Status.TIMEOUT, "environment step over 0.05s")])
def test_environment_failures_end_only_the_episode(tiny, env, status, reason):
    _, codec = tiny
    traj = _run(env, Task("t", "x"), ScriptedEngine(codec, ["a"]), codec, step_timeout_s=0.05)
    assert traj.status == status and traj.status_reason == reason and traj.reward == 0.0


class Hang:
    def reset(self, task):
        return [{"role": "user", "content": "x"}]

    def step(self, action):  # a plain (sync) step that hangs
        import time

        time.sleep(2)
        return StepResult("", 1.0, True)


def test_a_hanging_sync_environment_times_out(tiny):
    _, codec = tiny
    traj = _run(Hang(), Task("t", "x"), ScriptedEngine(codec, ["a"]), codec, step_timeout_s=0.1)
    assert traj.status == Status.TIMEOUT


def test_seeded_evaluation_episodes_have_their_own_seeds(tiny):
    """`run_episodes` with a seed gives episode i the seed `episode_seed(seed, i, task.id)`: a task listed
    twice is played twice with different draws, and the same list with the same seed replays exactly, whatever
    the engine's batch size (held-out evaluations of two arms share their random numbers)."""
    from sao.engine.torch_engine import TorchEngine
    from sao.envs.base import EpisodeContext
    from sao.rollout.agent_loop import run_episodes

    model, codec = tiny
    env = make_environment("calc", {}, seed=0)
    tasks = [Task("a", "6*7", 42), Task("a", "6*7", 42), Task("b", "2+3", 5)]
    limits = EpisodeLimits(max_turns=2, max_action_tokens=8, max_episode_tokens=200)

    def play(max_batch, seed):
        engine = TorchEngine(model, codec.tokenizer.pad_token_id, max_batch=max_batch, seed=max_batch)
        return [t.token_ids for t in asyncio.run(run_episodes(engine, env, codec, tasks, SamplingParams(seed=seed),
                                                              limits, EpisodeContext))]

    first = play(8, 0)
    assert play(1, 0) == first
    assert first[0] != first[1]  # the same task twice: two episodes, not one replayed
    assert play(8, 1) != first
