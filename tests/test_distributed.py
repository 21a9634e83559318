"""N trainer ranks equal one process: real gloo process groups on 127.0.0.1 (sao/trainer/distributed.py).

Each case takes two optimizer steps (a critic warm-up step, then a full step) on one batch whose
trajectories have uneven real token counts, so every rank holds a different number of action
tokens; the actor and critic weights after the steps and every logged metric must match the
one-process `Learner` on the whole batch. The same step in bf16 (FSDP mixed precision, the GPU
layout) stays within 1% of fp32.
"""

import math

import pytest
import torch

from sao.algo.registry import get_algorithm
from sao.config import AlgoConfig, CriticConfig, LoraSettings, TrainConfig
from sao.trainer.batch import collate
from sao.trainer.launch import spawn_ranks
from sao.trainer.learner import Learner
from sao.types import Trajectory

# name -> (algorithm, AlgoConfig overrides, LoRA rank of the actor and the critic)
CASES = {
    "sao": ("sao", {}, 0),
    "grpo": ("grpo", {"group_size": 2, "ppo_minibatches": 2}, 0),
    "vapo": ("vapo", {"ppo_minibatches": 3}, 0),
    "running_mean": ("running_mean", {"entropy_coef": 0.01}, 0),  # the entropy bonus too
    "sao_lora": ("sao", {}, 4),
}
TIMEOUT_S = 60  # a rank that hangs fails the test in a minute, not the 10-minute default


def _models(model_dir, lora: int):
    from sao.models.critic import build_critic
    from sao.models.lora import with_lora
    from sao.models.tiny import load_model

    torch.manual_seed(0)
    actor = with_lora(load_model(model_dir), LoraSettings(r=lora))
    critic = with_lora(build_critic(model_dir), LoraSettings(r=lora), value_head=True)
    return actor, critic


def _batch(actor, n: int = 6, group_size: int = 2):
    """n trajectories of 6..30 tokens, one or two turns; behavior log-probs = the actor's own + noise,
    so DIS masks some tokens on both sides."""
    from sao.models.actor import sequence_logprobs

    gen = torch.Generator().manual_seed(1)
    trajs = []
    for i in range(n):
        p, a = int(torch.randint(3, 8, (1,), generator=gen)), int(torch.randint(2, 22, (1,), generator=gen))
        ids = torch.randint(3, 40, (p + a,), generator=gen).tolist()
        mask = [0] * p + [1] * a
        if i % 3 == 0 and a > 6:  # a second turn: an observation in the middle of the action tokens
            mask[p + 3:p + 5] = [0, 0]
        with torch.no_grad():
            lp = sequence_logprobs(actor, torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))[0]
        lp = lp + 0.4 * torch.randn(len(ids), generator=gen)
        trajs.append(Trajectory(str(i), f"g{i // group_size}", ids, mask, [x * m for x, m in zip(lp.tolist(), mask)],
                                [0 if m else -1 for m in mask], p, reward=float(i % 3 == 1) + 0.1 * i))
    batch = collate(trajs, pad_id=0)
    batch.trace_rows = n  # every row's per-token record (sao/trainer/trace.py): at 2 ranks, gathered from both
    return batch


def _configs(case: str):
    algo, overrides, lora = CASES[case]
    return (get_algorithm(algo), AlgoConfig(name=algo, **overrides), CriticConfig(warmup_steps=1),
            TrainConfig(lr=1e-3), lora)


def _run(learner, batch) -> list[dict]:
    return [learner.step(batch) for _ in range(2)]


def _one_process(model_dir, case: str) -> dict:
    algo, algo_cfg, critic_cfg, train_cfg, lora = _configs(case)
    actor, critic = _models(model_dir, lora)
    batch = _batch(actor)
    learner = Learner(actor, critic if algo.uses_critic else None, algo, algo_cfg, critic_cfg, train_cfg)
    metrics = _run(learner, batch)
    from sao.models.lora import engine_parameters

    critic_w = [p.detach().clone() for p in critic.parameters()] if algo.uses_critic else []
    return {"metrics": metrics, "actor": [p.detach().clone() for p in engine_parameters(actor)], "critic": critic_w}


