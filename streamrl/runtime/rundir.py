"""The run directory: what a run writes, and where a resumed run finds it.

```
 RUN_DIR/
   config.toml        the resolved configuration (a resumed run reads it back)
   metrics.jsonl      one line per trainer step
   groups.jsonl       the groups each step consumed (ids, prompts, producers): the audit trail
   eval.jsonl         held-out evaluations
   events.jsonl       what happened to the run's actors (a producer replaced, a run failed)
   summary.json       written at the end
   model/initial/     the built-in model, when no model.path is given
   checkpoints/step_000200/{trainer/, queue/, meta.json, checksums.json}   and `checkpoints/latest` naming the newest
```
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import threading
from pathlib import Path
from typing import Any

from streamrl.buffer.checkpoint import atomic_directory, fsync_path, remove_torn_directories, sha256_file
from streamrl.config import RunConfig, dump_config, load_config

CHECKSUMS = "checksums.json"  # sha256 of every other file of a checkpoint, written last
# What a run appends to, a line per record (step, step, evaluation, event); a resume cuts the first three back.
METRICS_FILE, GROUPS_FILE, EVAL_FILE, EVENTS_FILE = "metrics.jsonl", "groups.jsonl", "eval.jsonl", "events.jsonl"
STEP_FILES = (METRICS_FILE, GROUPS_FILE, EVAL_FILE)
SUMMARY_FILE = "summary.json"


class RunDirError(RuntimeError):
    """The run directory cannot be created or resumed; the message says why."""


LAUNCHER_PID = ".launcher.pid"  # the pid of the launcher holding the run directory, while it does
_locks: dict[str, list[int]] = {}  # run directory -> [fd, holders]: a process shares its own lock
_locks_guard = threading.Lock()


class RunDir:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._holding = False
        self._made_from: Path | None = None  # the outermost folder `create` made, the run's own or a parent

    # ---- one launcher per run ------------------------------------------------------------------------
    def hold(self) -> None:
        """Take the run's launcher lock, an flock on the directory itself (released by `release`, or when
        the process ends, however it ends). A second launcher on the same directory, a `--resume` of a run
        still going, is refused: it would rewind and write files the running one is appending to."""
        if self._holding:
            return
        key = str(self.path.resolve())
        with _locks_guard:
            if key not in _locks:
                fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    pid = self.path / LAUNCHER_PID
                    holder = pid.read_text().strip() if pid.is_file() else "?"
                    raise RunDirError(f"run directory {str(self.path)!r} is in use by another streamrl launch "
                                      f"(pid {holder}): let it finish or stop it first") from None
                (self.path / LAUNCHER_PID).write_text(f"{os.getpid()}\n")  # removed by the last release
                _locks[key] = [fd, 0]
            _locks[key][1] += 1
            self._holding = True

    def release(self) -> None:
        if not self._holding:
            return
        key = str(self.path.resolve())
        with _locks_guard:
            self._holding = False
            held = _locks[key]
            held[1] -= 1
            if held[1] == 0:
                (self.path / LAUNCHER_PID).unlink(missing_ok=True)
                os.close(held[0])  # closing the descriptor drops the flock
                del _locks[key]

    # ---- files ---------------------------------------------------------------------------------------
    @property
    def config_file(self) -> Path:
        return self.path / "config.toml"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def initial_model(self) -> Path:
        return self.path / "model" / "initial"

    @classmethod
    def create(cls, path: str | Path, config: RunConfig) -> RunDir:
        run = cls(path)
        if run.path.exists():
            raise RunDirError(f"run directory {str(run.path)!r} already exists: pick another run.name, "
                              f"or continue it with --resume {run.path}")
        made_from = run.path.absolute()
        while not made_from.parent.exists():
            made_from = made_from.parent
        try:
            run.path.mkdir(parents=True)
        except OSError as exc:  # a parent that is a file, not writable, or cannot be made (e.g. under /proc)
            raise RunDirError(f"cannot create the run directory {str(run.path)!r} (run.output_dir / run.name): "
                              f"{exc.strerror or exc}") from exc
        run._made_from = made_from
        try:
            run.save_config(config)
        except BaseException:  # a full disk, or Ctrl-C: no half-made run directory is left behind
            run.discard_unstarted()
            raise
        return run

    def save_config(self, config: RunConfig) -> None:
        self._replace(self.config_file.name, dump_config(config))

    def _replace(self, name: str, text: str) -> None:
        """Write `name` whole through a temporary file, flushed before the rename and the rename after it:
        after a crash of the machine the file is the old one or the new one, never empty or torn."""
        tmp = self.path / f".{name}.tmp"
        tmp.write_text(text)
        fsync_path(tmp)
        tmp.replace(self.path / name)
        fsync_path(self.path)

    @classmethod
    def open(cls, path: str | Path) -> RunDir:
        run = cls(path)
        if not run.config_file.is_file():
            raise RunDirError(f"{str(run.path)!r} is not a streamrl run directory (no config.toml)")
        return run

    def discard_unstarted(self) -> None:
        """Remove a run directory that never trained (no metrics, no checkpoint), and the parent folders
        `create` made for it while they stay empty."""
        if (self.path / METRICS_FILE).exists() or self.checkpoints.exists():
            raise RunDirError(f"{str(self.path)!r} holds a run's results; it is not removed")
        self.release()
        shutil.rmtree(self.path)
        if self._made_from is None:
            return
        folder = self.path.absolute().parent
        while self._made_from in folder.parents or folder == self._made_from:
            try:
                folder.rmdir()
            except OSError:  # another run's directory appeared in it meanwhile: it stays
                return
            folder = folder.parent

    def config(self, overrides: list[str] | None = None) -> RunConfig:
        return load_config(self.config_file, overrides)

    def append(self, name: str, record: dict[str, Any]) -> None:
        with open(self.path / name, "a") as f:
            f.write(json.dumps(record) + "\n")

    def read(self, name: str) -> list[dict[str, Any]]:
        """The records of a JSON-lines file. A last line cut short (the launcher killed while appending
        it) is left out; any other line that does not parse is an error naming the file and line."""
        path = self.path / name
        if not path.is_file():
            return []
        text = path.read_text()
        lines = text.splitlines()
        records = []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                if number == len(lines) and not text.endswith("\n"):
                    continue  # torn: its step is trained again (the checkpoint resumed from is older)
                raise RunDirError(f"{str(path)!r} line {number} is not JSON ({exc}); the run directory is "
                                  f"damaged") from None
        return records

    def truncate_after(self, name: str, step: int) -> None:
        """Drop lines of steps after `step` (written after the checkpoint a run resumes from), and a torn
        last line. Written to a temporary file that replaces the old one: a crash leaves one or the other."""
        kept = [r for r in self.read(name) if r.get("step", 0) <= step]
        self._replace(name, "".join(json.dumps(r) + "\n" for r in kept))

    def write_json(self, name: str, value: Any) -> None:
        self._replace(name, json.dumps(value, indent=2) + "\n")

    # ---- checkpoints -----------------------------------------------------------------------------------
    def step_dir(self, step: int) -> Path:
        return self.checkpoints / f"step_{step:06d}"

    def write_checkpoint(self, step: int, write, meta: dict[str, Any], keep: int) -> Path:
        """`write(tmp_dir)` fills a temporary directory that then replaces `step_N` in one rename;
        `latest` is updated last, so a crash mid-checkpoint leaves the previous one in force."""
        def fill(tmp: Path) -> None:
            write(tmp)
            (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
            checksums = {str(f.relative_to(tmp)): sha256_file(f) for f in sorted(tmp.rglob("*")) if f.is_file()}
            (tmp / CHECKSUMS).write_text(json.dumps(checksums, indent=1) + "\n")

        # The step records first: a checkpoint that survives a crash of the machine has every line of the
        # steps it holds (appended lines sit in the page cache until flushed; a resume keeps what is there).
        for name in STEP_FILES:
            if (self.path / name).exists():
                fsync_path(self.path / name)
        self.checkpoints.mkdir(exist_ok=True)
        remove_torn_directories(self.checkpoints)
        return self.make_latest(atomic_directory(self.step_dir(step), fill), keep)

    def make_latest(self, target: Path, keep: int) -> Path:
        """Point `latest` at a complete checkpoint directory and keep the newest `keep`. Also finishes a
        checkpoint of this run whose writer was interrupted after its directory was in place."""
        latest_tmp = self.checkpoints / ".latest.tmp"
        latest_tmp.write_text(target.name + "\n")
        fsync_path(latest_tmp)
        latest_tmp.replace(self.checkpoints / "latest")
        fsync_path(self.checkpoints)
        for old in self.step_checkpoints()[:-keep]:
            shutil.rmtree(old)
        return target

    def step_checkpoints(self) -> list[Path]:
        """The `step_N` checkpoint directories, oldest first: ordered by N, not by name (past step 999,999
        the names grow a digit)."""
        steps = [(int(d.name.removeprefix("step_")), d) for d in self.checkpoints.glob("step_*")
                 if d.name.removeprefix("step_").isdigit()]
        return [directory for _, directory in sorted(steps)]

    def rewind(self, step: int, config: RunConfig) -> list[str]:
        """The directory as it was at checkpoint `step`, for a resumed run once it has started: records of
        later steps dropped, checkpoints of later steps removed (else the resumed run would meet them at
        the same steps), and config.toml the resumed run's (what --set changed holds for the next
        resume). The names of the checkpoints removed."""
        for name in STEP_FILES:
            self.truncate_after(name, step)
        removed = self.discard_checkpoints_after(step)
        self.save_config(config)
        return removed

    def discard_checkpoints_after(self, step: int) -> list[str]:
        """Remove checkpoints of steps after `step` (the one a run resumes from): complete ones a run
        that died before moving `latest` left, from steps the resumed run will train again. Their names."""
        later = [d for d in self.step_checkpoints() if int(d.name.removeprefix("step_")) > step]
        for directory in later:
            shutil.rmtree(directory)
        return [d.name for d in later]

    def latest_checkpoint(self) -> Path:
        pointer = self.checkpoints / "latest"
        if not pointer.is_file():
            raise RunDirError(f"{str(self.path)!r} has no checkpoint to resume from")
        try:
            name = pointer.read_text().strip()
        except UnicodeDecodeError as exc:
            raise RunDirError(f"{str(pointer)!r} does not name a checkpoint ({exc})") from exc
        if not (name.startswith("step_") and name.removeprefix("step_").isdigit()):
            # only a checkpoint of this run: an absolute path or ../ would resume another run's state
            raise RunDirError(f"{str(pointer)!r} names {name[:200]!r}, not a step_N checkpoint of this run")
        target = self.checkpoints / name
        if not (target / "meta.json").is_file():
            raise RunDirError(f"checkpoint {str(target)!r} is incomplete (no meta.json)")
        return target

    def latest_checkpoint_name(self) -> str | None:
        """`step_N` of the latest checkpoint, None before the first."""
        return self.latest_checkpoint().name if (self.checkpoints / "latest").is_file() else None

    def verified_checkpoint(self) -> Path:
        """The latest checkpoint, every file checked against the checksums written with it; a damaged one
        is refused with the file named (and the older checkpoints that do verify, to resume from instead)."""
        target = self.latest_checkpoint()
        problem = checkpoint_problem(target)
        if problem is not None:
            older = [p.name for p in self.step_checkpoints() if p != target and checkpoint_problem(p) is None]
            hint = (f"; {', '.join(older)} verifies: point {self.checkpoints / 'latest'} at it to resume from there"
                    if older else "; no other checkpoint verifies")
            raise RunDirError(f"checkpoint {str(target)!r} is damaged: {problem}{hint}")
        return target


def checkpoint_problem(directory: Path) -> str | None:
    """What is wrong with a checkpoint's files (missing, truncated, altered), or None."""
    listing = directory / CHECKSUMS
    if not listing.is_file():
        return f"{CHECKSUMS} is missing"
    try:
        expected = json.loads(listing.read_text())
    except ValueError as exc:  # UnicodeDecodeError too
        return f"{CHECKSUMS} is not valid JSON ({exc})"
    if not isinstance(expected, dict) or not all(isinstance(v, str) for v in expected.values()):
        return f"{CHECKSUMS} is not a mapping of file names to checksums"
    if "meta.json" not in expected:
        return f"{CHECKSUMS} does not list meta.json"
    for name, digest in expected.items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        if sha256_file(path) != digest:
            return f"{name} does not match its checksum (truncated or altered)"
    try:
        step = json.loads((directory / "meta.json").read_text()).get("step")
    except (ValueError, AttributeError) as exc:
        return f"meta.json is not a JSON object ({exc})"
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return f"meta.json's step is {step!r}, not a step number"
    return None
