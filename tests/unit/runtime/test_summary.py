"""summary.json from a run directory's files."""

from streamrl.config import load_config
from streamrl.runtime.rundir import METRICS_FILE, RunDir
from streamrl.runtime.summary import summarize


def test_the_summary_counts_every_steps_tokens_and_checks_the_bound(tmp_path):
    config = load_config(overrides=["queue.max_staleness=2"])
    run_dir = RunDir.create(tmp_path / "run", config)
    for step, (tokens, staleness) in enumerate([(40, 0), (55, 2), (61, 1)], start=1):
        run_dir.append(METRICS_FILE, {"step": step, "elapsed_s": step * 1.5, "reward_mean": 0.1 * step,
                                      "staleness_mean": staleness / 2, "staleness_max": staleness,
                                      "trained_tokens": tokens, "tokens_per_s": tokens / 1.5, "trainer_wait_s": 0.25})
    summary = summarize(run_dir, config, stopped_by="steps", final_eval={}, producers=[], weight_histories=[],
                        queue={})
    # was the last step's count: metrics.jsonl holds each step's tokens, the summary the run's
    assert summary["trained_tokens"] == 40 + 55 + 61
    assert summary["steps"] == 3 and summary["staleness_max"] == 2 and summary["staleness_bound_held"]
    assert summary["trainer_wait_s_total"] == 0.75
