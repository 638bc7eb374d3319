"""What the terminal shows while a run trains: a live bar on a terminal, plain lines otherwise."""

from __future__ import annotations

import sys
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


def describe(metrics: dict[str, Any]) -> str:
    return (f"reward {metrics['reward_mean']:.3f}  staleness {metrics['staleness_mean']:.2f}/{metrics['staleness_max']}"
            f"  {metrics['tokens_per_s']:,.0f} tok/s  queue {metrics.get('queued_groups', 0)}"
            f"  wait {metrics['trainer_wait_s']:.2f}s")


class ProgressView:
    def __init__(self, mode: str, total_steps: int, start_step: int, line_every: int):
        if mode == "auto":
            mode = "bar" if sys.stdout.isatty() else "line"
        self.mode, self.line_every = mode, line_every
        self.console = Console()
        self._bar: Progress | None = None
        if mode == "bar":
            self._bar = Progress(TextColumn("step"), MofNCompleteColumn(), BarColumn(), TimeElapsedColumn(),
                                 TextColumn("{task.fields[info]}"), console=self.console, transient=False)
            self._task = self._bar.add_task("train", total=total_steps, completed=start_step, info="starting")
            self._bar.start()

    def print(self, text: str) -> None:
        if self.mode == "bar":
            self.console.print(text, highlight=False)
        elif self.mode == "line":
            print(text, flush=True)  # plain lines: a log file or pipe should not be wrapped at 80 columns

    def step(self, metrics: dict[str, Any]) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=metrics["step"], info=describe(metrics))
        elif self.mode == "line" and metrics["step"] % self.line_every == 0:
            self.print(f"step {metrics['step']:>5}  {metrics['elapsed_s']:7.1f}s  {describe(metrics)}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
