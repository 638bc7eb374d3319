"""After a run, with or without faults: was any prompt lost or any group trained twice?

```
 groups.jsonl (what each step trained) + the final checkpoint's queue (queued groups, prompts to
 regenerate, prompt cursor)  ─►  every prompt id below the cursor is trained once, or waits in the queue
```
A resumed run truncates `groups.jsonl` to its checkpoint, so the file is the history that survived.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from streamrl.buffer.checkpoint import load_queue
from streamrl.runtime.rundir import RunDir


def audit_run(path: str | Path) -> dict[str, Any]:
    """Counts for a finished run directory (its latest checkpoint must be the end of the run)."""
    run_dir = RunDir.open(path)
    records = run_dir.read("groups.jsonl")
    steps = [r["step"] for r in records]
    trained_prompts = Counter(p for r in records for p in r["prompt_ids"])
    queue = load_queue(run_dir.verified_checkpoint() / "queue")
    waiting = Counter([g.prompt_id for g in queue.queued_groups()] + list(queue.returned_prompts()))
    handed_out = set(range(queue.status()["prompt_cursor"]))
    seen = trained_prompts + waiting
    return {
        "steps": len(steps),
        "steps_in_order": steps == list(range(1, len(steps) + 1)),
        "groups_trained": sum(len(r["group_ids"]) for r in records),
        # a prompt trained twice, or trained and waiting again (a group id twice is its prompt twice)
        "groups_duplicated": sum(n - 1 for n in seen.values() if n > 1),
        "groups_lost": len(handed_out - set(seen)),
        "prompts_handed_out": len(handed_out),
    }
