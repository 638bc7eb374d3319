"""The `streamrl` command: a handful of verbs.

    streamrl launch [CONFIG.toml] [--set section.key=value ...] [--name NAME] [--address ADDR] [--resume RUN_DIR]
    streamrl admission pause|resume|status --run NAME [--address ADDR] [--json]
    streamrl bench [NAME [ARGS ...]]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path


class CliError(Exception):
    """A user error: printed as one line, exit status 2."""


def _connect(address: str | None) -> None:
    import ray

    from streamrl.net import cluster_address_problem
    from streamrl.runtime.connect import RayConnectError, join_cluster

    problem = None if address is None else cluster_address_problem(address)
    if problem is not None:  # refused even where this process already has Ray (the tests, a notebook)
        raise CliError(problem)
    if ray.is_initialized():
        return
    try:
        join_cluster(address or "auto", namespace="streamrl", log_to_driver=False, logging_level="ERROR")
    except RayConnectError as exc:
        raise CliError(str(exc)) from exc


def _queue_of(run: str, address: str | None):
    """The queue actor of the run named `run`: on the cluster at `address`, else on whichever Ray instance
    on this machine holds it (two runs launched here each have their own)."""
    import ray

    from streamrl.buffer.actor import get_queue_actor
    from streamrl.runtime.connect import local_cluster_addresses

    candidates = [] if address is not None or ray.is_initialized() else local_cluster_addresses()
    if len(candidates) < 2:
        _connect(address or (candidates[0] if candidates else None))
        try:
            return get_queue_actor(run)
        except ValueError as exc:
            raise CliError(str(exc)) from exc
    searched = []
    for candidate in candidates:
        try:
            _connect(candidate)
            return get_queue_actor(run)
        except (CliError, ValueError) as exc:  # not this instance: the next one may hold the run
            searched.append(f"{candidate}: {exc}")
            ray.shutdown()
    raise CliError(f"no running streamrl run named {run!r} on the {len(candidates)} Ray instances on this machine "
                   f"({'; '.join(searched)}); for a run elsewhere pass --address HOST:PORT")


def describe_summary(summary: dict) -> str:
    """The run's last line; fields a run stopped before its first step does not have print as n/a."""
    def num(key: str, spec: str) -> str:
        value = summary.get(key)
        return "n/a" if value is None else format(value, spec)

    return (f"{summary['stopped_by']} at step {summary['steps']} after {summary['elapsed_s']:.0f} s: "
            f"reward {num('reward_first_10pct', '.3f')} → {num('reward_last_10pct', '.3f')} "
            f"(first → last 10% of steps), held-out accuracy {num('eval_accuracy_first', '.2f')} → "
            f"{num('eval_accuracy_last', '.2f')}, staleness max {summary['staleness_max']} "
            f"(bound {summary['max_staleness']})")


