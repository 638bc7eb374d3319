"""Bad command lines for `streamrl.cli.main`: every verb, with `launch` never getting to start a run."""

from __future__ import annotations

import contextlib
import io
import json
import signal
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np

from harness import CHECKOUT
from harness.chaos.bad_configs import ConfigSpecs, materialize
from harness.chaos.cases import Case, Fuzzer, error_naming, file_state, pick, short
from streamrl.config import dump_config, load_config


class CliRefused(Exception):
    """`streamrl.cli.main` refused the arguments: exit status, stderr, and whether argparse did."""

    def __init__(self, status: object, stderr: str, usage: bool):
        self.status, self.stderr, self.usage = status, stderr, usage
        super().__init__(f"exit {status}: {stderr.strip()}")


class WouldLaunch(Exception):
    """Raised instead of starting a run: the arguments got past every check."""


def call_cli(argv: list[str]) -> None:
    """Run the command; returns when it accepted the arguments, raises CliRefused when it refused them."""
    from streamrl.cli import main

    out, err = io.StringIO(), io.StringIO()
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = main(argv)
    except SystemExit as exc:
        raise CliRefused(exc.code, err.getvalue(), usage=True) from None
    except WouldLaunch:
        return
    finally:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, previous)  # `launch` installs its own before starting a run
    if status != 0:
        raise CliRefused(status, err.getvalue(), usage=False)


def cli_error(*words: str | tuple[str, ...]) -> Callable[[BaseException], str | None]:
    def expect(exc: BaseException) -> str | None:
        if not isinstance(exc, CliRefused):
            return f"{type(exc).__name__}: {short(exc)}"
        if exc.status != 2:
            return f"exit status {exc.status}: {short(exc.stderr)}"
        lines = exc.stderr.splitlines()
        if not exc.usage and (len(lines) != 1 or not lines[0].startswith("streamrl: error: ")):
            return f"not one 'streamrl: error:' line: {short(exc.stderr)!r}"
        return error_naming(CliRefused, *words)(exc)
    return expect


