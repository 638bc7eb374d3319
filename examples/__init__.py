"""Runnable examples (`examples/*/README.md`); a package so that `python -m examples.<name>.prepare` and
reward specs such as `examples.own_task.reward:score` import from the repository root."""