def _rank(rank: int, world: int, port: int, model_dir, cases: list[str], out_dir) -> None:
    """One trainer rank: every case on the full batch; rank 0 writes what it gathered."""
    from sao.trainer.distributed import DistributedLearner, init_ranks

    torch.set_num_threads(1)  # two ranks on two cores
    init_ranks(rank, world, port, timeout_s=TIMEOUT_S)
    results = {}
    for case in cases:
        algo, algo_cfg, critic_cfg, train_cfg, lora = _configs(case)
        actor, critic = _models(model_dir, lora)
        batch = _batch(actor)
        learner = DistributedLearner(actor, critic if algo.uses_critic else None, algo, algo_cfg, critic_cfg,
                                     train_cfg)
        metrics = _run(learner, batch)
        critic_w = [p.full_tensor().detach() for p in learner.critic.parameters()] if algo.uses_critic else []
        results[case] = {"metrics": metrics, "actor": learner.export_weights(bucket_bytes=64 * 1024),
                         "critic": critic_w, "rows": learner._rows}
    algo, algo_cfg, critic_cfg, train_cfg, _ = _configs("sao")  # the GPU layout: bf16 params, fp32 reduce
    actor, critic = _models(model_dir, 0)
    batch = _batch(actor)
    learner = DistributedLearner(actor, critic, algo, algo_cfg, critic_cfg, train_cfg, mixed_precision=True)
    results["sao_bf16"] = {"metrics": _run(learner, batch)}
    if rank == 0:
        torch.save(results, f"{out_dir}/ranks.pt")
    import torch.distributed as dist

    dist.destroy_process_group()


def test_shard_rows_balances_tokens_keeps_groups_whole_and_feeds_every_rank():
    from sao.trainer.distributed import shard_rows

    assert shard_rows([10, 1, 1, 1, 1, 10], None, 2) == [[0, 1, 2], [3, 4, 5]]  # 12 tokens each
    assert shard_rows([5] * 6, ["a", "a", "b", "b", "c", "c"], 2) == [[0, 1, 2, 3], [4, 5]]  # groups whole
    assert shard_rows([100, 1, 1], None, 3) == [[0], [1], [2]]  # a rank with few tokens still gets a row
    # a segmented episode's rows (Batch.unit_keys) stay on one rank: its GAE runs across them
    assert shard_rows([5, 5, 5, 1, 1, 5], ["0", "0", "0", "1", "1", "2"], 2) == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(ValueError, match="2 groups or episodes cannot be split over 3"):
        shard_rows([5] * 4, ["a", "a", "b", "b"], 3)


def _same_traces(one: list[dict], many: list[dict]) -> list[str]:
    """Per-token records: every row once, in order, the same values (to the records' 6 digits)."""
    if [r["row"] for r in one] != [r["row"] for r in many] or len(one) != 6:
        return [f"rows {[r['row'] for r in one]} vs {[r['row'] for r in many]}"]
    bad = []
    for a, b in zip(one, many):
        for k in sorted(set(a) | set(b)):
            x, y = a.get(k), b.get(k)
            if isinstance(x, dict):
                x, y = list(x.values()), list(y.values())
            pairs = list(zip(x, y)) if isinstance(x, list) and isinstance(y, list) and len(x) == len(y) else [(x, y)]
            if not all(u == v or (isinstance(u, float) and isinstance(v, float)
                                  and math.isclose(u, v, rel_tol=1e-4, abs_tol=1e-5)) for u, v in pairs):
                bad.append(f"row {a['row']} {k}")
    return bad


def _same_metrics(one: dict, many: dict) -> list[str]:
    one, many = dict(one), dict(many)
    bad = _same_traces(one.pop("trace", []), many.pop("trace", []))
    for k in sorted(set(one) | set(many)):
        if k.startswith("perf/") and k != "perf/train_tokens":
            continue  # timings, and packed positions that depend on each rank's rows
        a, b = one.get(k), many.get(k)
        if a is None or b is None or not (math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-5)
                                          or (math.isnan(a) and math.isnan(b))):
            bad.append(f"{k}: {a} vs {b}")
    return bad


def _max_diff(xs: list[torch.Tensor], ys: list[torch.Tensor]) -> float:
    assert len(xs) == len(ys) and all(x.shape == y.shape for x, y in zip(xs, ys))
    return max((float((x - y).abs().max()) for x, y in zip(xs, ys) if x.numel()), default=0.0)


