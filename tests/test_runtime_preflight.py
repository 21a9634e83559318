"""Runtime combinations that would hang or silently misbehave are refused before anything starts."""

import time

import pytest


@pytest.mark.parametrize("args, words", [
    (["runtime.max_lag=0", "runtime.sync_every=2"], "runtime.sync_every=2 > runtime.max_lag + 1"),
    (["runtime.max_lag=1", "runtime.sync_every=3"], "runtime.sync_every=3 > runtime.max_lag + 1"),
    (["runtime.mode=sync", "runtime.rollout_workers=2"], "runtime.mode=sync"),
    (["runtime.ray_address=auto"], "runtime.ray_address is set but runtime.backend=local"),
    (["runtime.rollout_workers=0"], "runtime.rollout_workers"),
    (["runtime.backend=ray", "runtime.ray_address=127.0.0.1:9", "runtime.ray_connect_timeout_s=2"],
     "runtime.ray_address: no Ray cluster answers at 127.0.0.1:9 within 2s (runtime.ray_connect_timeout_s; "),
    (["runtime.backend=ray", "runtime.ray_address=my-cluster"], "runtime.ray_address: 'my-cluster' is not 'auto' or"),
    (["runtime.receive_timeout_s=0"], "runtime.receive_timeout_s"),
    (["runtime.mode=sync", "runtime.rollout_only=true"], "runtime.rollout_only measures the async rollout side"),
    (["trainer.rank_num_cpus=0"], "trainer: rank_num_cpus and rank_num_gpus are both 0"),
    (["trainer.rank_num_gpus=0.5"], "trainer: rank_num_gpus must be 0 or a whole number"),
    (["critic.ranks=2"], "critic.ranks: 2 critic ranks need critic.placement=separate"),
    (["critic.placement=separate", "critic.ranks=8", "train.batch_size=4"], "critic.ranks: 8 ranks need at least 8"),
])
def test_refused_in_one_line_before_anything_is_written(tmp_path, sao_cli, args, words):
    proc = sao_cli("train", *args, "--quiet", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], proc.stderr
    assert not list(tmp_path.iterdir())  # no run directory, no cache


def test_an_unreachable_ray_address_is_refused_within_its_bound(tmp_path, sao_cli):
    """ray.init(address=...) with no cluster there retried for over 12 minutes, printing only Ray's warnings."""
    t0 = time.monotonic()
    proc = sao_cli("train", "runtime.backend=ray", "runtime.ray_address=127.0.0.1:9", "runtime.ray_connect_timeout_s=3",
                   "--quiet", cwd=tmp_path)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert 3 <= time.monotonic() - t0 < 30


def test_sync_flag_with_several_workers_is_refused(tmp_path, sao_cli):
    proc = sao_cli("train", "runtime.rollout_workers=2", "--sync", "--quiet", cwd=tmp_path)
    assert proc.returncode == 2 and "runtime.mode=sync" in proc.stderr


def test_resume_needs_a_run_with_a_checkpoint(tmp_path, sao_cli):
    proc = sao_cli("train", "--resume", str(tmp_path / "nope"), cwd=tmp_path)
    assert proc.returncode == 2 and "--resume" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