def launch(args: argparse.Namespace) -> int:
    from streamrl.config import ConfigError
    from streamrl.runtime.launch import RunFailed, prepare
    from streamrl.runtime.launch import launch as run_launch
    from streamrl.runtime.rundir import RunDirError

    overrides = list(args.set or [])
    if args.name is not None:
        overrides.append(f"run.name={json.dumps(args.name)}")
    if args.address is not None:
        overrides.append(f"ray.address={json.dumps(args.address)}")
    if args.log_level is not None:
        overrides.append(f"logging.level={json.dumps(args.log_level)}")
    try:
        config, run_dir, checkpoint = prepare(args.config, overrides, resume=args.resume)
    except (ConfigError, RunDirError) as exc:
        raise CliError(str(exc)) from exc
    except KeyboardInterrupt:  # while the config or the checkpoint to resume was being checked
        print("streamrl: interrupted before the run started; nothing was trained or changed", file=sys.stderr)
        return 130
    try:
        summary = run_launch(config, run_dir, checkpoint, sigterm_stops=True)
    except (ConfigError, RunDirError) as exc:  # found once Ray is up (e.g. too few CPUs)
        raise CliError(str(exc)) from exc
    except RunFailed as exc:
        print(f"streamrl: run failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # during start-up, or a second Ctrl-C while stopping
        kept = run_dir.latest_checkpoint_name() if run_dir.path.exists() else None
        if kept:
            where = f"the last complete checkpoint is {kept} (resume with --resume {run_dir.path})"
        elif run_dir.path.exists() and run_dir.read("metrics.jsonl"):
            where = "no checkpoint was written (run.checkpoint_every): the steps trained cannot be resumed"
        else:
            where = "nothing was trained"
        print(f"streamrl: interrupted; {where}", file=sys.stderr)
        return 130
    print(describe_summary(summary))
    print(f"run directory: {run_dir.path}")
    return 130 if summary["stopped_by"] == "interrupted" else 0


def admission(args: argparse.Namespace) -> int:
    import ray
    from ray.exceptions import RayActorError

    from streamrl.buffer.queue import OPERATOR_HOLD

    queue = _queue_of(args.run, args.address)
    was_held = None
    try:
        # The operator's hold only: a pause the launcher holds while it shuts down is not the operator's to lift.
        if args.action == "pause":
            was_held = ray.get(queue.pause.remote(OPERATOR_HOLD))
        elif args.action == "resume":
            was_held = ray.get(queue.resume.remote(OPERATOR_HOLD))
        status = ray.get(queue.status.remote())
    except RayActorError:  # the run ended between finding its queue and asking it
        raise CliError(f"run {args.run!r} has ended: its queue actor is gone") from None
    if args.json:  # one object whatever the action: what it found, and the status after it
        done = {} if was_held is None else {"operator_hold_was_set": was_held}
        print(json.dumps({"run": args.run, "action": args.action, **done, "status": status}
                         if args.action != "status" else status))
        return 0
    if args.action == "pause":
        print(f"{args.run}: admission paused" + (" (it already was, by the operator)" if was_held else ""))
    elif args.action == "resume":
        print(f"{args.run}: " + ("admission resumed by the operator" if was_held
                                 else "the operator had not paused admission: nothing to resume"))
        if status["holds"]:
            print(f"{args.run}: admission stays paused while held by: {', '.join(status['holds'])}")
    else:
        width = max(map(len, status))
        for key, value in status.items():
            print(f"{key:<{width}}  {value}")
    return 0


def bench(args: argparse.Namespace) -> int:
    # The benchmarks and their harness are not in the installed package: they run from a source checkout.
    checkout = Path.cwd()
    scripts = checkout / "benchmarks"
    available = sorted(p.stem for p in scripts.glob("*.py") if not p.name.startswith("_")) if scripts.is_dir() else []
    if not available or not (checkout / "harness").is_dir():
        raise CliError(f"no benchmarks in {checkout}: `streamrl bench` runs the benchmarks of a source checkout "
                       "(git clone the repository, pip install -e . there, and run it from the checkout's root)")
    if args.name is None:
        print("benchmarks: " + ", ".join(available))
        return 0
    if args.name not in available:
        raise CliError(f"unknown benchmark {args.name!r}; choose one of: {', '.join(available)}")
    return _run_to_end([sys.executable, "-m", f"benchmarks.{args.name}", *args.args], cwd=checkout)


_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _run_to_end(command: list[str], cwd: Path) -> int:
    """Run a benchmark in a process group of its own and wait for it; nothing it started outlives it.

    A SIGINT, SIGTERM or SIGHUP sent to `streamrl bench` (`timeout 60 streamrl bench ...` signals this
    process, not the benchmark) is passed on to the benchmark's group, which holds its Ray instance. Ray's
    workers, the run's actors among them, lead groups of their own: they are found as the benchmark's
    descendants when the signal comes, while the tree still holds together (once the Ray instance is gone
    they belong to no one and linger until they notice). When the benchmark has exited, what is left of
    its group and of those is killed, and waited for. The exit status is the benchmark's, or 128 + the
    signal that ended it, as a shell reports it."""
    child: subprocess.Popen | None = None
    pending: list[int] = []  # came while the benchmark was being started
    tree: dict[int, str] = {}  # its processes when the first signal came, each with its start time

    def forward(signum: int, _frame: object = None) -> None:
        if child is None:
            pending.append(signum)
            return
        tree.update(_process_tree(child.pid))
        with contextlib.suppress(ProcessLookupError):  # it has exited: nothing to pass it on to
            os.killpg(child.pid, signum)

    # signal handlers can only be set in the main thread; called elsewhere, the caller handles signals
    in_main = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, forward) for sig in _FORWARDED} if in_main else {}
    try:
        child = subprocess.Popen(command, cwd=cwd, env={**os.environ, "PYTHONUNBUFFERED": "1"}, process_group=0)
        for signum in pending:
            forward(signum)
        code = child.wait()
    finally:
        if child is not None:
            _end_all(child, tree)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 - code if code < 0 else code


