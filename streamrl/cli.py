"""The `streamrl` command: a handful of verbs.

    streamrl launch [CONFIG.toml] [--set section.key=value ...] [--name NAME] [--address ADDR] [--resume RUN_DIR]
    streamrl admission pause|resume|status --run NAME [--address ADDR] [--json]
    streamrl bench [NAME [ARGS ...]]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path


class CliError(Exception):
    """A user error: printed as one line, exit status 2."""


def _connect(address: str | None) -> None:
    import ray

    from streamrl.runtime.connect import RayConnectError, join_cluster

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

    from streamrl.buffer.queue import OPERATOR_HOLD

    queue = _queue_of(args.run, args.address)
    # The operator's hold only: a pause the launcher holds while it shuts down is not the operator's to lift.
    if args.action == "pause":
        was_held = ray.get(queue.pause.remote(OPERATOR_HOLD))
        print(f"{args.run}: admission paused" + (" (it already was, by the operator)" if was_held else ""))
    elif args.action == "resume":
        was_held = ray.get(queue.resume.remote(OPERATOR_HOLD))
        print(f"{args.run}: " + ("admission resumed by the operator" if was_held
                                 else "the operator had not paused admission: nothing to resume"))
    status = ray.get(queue.status.remote())
    if args.action == "resume" and status["holds"]:
        print(f"{args.run}: admission stays paused while held by: {', '.join(status['holds'])}")
    if args.action == "status":
        if args.json:
            print(json.dumps(status))
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
    command = [sys.executable, "-m", f"benchmarks.{args.name}", *args.args]
    return subprocess.call(command, cwd=checkout, env={**os.environ, "PYTHONUNBUFFERED": "1"})


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
    adm.add_argument("--json", action="store_true", help="status as one JSON object")
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
