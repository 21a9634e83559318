"""The live progress bar (rich, rendered to a string) and the `sao report` plots (matplotlib objects)."""

from __future__ import annotations

import json
from io import StringIO

from matplotlib.patches import Rectangle
from rich.console import Console

from sao.runtime.progress import RunProgress
from sao.runtime.report import PANELS, figure, read_metrics, write_report

WARMUP = 3  # steps 1..3 train the critic only
STEPS = 40


def _run_dir(tmp_path):
    """40 train steps (the first 3 critic warm-up), an eval every 10 steps, as train.py logs them."""
    run = tmp_path / "gsm8k-sao-seed0"
    run.mkdir()
    rows = []
    for step in range(1, STEPS + 1):
        rows.append({"step": step, "reward/mean": 0.1 + 0.01 * step + (0.05 if step % 2 else -0.05),
                     "train/critic_warmup": float(step <= WARMUP), "perf/tokens_per_s": 100.0 + step})
        if step % 10 == 0:
            rows.append({"step": step, "eval/accuracy": step / 100})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def _panel(name):
    return next(p for p in PANELS if p[0] == name)


def test_reward_panel_has_units_run_name_smoothed_line_and_warmup_span(tmp_path):
    run = _run_dir(tmp_path)
    paths = write_report(run)
    assert sorted(p.name for p in paths) == ["eval_accuracy.png", "reward.png", "throughput.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in paths)
    fig = figure(read_metrics(run), run.name, *_panel("reward"))
    (ax,) = fig.axes
    assert ax.get_ylabel() and ax.get_xlabel() == "step"
    assert fig.get_suptitle() == "gsm8k-sao-seed0"
    raw, smooth = ax.get_lines()
    assert raw.get_alpha() < 1.0  # the raw line is faint, the trailing mean drawn over it
    # window = 40 // 20 = 2: the mean of steps 1 and 2 is 0.1 + 0.015 + (0.05 - 0.05) / 2 = 0.115
    assert list(smooth.get_xdata()) == list(range(1, STEPS + 1))
    assert abs(smooth.get_ydata()[1] - 0.115) < 1e-9
    spans = [p for p in ax.patches if isinstance(p, Rectangle)]
    assert len(spans) == 1 and spans[0].get_label() == "critic warm-up"
    assert spans[0].get_x() == 0.5 and spans[0].get_width() == WARMUP  # steps 1..3, each +-0.5
    assert "critic warm-up" in [t.get_text() for t in ax.get_legend().get_texts()]


def test_every_panel_has_a_y_label():
    rows = [{"step": s, **{k: 1.0 for _, keys, *_ in PANELS for k in keys}} for s in (1, 2)]
    for panel in PANELS:
        assert figure(rows, "r", *panel).axes[0].get_ylabel(), panel[0]


def test_async_throughput_is_titled_a_cumulative_average(tmp_path):
    # async_perf logs tokens so far / worker time so far; only the sync loop (perf/gen_s) logs a per-step rate
    rows = read_metrics(_run_dir(tmp_path))
    assert "cumulative average" in figure(rows, "r", *_panel("throughput")).axes[0].get_title()
    rows[0]["perf/gen_s"] = 1.0
    assert "per step" in figure(rows, "r", *_panel("throughput")).axes[0].get_title()


def _progress():
    out = StringIO()
    return RunProgress(console=Console(file=out, width=120, force_terminal=False)), out


def test_bar_labels_its_times_and_marks_the_critic_warmup():
    progress, out = _progress()
    progress.start_training(10)
    progress.step({"reward/mean": 0.25, "train/critic_warmup": 1.0})
    progress.stop_training()
    line = out.getvalue()
    assert "elapsed" in line and "left" in line and "critic warm-up" in line

    progress, out = _progress()
    progress.start_training(10)
    progress.step({"reward/mean": 0.25, "train/critic_warmup": 0.0})
    progress.stop_training()
    assert "warm-up" not in out.getvalue() and "reward 0.25" in out.getvalue()


def test_bar_shows_the_latest_eval_with_its_step_and_the_final_eval_is_logged():
    progress, out = _progress()
    progress.start_training(10)
    progress.step({"reward/mean": 0.25})
    progress.set_eval(0.43, step=5)
    progress.stop_training()
    assert "eval 0.43@s5" in out.getvalue()
    progress.set_eval(0.5, step=10)  # train.py's final eval runs after the bar stopped
    assert "held-out accuracy: 0.500 (step 10)" in out.getvalue()
    progress.set_eval(0.5)  # the step is optional
    assert out.getvalue().rstrip().endswith("held-out accuracy: 0.500")


def test_quiet_sft_prints_plain_lines(capsys):
    """With --quiet (what `sao bench` runs) the SFT warm start was silent for minutes, and the bench's progress
    line kept showing the games generated before it. It now prints a line at its first step, every `every_s`
    seconds and at its last; with the bar on it prints no plain lines."""
    on_step = RunProgress(enabled=False).sft_callback(5, every_s=3600)
    for step in range(5):
        on_step(step, 1.0 / (step + 1))
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(" (")[0] for line in lines] == ["SFT warm start: step 1/5, loss 1.000",
                                                       "SFT warm start: step 5/5, loss 0.200"]
    every = RunProgress(enabled=False).sft_callback(3, every_s=0)
    for step in range(3):
        every(step, 0.5)
    assert len(capsys.readouterr().err.splitlines()) == 3
    assert RunProgress(enabled=False).sft_callback(0) is None
    bar = RunProgress(enabled=True, console=Console(file=StringIO())).sft_callback(2)
    bar(0, 1.0)
    bar(1, 0.5)
    assert capsys.readouterr().err == ""