def test_two_ranks_equal_one_process(tiny_model_dir, tmp_path):
    cases = list(CASES)
    spawn_ranks(_rank, 2, str(tiny_model_dir), cases, str(tmp_path))
    ranks = torch.load(tmp_path / "ranks.pt")
    for case in cases:
        one, two = _one_process(tiny_model_dir, case), ranks[case]
        assert len(two["rows"]) not in (0, 6), case  # the batch really was split
        for s, (m1, m2) in enumerate(zip(one["metrics"], two["metrics"])):
            assert not _same_metrics(m1, m2), (case, s, _same_metrics(m1, m2))
        assert _max_diff(one["actor"], two["actor"]) < 1e-5, case
        assert _max_diff(one["critic"], two["critic"]) < 1e-5, case
    # bf16 compute (FSDP MixedPrecisionPolicy, as on GPU): really in bf16, and close to fp32
    fp32, bf16 = ranks["sao"]["metrics"][1], ranks["sao_bf16"]["metrics"][1]
    assert fp32["critic/value_loss"] != bf16["critic/value_loss"]
    for k in ("critic/value_loss", "critic/grad_norm", "adv/mean_raw", "loss/policy", "actor/grad_norm", "dis/ratio_mean"):
        assert math.isclose(fp32[k], bf16[k], rel_tol=1e-2), (k, fp32[k], bf16[k])


def _flat(state, prefix=""):
    """(path, leaf) pairs of a nested state dict, in a stable order."""
    if isinstance(state, dict):
        for k in sorted(state, key=str):
            yield from _flat(state[k], f"{prefix}/{k}")
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            yield from _flat(v, f"{prefix}/{i}")
    else:
        yield prefix, state


def _bit_exact(a: dict, b: dict) -> list[str]:
    fa, fb = dict(_flat(a)), dict(_flat(b))
    if fa.keys() != fb.keys():
        return [f"keys differ: {sorted(fa.keys() ^ fb.keys())[:4]}"]
    return [k for k in fa if not (torch.equal(fa[k], fb[k]) if torch.is_tensor(fa[k]) else fa[k] == fb[k])]


def _export_is_exact(model_dir) -> None:
    """The LoRA actor's merged weights from shards equal the unsharded merge bit for bit, at any bucket size."""
    from sao.models.lora import engine_parameters
    from sao.trainer.distributed import DistributedLearner

    algo, algo_cfg, critic_cfg, train_cfg, _ = _configs("sao")
    actor, critic = _models(model_dir, 4)
    with torch.no_grad():  # nonzero adapters, so the merge matters
        for name, p in actor.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
        expected = [t.detach().clone() for t in engine_parameters(actor)]
    learner = DistributedLearner(actor, critic, algo, algo_cfg, critic_cfg, train_cfg)
    for bucket_bytes in (1, 64 * 1024, 2**30):
        got = learner.export_weights(bucket_bytes)
        if learner.rank != 0:
            assert got == [], "only rank 0 keeps the gathered weights"
            continue
        assert len(got) == len(expected) and all(torch.equal(x, y) for x, y in zip(got, expected)), bucket_bytes
    buckets = list(learner.export_buckets(64 * 1024))
    assert len(buckets) > 1  # really bucketed


def _checkpoint_rank(rank: int, world: int, port: int, model_dir, out_dir) -> None:
    """Export check; load the one-process checkpoint at 2 ranks; step; save at 2 ranks."""
    from sao.trainer.distributed import DistributedLearner, init_ranks
    from sao.trainer.sharded_checkpoint import full_state, load_sharded, save_sharded

    torch.set_num_threads(1)
    init_ranks(rank, world, port, timeout_s=TIMEOUT_S)
    _export_is_exact(model_dir)
    algo, algo_cfg, critic_cfg, train_cfg, _ = _configs("sao")
    actor, critic = _models(model_dir, 0)
    batch = _batch(actor)
    learner = DistributedLearner(actor, critic, algo, algo_cfg, critic_cfg, train_cfg)
    load_sharded(learner, f"{out_dir}/one")
    loaded = full_state(learner)
    learner.step(batch)
    save_sharded(learner, f"{out_dir}/two")
    saved = full_state(learner)
    if rank == 0:
        torch.save({"loaded": loaded, "saved": saved, "version": learner.actor_version}, f"{out_dir}/ranks.pt")
    import torch.distributed as dist

    dist.destroy_process_group()


