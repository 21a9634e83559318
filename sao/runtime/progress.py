"""Live progress for long work: SFT and RL steps with reward, eval accuracy, lag and tokens/s."""

from __future__ import annotations

import sys
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class RunProgress:
    def __init__(self, enabled: bool = True, console: Console | None = None):
        self.enabled = enabled
        self.console = console or Console(stderr=True)
        self._progress: Progress | None = None
        self._task = None
        self._eval: tuple[float, int | None] | None = None  # the latest (accuracy, step)
        self._last: dict = {}

    def log(self, message: str) -> None:
        if self.enabled:
            self.console.print(message)

    def warn(self, message: str) -> None:
        """A warning the user must see: above the live bar, or on stderr with --quiet."""
        if self.enabled:
            self.console.print(message, markup=False, highlight=False)
        else:
            print(message, file=sys.stderr, flush=True)

    def _bar(self, label: str) -> Progress:
        return Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                        TextColumn("elapsed"), TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn(),
                        console=self.console, transient=False)

    def sft_callback(self, total: int, every_s: float = 30.0):
        """The SFT's per-step callback: the live bar, or with --quiet a plain line on stderr at the first step,
        every `every_s` seconds and at the last (an SFT takes minutes, and `sao bench` shows a run's last line)."""
        if total == 0:
            return None
        if not self.enabled:
            return self._sft_lines(total, every_s)
        state: dict = {}

        def on_step(step: int, loss: float) -> None:
            if step == 0:
                state["p"] = self._bar("[bold]SFT warm start")
                state["p"].start()
                state["t"] = state["p"].add_task("sft", total=total, info="")
            state["p"].update(state["t"], advance=1, info=f"loss {loss:.3f}")
            if step == total - 1:
                state["p"].stop()

        return on_step

    @staticmethod
    def _sft_lines(total: int, every_s: float):
        t0 = last = time.monotonic()

        def on_step(step: int, loss: float) -> None:
            nonlocal last
            now = time.monotonic()
            if step in (0, total - 1) or now - last >= every_s:
                last = now
                print(f"SFT warm start: step {step + 1}/{total}, loss {loss:.3f} ({now - t0:.0f}s)", file=sys.stderr,
                      flush=True)

        return on_step

    def start_training(self, total: int) -> None:
        if self.enabled:
            self._progress = self._bar("[bold]RL")
            self._progress.start()
            self._task = self._progress.add_task("rl", total=total, info="")

    def set_eval(self, accuracy: float, *, step: int | None = None) -> None:
        self._eval = (accuracy, step)
        if self._progress is None:  # before the bar starts or after it stopped (the final eval): a line of its own
            self.log(f"held-out accuracy: {accuracy:.3f}" + ("" if step is None else f" (step {step})"))
        self._refresh(0)

    def step(self, metrics: dict) -> None:
        self._last = metrics
        self._refresh(1)

    def _refresh(self, advance: int) -> None:
        if self._progress is None:
            return
        m = self._last
        if self._eval is None:
            ev = "eval -"
        else:
            ev = f"eval {self._eval[0]:.2f}" + ("" if self._eval[1] is None else f"@s{self._eval[1]}")
        warmup = "critic warm-up  " if m.get("train/critic_warmup") == 1.0 else ""  # the actor is not updated yet
        info = (f"{warmup}reward {m.get('reward/mean', float('nan')):.2f}  {ev}  "
                f"lag {m.get('async/lag_mean', 0):.1f}  tok/s {m.get('perf/tokens_per_s', 0):,.0f}")
        self._progress.update(self._task, advance=advance, info=info)

    def stop_training(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
