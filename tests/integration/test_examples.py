"""The runnable examples: each one's prepare script, then a few steps of its own config (the whole run,
learning included, is measured by hand: see each example's README)."""

import json
import os

import pytest
from checkout import ROOT

from examples.gpu.gsm8k_reward import final_number
from examples.gpu.gsm8k_reward import score as gsm8k_score
from examples.math_long_tail.reward import score as math_score
from streamrl.runtime.launch import launch, prepare


@pytest.mark.parametrize("example", ["own_task", "math_long_tail"])
def test_an_example_prepares_its_data_and_runs_its_own_config(ray_local, tmp_path, monkeypatch, example):
    module = __import__(f"examples.{example}.prepare", fromlist=["prepare"])
    module.prepare(tmp_path / "made")
    made = tmp_path / "made"
    monkeypatch.chdir(ROOT)  # the config's reward module imports from the repository root, as documented
    config, run_dir, checkpoint = prepare(str(ROOT / "examples" / example / "config.toml"), [
        "run.steps=3", "run.eval_every=0", "producers.count=1", "logging.progress=none",
        f"run.output_dir={json.dumps(str(tmp_path / 'runs'))}", f"model.path={json.dumps(str(made / 'checkpoint'))}",
        f"task.prompts={json.dumps(str(made / 'data' / 'train.jsonl'))}",
        f"task.eval_prompts={json.dumps(str(made / 'data' / 'eval.jsonl'))}"])
    summary = launch(config, run_dir, checkpoint)
    assert summary["stopped_by"] == "steps" and summary["steps"] == 3
    metrics = run_dir.read("metrics.jsonl")
    assert all(0 <= m["reward_mean"] <= 1 for m in metrics)
    assert not any(p["reward_failures"] for p in summary["producers"])  # the reward module ran cleanly
    assert os.listdir(run_dir.path / "logs")


def test_the_math_reward_extracts_the_leading_digits_and_checks_each():
    row = {"answer": "627"}
    assert math_score(["627", "62", "6270", "x", "627 is it"], row) == [1.0, 2 / 3, 0.75, 0.0, 1.0]
    assert math_score.batched is True


def test_the_gsm8k_reward_compares_final_numbers():
    row = {"answer": "She pays 3 * 4 = 12 dollars.\n#### 1,200"}
    assert final_number(row["answer"]) == "1200"
    assert gsm8k_score("so the total is 1200.", row) == 1.0
    assert gsm8k_score("#### 1200.0", row) == 1.0
    assert gsm8k_score("12 then 1201", row) == 0.0 and gsm8k_score("no number", row) == 0.0
