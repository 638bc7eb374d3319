"""Queue checkpoints: queued groups as one Arrow IPC file, the rest in a JSON manifest.

```
 DIR/manifest.json        version, admission holds, counters, prompt cursor, prompts to regenerate, groups
                          (each with the staleness budget it was admitted under),
                          sha256 of each file
 DIR/queued.arrow         the queued groups' rows, in consumption order
 DIR/ticket_states.bin    one byte per ticket ever issued (so old tickets stay "expired" after restore)
```
The directory is written under a temporary name and renamed into place, so a reader sees either a
complete checkpoint or none. Checksums catch truncated or altered files on restore.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa

from streamrl.buffer.config import QueueConfig
from streamrl.buffer.queue import OPERATOR_HOLD, QueuedGroup, ReplayQueue, assemble
from streamrl.buffer.schema import TRAJECTORY_SCHEMA
from streamrl.buffer.validate import BatchError, validate_batch

FORMAT = "streamrl.queue"
FORMAT_VERSION = 2  # 2: named admission holds instead of a paused flag; groups ordered by ticket, not commit
READABLE_VERSIONS = (1, 2)
MANIFEST = "manifest.json"
QUEUED_FILE = "queued.arrow"
STATES_FILE = "ticket_states.bin"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: missing, truncated, altered or incompatible."""


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fsync_path(path: Path) -> None:
    """Flush a file, or a directory's entries, to disk: a rename survives a crash of the machine only
    once the directory holding it is flushed, and the renamed files only once they are."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_torn_directories(parent: Path) -> None:
    """Remove what `atomic_directory` writers killed mid-write left in `parent` (one writer at a time)."""
    for torn in Path(parent).glob(".*.tmp-*"):
        shutil.rmtree(torn)


def atomic_directory(target: Path, write: Callable[[Path], None]) -> Path:
    """Run `write(tmp_dir)` then rename tmp_dir to `target`, which must not exist yet. Everything written
    is flushed to disk before the rename and the rename after it, so once this returns, the directory
    is whole even if the machine goes down (its files' checksums would otherwise refuse it on resume)."""
    target = Path(target)
    if target.exists():
        raise FileExistsError(f"checkpoint directory {target} already exists")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        write(tmp)
        for path in sorted(tmp.rglob("*"), reverse=True):  # a directory's files before the directory
            fsync_path(path)
        fsync_path(tmp)
        os.rename(tmp, target)
        fsync_path(target.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def save_queue(queue: ReplayQueue, directory: str | Path,
               fetch: Callable[[list[Any]], list[pa.RecordBatch]] | None = None) -> Path:
    """Checkpoint `queue` into a new directory. `fetch` turns payloads into batches (Ray: ray.get)."""
    snap = queue.snapshot()
    groups: list[QueuedGroup] = snap.pop("groups")
    states: bytes = snap.pop("ticket_states")
    batches = fetch([g.payload for g in groups]) if fetch and groups else None
    table = assemble(groups, batches) if groups else TRAJECTORY_SCHEMA.empty_table()

    def write(tmp: Path) -> None:
        with pa.OSFile(str(tmp / QUEUED_FILE), "wb") as sink, pa.ipc.new_file(sink, TRAJECTORY_SCHEMA) as writer:
            writer.write_table(table)
        (tmp / STATES_FILE).write_bytes(states)
        records, row = [], 0
        for g in groups:
            record = {k: v for k, v in g._asdict().items() if k != "payload"}
            records.append({**record, "row_start": row})
            row += g.row_count
        manifest = {
            "format": FORMAT, "format_version": FORMAT_VERSION,
            "config": queue.config.model_dump(), **snap, "groups": records,
            "files": {name: sha256_file(tmp / name) for name in (QUEUED_FILE, STATES_FILE)},
        }
        (tmp / MANIFEST).write_bytes(json.dumps(manifest, indent=1).encode())

    return atomic_directory(Path(directory), write)


def read_manifest(directory: Path) -> dict[str, Any]:
    path = directory / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (not a queue checkpoint, or an interrupted write)")
    try:
        manifest = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a {FORMAT} manifest")
    if manifest.get("format_version") not in READABLE_VERSIONS:
        raise CheckpointError(f"{path}: format version {manifest.get('format_version')!r}, expected one of "
                              f"{READABLE_VERSIONS}")
    for name, expected in manifest.get("files", {}).items():
        file = directory / name
        if not file.is_file():
            raise CheckpointError(f"{file}: missing")
        if sha256_file(file) != expected:
            raise CheckpointError(f"{file}: checksum mismatch (truncated or altered)")
    if set(manifest.get("files", {})) != {QUEUED_FILE, STATES_FILE}:
        raise CheckpointError(f"{path}: expected checksums for {QUEUED_FILE} and {STATES_FILE}")
    return _upgraded(manifest)


def _upgraded(manifest: dict[str, Any]) -> dict[str, Any]:
    """A format-1 manifest in format 2's terms: its paused flag was the operator's (the launcher releases
    its own pause before writing), and its groups' commit sequence numbers are no longer used."""
    if manifest["format_version"] == 1:
        manifest = dict(manifest, format_version=2, holds=[OPERATOR_HOLD] if manifest.pop("paused", False) else [],
                        groups=[{k: v for k, v in g.items() if k != "seq"} for g in manifest.get("groups", [])])
    return manifest


def load_queue(directory: str | Path, config: QueueConfig | None = None,
               wrap: Callable[[pa.RecordBatch], Any] | None = None) -> ReplayQueue:
    """Restore a queue saved by `save_queue`. `config` may change admission settings but not the
    group size or the groups per step (admission's bound counts the groups consumed so far against
    (v + η + 1) · B: with another B the count no longer stands for v steps, and a larger B admitted a
    burst of groups born over budget); under `max_staleness = "auto"` its [auto_min, auto_max] must hold
    the saved η (the staleness controller's own restore refuses one outside it too); `wrap` turns the
    restored batch into the payload kept per group (Ray: ray.put)."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    try:
        saved_config = QueueConfig(**manifest["config"])
        config = config or saved_config
        if config.group_size != saved_config.group_size:
            raise CheckpointError(
                f"group_size {config.group_size} differs from the checkpoint's {saved_config.group_size}")
        if config.groups_per_step != saved_config.groups_per_step:
            raise CheckpointError(f"groups_per_step {config.groups_per_step} differs from the checkpoint's "
                                  f"{saved_config.groups_per_step}")
        with pa.OSFile(str(directory / QUEUED_FILE), "rb") as source:
            table = pa.ipc.open_file(source).read_all()
        groups = _restore_groups(manifest, table, config, wrap)
        snap = {key: manifest[key] for key in ("version", "holds", "counters", "prompt_cursor", "returned_prompts")}
        if "max_staleness" in manifest:  # written since the budget can move (queue.max_staleness = "auto")
            snap["max_staleness"] = manifest["max_staleness"]
        snap["ticket_states"] = (directory / STATES_FILE).read_bytes()
        snap["groups"] = groups
        return ReplayQueue.from_snapshot(config, snap)
    except (KeyError, TypeError, ValueError, pa.ArrowException) as exc:
        raise CheckpointError(f"{directory}: unusable checkpoint ({type(exc).__name__}: {exc})") from exc


def _restore_groups(manifest: dict[str, Any], table: pa.Table, config: QueueConfig,
                    wrap: Callable[[pa.RecordBatch], Any] | None) -> list[QueuedGroup]:
    records = manifest["groups"]
    if not records:
        return []
    try:
        batch, spans = validate_batch(table, group_size=config.group_size,
                                      trainer_version=manifest["version"], vocab_size=config.vocab_size)
    except BatchError as exc:
        raise CheckpointError(f"queued rows fail validation: {exc}") from exc
    if [(s.group_id, s.row_start, s.row_count, s.min_version) for s in spans] != [
            (r["group_id"], r["row_start"], r["row_count"], r["min_version"]) for r in records]:
        raise CheckpointError("queued rows do not match the manifest's groups")
    payload = wrap(batch) if wrap else batch
    return [QueuedGroup(**{**r, "payload": payload}) for r in records]
