"""Tiny launch settings shared by the end-to-end tests (a 2-layer model, 2-digit reversal)."""

from leftovers import track

from harness.chaos.faults import launch_process
from harness.chaos.faults import tiny_settings as tiny
from streamrl.runtime.launch import launch, prepare


def run_tiny(tmp_path, name, *extra, stop=None):
    config, run_dir, checkpoint = prepare(None, tiny(tmp_path, name, *extra))
    return launch(config, run_dir, checkpoint, stop=stop), run_dir


def resume_tiny(run_dir, *overrides):
    config, opened, checkpoint = prepare(None, ["logging.progress=none", *overrides], resume=str(run_dir.path))
    return launch(config, opened, checkpoint)


def launch_subprocess(sets, **kwargs):
    """`streamrl launch` from a terminal, in a process of its own (`launch_process`), killed with its
    process group if the test leaves it running."""
    return track(launch_process(sets, **kwargs))
