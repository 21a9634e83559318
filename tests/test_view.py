"""`sao view` (sao/runtime/view.py): the page's data joins trajectories with the trainer's per-token
records and carries the curves `sao report` draws; the page itself runs in a real headless Chromium
(Debian's package, driven by playwright with the system browser; no browser download), offline: a
filter, a trajectory opened, a token hovered and its values read back against the recorded JSON, no
console errors; `--serve` refreshes as the run goes on."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sao.config import Config, to_yaml
from sao.runtime.curves import curve_data
from sao.runtime.view import collect, render
from sao.types import Status, Trajectory

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


def _traj(i: int, reward: float, versions: int, status=Status.OK) -> Trajectory:
    ids = [5, 6, 7, 8, 9, 10, 11]
    mask = [0, 0, 1, 1, 0, 1, 1]
    return Trajectory(f"t{i}", f"task{i}", ids, mask, [-0.5 * m for m in mask], [versions if m else -1 for m in mask], 2,
                      reward=reward, status=status, turns=2)


def _fake_run(root: Path, name: str = "r") -> Path:
    """A run folder as the runtime writes it: 6 steps (a resume at 4), dumps at 2 and 4, a trace at 4."""
    run = root / name
    (run / "trajectories").mkdir(parents=True)
    (run / "traces").mkdir()
    (run / "config.yaml").write_text(to_yaml(Config()))
    rows = [{"step": 0, "parity/max_abs_diff": 0.0}, {"step": 0, "eval/accuracy": 0.25}]
    for s in range(1, 7):
        rows.append({"step": s, "reward/mean": s / 10, "train/critic_warmup": float(s <= 2),
                     "train/actor_version": max(0, s - 2), "async/published": float(s % 2 == 0)})
        if s == 4:
            rows.append({"step": 4, "parity/max_abs_diff": 0.0})  # the resumed run's start
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for step, trajs in ((2, [_traj(0, 0.0, 0), _traj(1, 1.0, 0, Status.TRUNCATED)]), (4, [_traj(2, 1.0, 1)])):
        (run / "trajectories" / f"step_{step:06d}.jsonl").write_text("".join(t.to_json() + "\n" for t in trajs))
    rec = {"step": 4, "algo": "sao", "trajectory_id": "t2", "row": 0, "actor": "stepped", "lag": 1,
           "text": list("abcdefg"), "token_ids": [5, 6, 7, 8, 9, 10, 11], "action_mask": [0, 0, 1, 1, 0, 1, 1],
           "adv": [None, None, 0.5, -0.25, None, 1.5, 2.0], "dis": [None, None, 0, 1, None, -1, 0],
           "v_after": [None, None, 0.1, 0.2, None, 0.3, 0.4], "whiten": {"mean": 0.1, "std": 0.9}}
    (run / "traces" / "step_000004.jsonl").write_text(json.dumps(rec) + "\n")
    return run


def test_the_page_data_joins_trajectories_traces_and_curves(tmp_path):
    run = _fake_run(tmp_path)
    data = collect(run)
    (r,) = data["runs"]
    assert r["algo"] == "sao" and r["env"] == "calc" and r["steps"] == 6
    by_id = {t["id"]: t for t in r["trajectories"]}
    assert set(by_id) == {"t0", "t1", "t2"}
    t2, t1 = by_id["t2"], by_id["t1"]
    assert t2["traced"] and t2["text"] == list("abcdefg") and t2["fields"]["adv"][3] == -0.25
    assert t2["fields"]["dis"] == [None, None, 0, 1, None, -1, 0] and t2["whiten"] == {"mean": 0.1, "std": 0.9}
    assert t2["lag"] == 1 and t2["actor"] == "stepped"
    # no trace: the versions and rollout log-probs, the lag from the version the step trained (0 at step 2)
    assert not t1["traced"] and t1["status"] == "truncated" and t1["lag"] == 0
    assert t1["fields"]["version"] == [None, None, 0, 0, None, 0, 0]
    # the curves are curve_data's, the definition `sao report` draws
    assert r["curves"] == curve_data([json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()])
    assert r["curves"]["warmup"] == [[1, 2]] or r["curves"]["warmup"] == [(1, 2)]
    assert r["curves"]["resumes"] == [4] and r["curves"]["publishes"] == [2, 4, 6]
    assert "</script>" not in render(data).split("<script>", 1)[1].rsplit("</script>", 1)[0]


def test_a_bench_folder_shows_its_runs_side_by_side(tmp_path):
    runs = [_fake_run(tmp_path / "runs", n) for n in ("sao-s0", "grpo-s0")]
    out = tmp_path / "bench"
    out.mkdir()
    (out / "results.json").write_text(json.dumps({"runs": [
        {"variant": v, "seed": 0, "run_dir": str(r)} for v, r in zip(("sao", "grpo"), runs)]}))
    data = collect(out)
    assert [r["name"] for r in data["runs"]] == ["sao-s0", "grpo-s0"]


def test_bad_input_is_one_line_and_exit_2(tmp_path, sao_cli):
    res = sao_cli("view", str(tmp_path / "nope"), cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "nope" in res.stderr and "Traceback" not in res.stderr
    (tmp_path / "empty").mkdir()
    res = sao_cli("view", str(tmp_path / "empty"), cwd=tmp_path)
    assert res.returncode == 2 and "not a run directory" in res.stderr
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "results.json").write_text(json.dumps({"runs": [{"variant": "x", "seed": 0, "run_dir": "/gone"}]}))
    res = sao_cli("view", str(tmp_path / "b"), cwd=tmp_path)
    assert res.returncode == 2 and "none of its runs" in res.stderr


# --- in a real browser --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def browser():
    playwright = pytest.importorskip("playwright.sync_api", reason="the `test` extra installs playwright")
    if not os.path.exists(CHROMIUM):
        pytest.skip("Debian's chromium is not installed (scripts/install.sh installs it where it may: root with apt)")
    with playwright.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run"])
        yield b
        b.close()


def _page(browser, offline: bool = True):
    """A page with the network off (every request but the page's own file or loopback server fails)
    that collects console errors and uncaught exceptions."""
    ctx = browser.new_context(viewport={"width": 1400, "height": 900}, offline=offline)
    page = ctx.new_page()
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    return page, errors


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    """A real short async run (sao train) with a trace on its dump steps."""
    from conftest import TINY

    root = tmp_path_factory.mktemp("viewrun")
    subprocess.run([sys.executable, "-m", "sao.cli", "train", *TINY, "output.name=v", "output.trajectories_every=2",
                    "output.trace_trajectories=2", "output.progress=false"], cwd=root, check=True,
                   capture_output=True, timeout=300)
    return root / "runs" / "v"


@pytest.mark.slow
def test_the_page_in_chromium_shows_what_was_recorded(browser, real_run, sao_cli):
    res = sao_cli("view", str(real_run), cwd=real_run.parent)
    assert res.returncode == 0, res.stderr
    html = Path(res.stdout.strip())
    assert html == real_run / "view.html"
    page, errors = _page(browser)
    page.goto(html.as_uri())
    rows = page.locator("tr.traj-row")
    total = rows.count()
    assert total == 2 * 4  # two dumps of trajectories_per_dump=4
    page.check("#f-traced")  # a filter: only the traced ones (2 per dump)
    assert rows.count() == 4 and "4 of 8" in page.text_content("#count")
    page.select_option("#f-sort", "step:1")
    assert [rows.nth(i).locator("td").nth(1).text_content() for i in range(4)] == ["2", "2", "4", "4"]
    page.fill("#f-smin", "4")
    assert rows.count() == 2
    rows.nth(0).click()
    info = page.text_content("#detail-info")
    trace = [json.loads(line) for line in (real_run / "traces" / "step_000004.jsonl").read_text().splitlines()]
    rec = next(r for r in trace if r["trajectory_id"] in info)
    assert "step: 4" in info and rec["status"] in info
    # hover each action token: the tooltip's values are the recorded ones
    tokens = page.locator(".block.action .tok")
    assert tokens.count() == sum(rec["action_mask"])
    for k in range(tokens.count()):
        tok = tokens.nth(k)
        i = int(tok.get_attribute("data-i"))
        tok.hover()
        for field in ("adv", "adv_raw", "v_before", "v_after", "return", "ratio", "logprob", "version", "dis"):
            got = page.get_attribute(f"#tip td[data-field={field}]", "data-value")
            assert float(got) == pytest.approx(rec[field][i], rel=1e-9, abs=1e-12), (field, i)
        masked = rec["dis"][i] != 0
        assert ("masked" in tok.get_attribute("class")) == masked
    # colour by another field: the legend and the colours change, the page stays error-free
    before = tokens.nth(0).evaluate("e => e.style.background")
    page.select_option("#color-field", "v_after")
    assert page.locator(".block.action .tok").nth(0).evaluate("e => e.style.background") != before or \
        len({v for v in rec["v_after"] if v is not None}) <= 1
    # the curves: labelled axes, smoothing toggles, zoom narrows the steps
    page.click("#tab-curves")
    reward = page.locator("svg[data-panel=reward]")
    assert reward.locator("text.xlabel").text_content() == "step"
    assert reward.locator("text.ylabel").text_content() == "reward"
    assert page.locator("svg[data-panel=eval_accuracy]").count() == 1
    assert page.locator("svg .warmup").count() >= 1 and page.locator("svg .publish").count() >= 1
    page.fill("#zoom-from", "3")
    xs = [float(t.text_content()) for t in reward.locator("text.xtick").all()]
    assert min(xs) >= 3
    page.uncheck("#smooth")
    assert errors == []


@pytest.mark.slow
def test_serve_refreshes_while_the_run_goes_on(browser, real_run, tmp_path):
    run = tmp_path / "live"
    shutil.copytree(real_run, run)
    proc = subprocess.Popen([sys.executable, "-m", "sao.cli", "view", str(run), "--serve", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving http://127.0.0.1:"), line + proc.stderr.read()
        url = line.split()[1]
        page, errors = _page(browser, offline=False)  # loopback only: the page's own server
        page.route("**/*", lambda route: route.continue_() if route.request.url.startswith(url) else route.abort())
        page.goto(url)
        assert "live" in page.text_content("#live")
        before = page.locator("tr.traj-row").count()
        # the run goes on: a new dump and a new metrics row appear
        dump = sorted((run / "trajectories").glob("step_*.jsonl"))[-1]
        last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["step"]
        shutil.copy(dump, run / "trajectories" / f"step_{last + 2:06d}.jsonl")
        with open(run / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": last + 2, "reward/mean": 0.5, "train/actor_version": last + 1}) + "\n")
        deadline = time.time() + 20
        while page.locator("tr.traj-row").count() == before and time.time() < deadline:
            time.sleep(0.3)
        assert page.locator("tr.traj-row").count() > before
        assert errors == []
    finally:
        proc.terminate()
        proc.wait(timeout=10)
