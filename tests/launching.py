"""Tiny launch settings shared by the end-to-end tests (a 2-layer model, 2-digit reversal)."""

import json

from streamrl.runtime.launch import launch, prepare

TINY = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "model.intermediate_size=64",
        "task.digits=2", "queue.group_size=4", "queue.groups_per_step=4", "queue.max_in_flight=8",
        "producers.groups_per_batch=2", "run.eval_every=3", "run.checkpoint_every=3", "task.eval_size=16",
        "logging.progress=none", "run.time_limit_s=null"]


def tiny(tmp_path, name, *extra):
    return [*TINY, f"run.output_dir={json.dumps(str(tmp_path))}", f"run.name={name}", *extra]


def run_tiny(tmp_path, name, *extra, stop=None):
    config, run_dir, checkpoint = prepare(None, tiny(tmp_path, name, *extra))
    return launch(config, run_dir, checkpoint, stop=stop), run_dir


def resume_tiny(run_dir, *overrides):
    config, opened, checkpoint = prepare(None, ["logging.progress=none", *overrides], resume=str(run_dir.path))
    return launch(config, opened, checkpoint)