@pytest.mark.slow  # 14-32 s here (by load): two spawned ranks, three DCP round trips
def test_export_and_checkpoints_across_rank_counts(tiny_model_dir, tmp_path):
    """Bucketed export from shards is exact; a DCP checkpoint saved at 1 rank loads at 2 and one saved
    at 2 loads at 1, bit for bit (models, both AdamW states, counters)."""
    from sao.trainer.sharded_checkpoint import full_state, load_sharded, save_sharded

    algo, algo_cfg, critic_cfg, train_cfg, _ = _configs("sao")
    actor, critic = _models(tiny_model_dir, 0)
    batch = _batch(actor)
    one = Learner(actor, critic, algo, algo_cfg, critic_cfg, train_cfg)
    _run(one, batch)  # warm-up step, then a full one: every AdamW state exists
    save_sharded(one, tmp_path / "one")
    saved_at_one = full_state(one)
    spawn_ranks(_checkpoint_rank, 2, str(tiny_model_dir), str(tmp_path))
    ranks = torch.load(tmp_path / "ranks.pt")
    assert not _bit_exact(saved_at_one, ranks["loaded"])  # 1 -> 2
    assert ranks["version"] == 2
    fresh = Learner(*_models(tiny_model_dir, 0), algo, algo_cfg, critic_cfg, train_cfg)
    load_sharded(fresh, tmp_path / "two")  # 2 -> 1
    assert not _bit_exact(ranks["saved"], full_state(fresh))
    assert (fresh.actor_version, fresh.critic_version, fresh.steps_done) == (2, 6, 3)


def _dying_rank(rank: int, world: int, port: int) -> None:
    import os
    import signal

    import torch.distributed as dist

    from sao.trainer.distributed import init_ranks

    init_ranks(rank, world, port, timeout_s=5)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.zeros(1))  # rank 0 waits for a rank that is gone


def test_a_dead_rank_stops_the_others_and_is_named():
    import time

    from sao.trainer.launch import RankFailed

    t = time.monotonic()
    with pytest.raises(RankFailed, match="trainer rank 1 exited .*SIGKILL"):
        spawn_ranks(_dying_rank, 2)
    assert time.monotonic() - t < 30


def _build(model_dir, case: str):
    """A rank's learner for `case` (rank 0 in the test process, the followers in spawned ones)."""
    from sao.trainer.distributed import DistributedLearner

    torch.set_num_threads(1)
    algo, algo_cfg, critic_cfg, train_cfg, lora = _configs(case)
    actor, critic = _models(model_dir, lora)
    return DistributedLearner(actor, critic if algo.uses_critic else None, algo, algo_cfg, critic_cfg, train_cfg)


def test_rank_zero_drives_followers_and_names_a_dead_one(tiny_model_dir, tmp_path):
    """The runtime's view: one trainer object in this process (rank 0) whose calls run on every rank;
    killing a follower fails the next call with the rank's name, and nothing is left running."""
    import os
    import signal
    import time

    from sao.trainer.launch import RankFailed
    from sao.trainer.ranks import start_trainer_ranks

    one = _one_process(tiny_model_dir, "vapo")
    driver = start_trainer_ranks(2, _build, (str(tiny_model_dir), "vapo"), timeout_s=TIMEOUT_S)
    try:
        batch = _batch(_models(tiny_model_dir, 0)[0])
        metrics = [driver.step(batch) for _ in range(2)]
        assert not _same_metrics(one["metrics"][1], metrics[1])
        assert _max_diff(one["actor"], driver.export_weights()) < 1e-5
        assert driver.version == 1
        driver.save(tmp_path / "ckpt")
        assert (tmp_path / "ckpt" / "trainer.json").is_file()
        follower = driver.ranks.followers[0]
        os.kill(follower.pid, signal.SIGKILL)
        follower.join()
        t = time.monotonic()
        with pytest.raises(RankFailed, match="trainer rank 1 exited with code -9"):
            driver.step(batch)
        assert time.monotonic() - t < TIMEOUT_S + 5
    finally:
        driver.close(abort=True)
    assert not any(p.is_alive() for p in driver.ranks.followers)