def _end_all(child: subprocess.Popen, tree: dict[int, str], timeout_s: float = 10.0) -> None:
    """SIGKILL what is left of the benchmark's group and of `tree`, and wait until it is gone."""
    with contextlib.suppress(ProcessLookupError):  # the group is empty: everything in it has exited
        os.killpg(child.pid, signal.SIGKILL)
    child.wait()
    for pid, since in tree.items():
        if _start_time(pid) == since:  # the same process, not a later one given its pid
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while any(_start_time(pid) == since for pid, since in tree.items()) and time.monotonic() < deadline:
        time.sleep(0.05)


def _stat(pid: int | str) -> list[str] | None:
    """/proc/PID/stat's fields after the name (state, parent, group, ...), None for a process that has
    finished (gone, or a zombie) or where there is no /proc."""
    try:
        text = Path("/proc", str(pid), "stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return None if fields[0] in "ZX" else fields


def _start_time(pid: int | str) -> str | None:
    fields = _stat(pid)
    return None if fields is None else fields[19]


def _process_tree(root: int) -> dict[int, str]:
    """`root` and every running process below it, each with its start time (empty without /proc)."""
    running: dict[int, list[str]] = {}
    for entry in os.scandir("/proc") if os.path.isdir("/proc") else ():
        if entry.name.isdigit() and (fields := _stat(entry.name)) is not None:
            running[int(entry.name)] = fields
    found = {root} & running.keys()
    while grown := {pid for pid, fields in running.items() if int(fields[1]) in found} - found:
        found |= grown
    return {pid: running[pid][19] for pid in found}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="streamrl", description="Fully asynchronous streaming RL for LLMs.")
    verbs = parser.add_subparsers(dest="verb", required=True)

    run = verbs.add_parser("launch", help="train: producers, trainer and weight streaming on Ray")
    run.add_argument("config", nargs="?", help="TOML config (default: the built-in CPU run)")
    run.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help="override one config field")
    run.add_argument("--name", help="run name (actors RUN/..., directory output_dir/RUN)")
    run.add_argument("--address", help="join this Ray cluster (HOST:PORT or auto) instead of starting one")
    run.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its latest checkpoint")
    run.add_argument("--log-level", choices=["debug", "info", "warning", "error"],
                     help="what RUN_DIR/logs/*.log record (default: logging.level, info)")
    run.set_defaults(func=launch)

    adm = verbs.add_parser("admission", help="pause, resume or inspect a running job's admission control")
    adm.add_argument("action", choices=["pause", "resume", "status"])
    adm.add_argument("--run", required=True, help="the run's name")
    adm.add_argument("--address", help="Ray cluster address (default: the local cluster)")
    adm.add_argument("--json", action="store_true",
                     help="one JSON object: the status, or for pause and resume what they found and the status after")
    adm.set_defaults(func=admission)

    b = verbs.add_parser("bench", help="list or run the benchmarks in benchmarks/")
    b.add_argument("name", nargs="?", help="benchmark to run (omit to list them)")
    b.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the benchmark")
    b.set_defaults(func=bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except CliError as exc:
        print(f"streamrl: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
