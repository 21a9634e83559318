"""The accidents of a newcomer's first hour, each reproduced on the real CLI and real processes: two
runs building one SFT model at once, resuming a finished run, a truncated checkpoint, a full disk,
a killed run with the default settings, two runs started in the same second, slow refusals."""

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from conftest import TINY as BASE

from sao.config import load_config
from sao.runtime import checkpoint
from sao.runtime.model_setup import base_model_key, cache_entry_problem, prepare_base_model
from sao.runtime.run_dir import RunDir

TINY = [*BASE, "output.save_every=2", "model.cache_dir=cache"]  # its own cache: some tests are about the cache
pytestmark = pytest.mark.slow


def _sao(*args, cwd, timeout=300):
    return subprocess.run([sys.executable, "-m", "sao.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def _one_line_error(proc, code=2):
    """Exit `code`, one line on stderr, no traceback."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == code and len(lines) == 1 and lines[0].startswith("sao: error: "), proc.stderr[-3000:]
    return lines[0]


def _snapshot(run):
    """Every file of a run directory with its bytes: what a refusal must leave exactly as it was."""
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


# -- the SFT cache ---------------------------------------------------------------------------------
def test_two_runs_building_one_sft_model_at_once_both_get_a_whole_cache_entry(tmp_path):
    """Before: both processes shared one .partial folder and each deleted it when it started; the entry
    kept sft.json and the weights but lost the tokenizer, and every later run failed."""
    args = ["sft", "sft.steps=20", "sft.batch_size=8", "model.cache_dir=cache", "--quiet"]
    entry = tmp_path / "cache" / f"tiny-{base_model_key(load_config(None, args[1:-1]))}"
    entry.parent.mkdir()
    logs = [tmp_path / f"err{i}.txt" for i in range(2)]
    # the test holds the entry's lock until both have queued on it, so the two always overlap (started
    # together, one could finish its 20 steps before the other reached the lock: a flake once in CI)
    with open(entry.with_name(entry.name + ".lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        procs = [subprocess.Popen([sys.executable, "-m", "sao.cli", *args], cwd=tmp_path, stdout=subprocess.PIPE,
                                  stderr=log.open("w"), text=True) for log in logs]
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not all("waiting for another sao process" in log.read_text()
                                                      for log in logs):
            assert all(p.poll() is None for p in procs), [log.read_text() for log in logs]
            time.sleep(0.1)
    outs = [(p.communicate(timeout=300)[0], log.read_text()) for p, log in zip(procs, logs)]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert all("waiting for another sao process" in o[1] for o in outs), outs
    assert sorted(o[0].split()[0] for o in outs) == ["built", "cached"]  # one built it, the other waited
    entries = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    assert len(entries) == 1 and cache_entry_problem(entries[0]) is None
    assert (entries[0] / "tokenizer.json").is_file()


BUILD = textwrap.dedent("""
    import json, subprocess, sys
    from sao.runtime import model_setup, threads
    threads.set_wait_policy(sys.argv[1])
    from sao.config import load_config
    child_env = []
    real_popen = model_setup.subprocess.Popen
    def popen(*args, env=None, **kwargs):  # a spy: the real Popen, with the environment it got noted
        child_env.append(env.get("OMP_WAIT_POLICY"))
        return real_popen(*args, env=env, **kwargs)
    model_setup.subprocess.Popen = popen
    cfg = load_config(None, ["sft.steps=6", "sft.batch_size=4", "model.cache_dir=" + sys.argv[2]])
    steps = []
    path, built = model_setup.prepare_base_model(cfg, on_step=lambda step, loss: steps.append(step))
    print(json.dumps({"child_env": child_env, "steps": steps, "path": str(path), "built": built}))
""")


def _build_sft(mode, cache, **env):
    base = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    proc = subprocess.run([sys.executable, "-c", BUILD, mode, str(cache)], env={**base, **env},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_an_async_run_builds_its_sft_model_in_a_child_that_spins_and_gets_the_same_model(tmp_path):
    """An async run sets OMP_WAIT_POLICY=PASSIVE before torch loads (the trainer shares cores with the
    workers later); building the SFT model under it was ~1.3x slower. The build runs in a child without it."""
    async_, sync = _build_sft("async", tmp_path / "a"), _build_sft("sync", tmp_path / "s")
    assert async_["child_env"] == [None] and sync["child_env"] == []  # a child, and it spins; sync: in process
    assert async_["steps"] == sync["steps"] == list(range(6)) and async_["built"]
    weights = [(Path(r["path"]) / "model.safetensors").read_bytes() for r in (async_, sync)]
    assert weights[0] == weights[1]
    assert cache_entry_problem(Path(async_["path"])) is None
    user = _build_sft("async", tmp_path / "u", OMP_WAIT_POLICY="PASSIVE")  # the user's own policy: kept
    assert user["child_env"] == []


def test_the_suite_s_children_take_ctrl_c_even_when_the_suite_runs_in_the_background():
    """Before: under `pytest ... &` (SIGINT ignored, inherited) the test below hung: the `sao` it started
    ignored its Ctrl-C (tests/conftest.py)."""
    out = subprocess.run(["bash", "-c", f"{sys.executable} -c 'import signal; print(signal.getsignal(signal.SIGINT) "
                          "== signal.SIG_IGN)' & wait"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"  # a background job: SIGINT ignored, as under the CI's launcher
    child = subprocess.run([sys.executable, "-c", "import signal; print(signal.getsignal(signal.SIGINT))"],
                           capture_output=True, text=True, check=True)
    assert child.stdout.strip() == str(signal.default_int_handler)


def test_ctrl_c_while_the_sft_child_builds_stops_both_and_leaves_no_partial_entry(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "sao.cli", "train", "sft.steps=5000", "model.cache_dir=cache",
                             "--quiet"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"})
    child = None
    try:
        for _ in range(600):  # the child appears once the parent has imported and checked the config
            kids = subprocess.run(["pgrep", "-P", str(proc.pid), "-f", "build_child"], capture_output=True, text=True)
            if kids.stdout.strip() and any((tmp_path / "cache").glob("*.partial-*/model.safetensors")):
                child = int(kids.stdout.split()[0])
                break
            time.sleep(0.1)
        assert child is not None, "no SFT child process"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:  # a failure must not leave an SFT build spinning on both cores for the rest of the suite
        if proc.poll() is None:
            if child is not None:
                subprocess.run(["kill", "-9", str(child)], capture_output=True)
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130 and err.strip().splitlines() == ["sao: interrupted"], err[-3000:]
    for _ in range(100):  # the parent waits for its child before it exits; give /proc a moment
        if not Path(f"/proc/{child}").exists():
            break
        time.sleep(0.1)
    assert not Path(f"/proc/{child}").exists()
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [p.name for p in (tmp_path / "cache").glob("*.lock")]


def test_a_cache_entry_with_a_file_missing_or_truncated_is_rebuilt(tmp_path):
    cfg = load_config(None, ["sft.steps=2", "sft.batch_size=2", "model.hidden_size=32", "model.num_heads=2",
                             "model.num_layers=1", "model.intermediate_size=64", f"model.cache_dir={tmp_path}"])
    path, built = prepare_base_model(cfg)
    assert built and cache_entry_problem(path) is None
    assert prepare_base_model(cfg) == (path, False)
    (path / "tokenizer.json").unlink()  # what the race used to leave
    assert cache_entry_problem(path) == "tokenizer.json is missing"
    messages = []
    assert prepare_base_model(cfg, log=messages.append) == (path, True)
    assert "tokenizer.json is missing" in messages[0] and cache_entry_problem(path) is None
    with open(path / "model.safetensors", "r+b") as f:
        f.truncate(100)
    assert "model.safetensors has 100 bytes" in cache_entry_problem(path)
    assert prepare_base_model(cfg, log=messages.append)[1]
    manifest = json.loads((path / "sft.json").read_text())
    del manifest["files"]  # an entry written before the manifest existed
    (path / "sft.json").write_text(json.dumps(manifest))
    assert prepare_base_model(cfg, log=messages.append)[1] and cache_entry_problem(path) is None
    assert not [p for p in tmp_path.iterdir() if ".partial" in p.name or ".old" in p.name]


# -- resume whatever state a run is in ---------------------------------------------------------------
@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("finished")
    proc = _sao("train", *TINY, "train.steps=6", "output.keep_checkpoints=1", "output.name=done", "--quiet", cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return cwd, cwd / "runs" / "done"


def test_periodic_checkpoints_are_pruned_to_keep_checkpoints(finished):
    _, run = finished
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["final", "latest", "step_000004"]


def test_resuming_a_finished_run_is_refused_and_rewrites_nothing(finished):
    """Before: exit 0, a second final eval row, summary.json's wall time 430 s became 3.7 s."""
    cwd, run = finished
    before = _snapshot(run)
    line = _one_line_error(_sao("train", "--resume", str(run), "--quiet", cwd=cwd))
    assert "finished" in line and "step 6 of train.steps=6" in line and "train.steps=12" in line
    assert _snapshot(run) == before


def test_a_finished_run_trains_on_when_train_steps_is_raised(finished, tmp_path):
    cwd, run = finished
    longer = tmp_path / "longer"
    shutil.copytree(run, longer)
    proc = _sao("train", "--resume", str(longer), "train.steps=8", "--quiet", cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (longer / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward/mean" in r] == list(range(1, 9))
    assert json.loads((longer / "checkpoints" / "final" / "state.json").read_text())["step"] == 8
    events = [json.loads(line) for line in (longer / "audit.jsonl").read_text().splitlines()]
    assert {"event": "resumed", "step": 6, "checkpoint": "final"} in events
    carried = {e["id"] for e in events if e["event"] in ("unfinished_at_exit", "queued_at_exit") and e["step"] == 6}
    assert carried and carried <= {e["id"] for e in events if e["event"] == "trained"}  # not lost: trained after


@pytest.mark.parametrize("damaged", ["trainer_state.pt", "actor/model.safetensors", "critic/model.safetensors"])
def test_a_truncated_checkpoint_is_one_line_naming_the_file(finished, tmp_path, damaged):
    """Before: a 26-29-line traceback and exit 1."""
    cwd, run = finished
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    target = copy / "checkpoints" / "final" / damaged
    with open(target, "r+b") as f:
        f.truncate(target.stat().st_size // 2)
    before = _snapshot(copy)
    line = _one_line_error(_sao("train", "--resume", str(copy), "train.steps=8", "--quiet", cwd=cwd))
    assert str(target) in line and "truncated or damaged" in line
    assert "to resume from step_000004, write that name into" in line  # the earlier checkpoint is offered
    assert _snapshot(copy) == before
    if damaged == "trainer_state.pt":  # what the message says to do works
        (copy / "checkpoints" / "latest").write_text("step_000004\n")
        proc = _sao("train", "--resume", str(copy), "--quiet", cwd=cwd)
        assert proc.returncode == 0, proc.stderr[-3000:]


def test_a_run_with_no_checkpoint_yet_says_so(tmp_path):
    run = tmp_path / "runs" / "early"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("train:\n  steps: 10\n")
    line = _one_line_error(_sao("train", "--resume", str(run), cwd=tmp_path))
    assert "has no checkpoint yet" in line


def test_the_default_settings_checkpoint_periodically():
    """Before: output.save_every=0, so a SIGKILL, an OOM or a reboot lost the whole run
    (tests/test_faults.py kills a run and resumes it from such a checkpoint)."""
    cfg = load_config(None, [])
    assert 0 < cfg.output.save_every < cfg.train.steps and cfg.output.keep_checkpoints >= 1


# -- a full disk ----------------------------------------------------------------------------------
FULL_DISK = textwrap.dedent("""\
    set -u
    mount -t tmpfs -o size=64m tmpfs "$DISK"
    cd "$DISK"
    "$PY" -m sao.cli train "$@" --quiet 2> "$KEEP/train.err" &
    pid=$!
    while [ ! -f runs/full/checkpoints/latest ] && kill -0 $pid 2>/dev/null; do sleep 0.05; done
    dd if=/dev/zero of=filler bs=64k 2>/dev/null  # until the disk is full
    wait $pid; echo $? > "$KEEP/train.rc"
    cp -r runs "$KEEP"/
    rm filler
    "$PY" -m sao.cli train --resume runs/full --quiet 2> "$KEEP/after/resume.err"; echo $? > "$KEEP/after/resume.rc"
    cp -r runs "$KEEP"/after/
""")


@pytest.mark.skipif(shutil.which("unshare") is None or subprocess.run(
    ["unshare", "-Urm", "true"], capture_output=True).returncode != 0, reason="needs unshare -Urm (a tmpfs mount)")
def test_a_full_disk_is_one_line_exit_74_and_the_run_resumes_once_there_is_room(tmp_path):
    """A real full disk: a tmpfs filled up while the run trains. Before: exit 1, two chained torch
    tracebacks ("basic_ios::clear: iostream error") and a step_N.partial left behind."""
    keep, disk = tmp_path / "keep", tmp_path / "disk"
    (keep / "after").mkdir(parents=True)
    disk.mkdir()
    cache = tmp_path / "cache"
    assert _sao("sft", *TINY, f"model.cache_dir={cache}", "--quiet", cwd=tmp_path).returncode == 0
    args = [*TINY, "train.steps=20", "output.save_every=1", "output.trajectories_every=1",
            f"model.cache_dir={cache}", "output.name=full"]
    env = {**os.environ, "DISK": str(disk), "KEEP": str(keep), "PY": sys.executable,
           "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(["unshare", "-Urm", "bash", "-c", FULL_DISK, "full-disk", *args], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    err = (keep / "train.err").read_text()
    lines = err.strip().splitlines()
    assert (keep / "train.rc").read_text().strip() == "74", err[-3000:]
    assert len(lines) == 1 and "no space left on device" in lines[0] and "Traceback" not in err, err[-3000:]
    assert "is intact" in lines[0] and "sao train --resume" in lines[0]
    run = keep / "runs" / "full"
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.endswith((".partial", ".old"))]
    latest = (run / "checkpoints" / "latest").read_text().strip()
    assert checkpoint.damage(run / "checkpoints" / latest) is None
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]  # no half row
    steps = [r["step"] for r in rows if "reward/mean" in r]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) < 20
    # freed: the run resumes from its intact checkpoint and ends where it should
    assert (keep / "after" / "resume.rc").read_text().strip() == "0", (keep / "after" / "resume.err").read_text()
    after = keep / "after" / "runs" / "full"
    rows = [json.loads(line) for line in (after / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward/mean" in r] == list(range(1, 21))


# -- run names and refusals -----------------------------------------------------------------------------
def test_runs_started_in_the_same_second_with_default_names_all_start(tmp_path, monkeypatch):
    """Before: the name had 1-second resolution and check-then-mkdir: the second run was refused
    ("choose another name") though the user chose none."""
    cfg = load_config(None, [f"output.root={tmp_path}"])
    monkeypatch.setattr(time, "strftime", lambda fmt, *a: "20261202-120000")  # the same second for all
    made, barrier = [], threading.Barrier(6)

    def start():
        barrier.wait()
        made.append(RunDir.create(cfg).path.name)

    threads = [threading.Thread(target=start) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    base = "sao-calc-20261202-120000"
    assert sorted(made) == sorted([base] + [f"{base}-{i}" for i in range(2, 7)])
    named = load_config(None, [f"output.root={tmp_path}", f"output.name={base}"])
    with pytest.raises(Exception, match="exists already; choose another name"):
        RunDir.create(named)  # a name the user chose is never changed


def test_bad_input_is_refused_before_the_rollout_fork_server_starts(tmp_path, monkeypatch, capsys):
    """Before: the fork server was started first, so each refusal took 6-16 s under load."""
    from sao import cli
    from sao.runtime import prewarm

    def started():
        raise AssertionError("the fork server started before the config was checked")

    monkeypatch.setattr(prewarm, "prewarm", started)
    monkeypatch.chdir(tmp_path)
    bad = ["env.name=nope", "model.path=missing", "algo.name=nope", "runtime.sync_every=9", "critic.path=missing",
           "env.options.max_ops=0"]
    for arg in bad:
        assert cli.main(["train", arg]) == 2, arg
    assert not (tmp_path / "runs").exists()
    assert capsys.readouterr().err.count("sao: error: ") == len(bad)