def test_a_learner_error_on_every_rank_is_raised_as_itself(tiny_model_dir):
    """An error the learner raises on every rank alike (here a call with no batch) reaches the caller as
    itself, not as a dead rank, and leaves no follower behind."""
    from sao.trainer.ranks import LEARNER_ERROR, start_trainer_ranks

    driver = start_trainer_ranks(2, _build, (str(tiny_model_dir), "vapo"), timeout_s=TIMEOUT_S)
    try:
        with pytest.raises((AttributeError, TypeError)):
            driver.logprobs(None)
        assert [p.exitcode for p in driver.ranks.followers] == [LEARNER_ERROR]
    finally:
        driver.close(abort=True)
    assert not any(p.is_alive() for p in driver.ranks.followers)


def _config(**overrides):
    from sao.config import load_config

    return load_config(None, [f"{k}={v}" for k, v in overrides.items()])


def _optimizer_steps(state: dict) -> list[float]:
    return [float(s["step"]) for opt in ("actor_opt", "critic_opt") for s in state[opt]["state"].values()]


@pytest.mark.slow  # ~30 s each here: two spawned ranks, one DCP round trip
@pytest.mark.parametrize("lora", [0, 4])
def test_a_one_rank_checkpoint_resumes_on_two_ranks(tiny_model_dir, tmp_path, lora):
    """1 -> 2: a one-process run's checkpoint (HF folders + `Learner.state_dict()`, as sao/runtime writes
    it) loads into two FSDP2 ranks built the way `sao train --resume trainer.ranks=2` builds them; one
    more step there equals the one-process run's second step (weights, both AdamW states, counters);
    with LoRA actor and critic too (adapter folders on the base model, adapter-only AdamW states)."""
    from sao.models.lora import adapter_base
    from sao.models.tokenizer import load_tokenizer
    from sao.trainer.build import rank_learner
    from sao.trainer.ranks import start_trainer_ranks
    from sao.trainer.sharded_checkpoint import full_state, load_sharded

    # critic.warmup_steps=0: the first step moves both AdamW states
    cfg = _config(**{"critic.warmup_steps": 0, "train.lr": 1e-3, "model.lora.r": lora, "critic.lora.r": lora})
    algo = get_algorithm(cfg.algo.name)
    actor, critic = _models(tiny_model_dir, lora)
    batch = _batch(actor)
    one = Learner(actor, critic, algo, cfg.algo, cfg.critic, cfg.train)
    one.step(batch)
    ckpt = tmp_path / "step_000001"
    one.save_pretrained(ckpt, load_tokenizer(tiny_model_dir))
    torch.save(one.state_dict(), tmp_path / "trainer_state.pt")
    expected_metrics = one.step(batch)
    expected = full_state(one)

    model_path = adapter_base(ckpt / "actor") or str(ckpt / "actor")  # as sao/runtime/train.py resumes
    driver = start_trainer_ranks(2, rank_learner, (cfg, model_path, str(ckpt)), timeout_s=TIMEOUT_S)
    try:
        driver.load_state_dict(torch.load(tmp_path / "trainer_state.pt"))
        metrics = driver.step(batch)
        driver.save(tmp_path / "two")
    finally:
        driver.close()
    assert not _same_metrics(expected_metrics, metrics), _same_metrics(expected_metrics, metrics)
    two = Learner(*_models(tiny_model_dir, lora), algo, cfg.algo, cfg.critic, cfg.train)
    load_sharded(two, tmp_path / "two")
    got = full_state(two)
    assert (two.actor_version, two.critic_version, two.steps_done) == (2, 4, 2)
    assert _optimizer_steps(got) == _optimizer_steps(expected) and set(_optimizer_steps(got)) == {2.0, 4.0}
    for part in ("actor", "critic"):
        assert _max_diff(list(expected[part].values()), list(got[part].values())) < 1e-5, part
    for opt in ("actor_opt", "critic_opt"):
        for key in ("exp_avg", "exp_avg_sq"):
            xs = [s[key] for s in expected[opt]["state"].values()]
            ys = [s[key] for s in got[opt]["state"].values()]
            assert _max_diff(xs, ys) < 1e-5, (opt, key)