class CliFuzzer(Fuzzer):
    """Arguments for every verb. `launch` gets only arguments its checks must refuse; a run that would
    start anyway hits a trap instead (counted as accepted), and every run directory goes to `out/`."""

    def __init__(self, workdir: Path, seed: int):
        super().__init__(workdir, seed)
        self.benchmarks = {p.stem for p in (CHECKOUT / "benchmarks").glob("*.py")}
        self.specs = ConfigSpecs(exclude=("run.output_dir",))  # the fuzzer sets it, to a scratch folder
        self.out = workdir / "out"
        self.out.mkdir()
        self.cases_dir = workdir / "cases"
        self.cases_dir.mkdir()
        self.runs = self._resume_dirs(workdir / "runs")

    def __enter__(self) -> CliFuzzer:
        import streamrl.runtime.launch as launch_module

        def trap(*args: object, **kwargs: object) -> dict:
            raise WouldLaunch("the arguments passed every check")

        self._launch_module, self._real_launch = launch_module, launch_module.launch
        launch_module.launch = trap
        return self

    def __exit__(self, *exc: object) -> None:
        self._launch_module.launch = self._real_launch

    def _resume_dirs(self, root: Path) -> dict[str, Path]:
        """Run directories `--resume` must refuse, each for its own reason."""
        valid = dump_config(load_config(overrides=[f"run.output_dir={json.dumps(str(self.out))}", "run.steps=5",
                                                   'run.name="resumed"']))
        runs = {name: root / name for name in ("empty", "garbage", "unstarted", "damaged")}
        for path in runs.values():
            path.mkdir(parents=True)
        (runs["garbage"] / "config.toml").write_text("[run\nsteps = ")
        for name in ("unstarted", "damaged"):
            (runs[name] / "config.toml").write_text(valid)
        step = runs["damaged"] / "checkpoints" / "step_000010"
        step.mkdir(parents=True)
        (step / "meta.json").write_text('{"step": 10}\n')
        (runs["damaged"] / "checkpoints" / "latest").write_text("step_000010\n")
        return runs

    def case(self, index: int, rng: np.random.Generator) -> Case:
        makers = (self.usage, self.usage, self.launch_config, self.launch_config, self.launch_config,
                  self.launch_name, self.resume, self.resume, self.bench)
        description, argv, expect = makers[index % len(makers)](rng)
        return Case(description, lambda: call_cli(argv), expect, state=lambda: file_state(self.workdir))

    def usage(self, rng):
        word = pick(rng, ("explode", "lunch", "Launch", "run", "train", "-x", "--help-me"))
        cases = [
            ([], "required"),
            ([word], "invalid choice" if not word.startswith("-") else ("required", "unrecognized")),
            (["launch", f"--{word.strip('-')}x"], "unrecognized arguments"),
            (["launch", pick(rng, ("--set", "--name", "--resume", "--address"))], "expected one argument"),
            (["launch", "a.toml", "b.toml"], "unrecognized arguments"),
            (["admission"], "required"),
            (["admission", word, "--run", "x"], ("invalid choice", "unrecognized", "required")),
            (["admission", pick(rng, ("pause", "resume", "status"))], "--run"),
            (["admission", "pause", "--run"], "expected one argument"),
            (["admission", "status", "--run", "x", "--jsn"], "unrecognized arguments"),
            (["bench", f"--{word.strip('-')}"], "unrecognized arguments"),
        ]
        argv, words = pick(rng, cases)
        return f"argv {argv}", argv, cli_error(words)

    def _launch(self, *args: str) -> list[str]:
        return ["launch", "--set", f"run.output_dir={self.out}", *args]  # the bad overrides come after

    def launch_config(self, rng):
        spec = self.specs.make(int(rng.integers(len(self.specs.makers))), rng)
        path, names = materialize(spec, self.cases_dir)
        argv = self._launch(*([str(path)] if path else []), *[a for o in spec.overrides for a in ("--set", o)])
        return f"launch: {spec.description}", argv, cli_error(*names)

    def launch_name(self, rng):
        name = pick(rng, ("", "has space", "-dash", "a/b", "x" * 70, "ünï", "..dot", "."))
        return f"launch --name {name!r}", self._launch(f"--name={name}"), cli_error("run.name")

    def resume(self, rng):
        runs = self.runs
        cases = [
            ("a directory that does not exist", ["--resume", str(self.workdir / "no-run")], "not a streamrl run"),
            ("a directory without config.toml", ["--resume", str(runs["empty"])], "not a streamrl run"),
            ("a run whose config.toml is not TOML", ["--resume", str(runs["garbage"])], "not valid TOML"),
            ("a run without a checkpoint", ["--resume", str(runs["unstarted"])], "no checkpoint"),
            ("a damaged checkpoint", ["--resume", str(runs["damaged"])], "checkpoint"),
            ("a CONFIG as well", ["--resume", str(runs["unstarted"]), str(self.cases_dir / "x.toml")], "--resume"),
            ("a frozen field changed", ["--resume", str(runs["unstarted"]), "--set",
                                        f"queue.group_size={pick(rng, (2, 4, 16))}"], "queue.group_size"),
            ("a bad --set", ["--resume", str(runs["unstarted"]), "--set", "run.steps=-1"], "run.steps"),
        ]
        what, args, words = pick(rng, cases)
        return f"launch --resume: {what}", ["launch", *args], cli_error(words)

    def bench(self, rng):
        name = pick(rng, ("", "nonexistent", "BUFFER", "buffer.py", "../cli", "weights/", " pipeline", "-"))
        if name in self.benchmarks:  # never run a real benchmark
            name = f"{name}-not"
        words = "unknown benchmark" if name != "-" else ("unknown benchmark", "unrecognized", "invalid")
        return f"bench {name!r}", ["bench", name], cli_error(words)


