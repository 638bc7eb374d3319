import json
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from streamrl.config import TaskSection
from streamrl.tasks import make_task

REWARD_MODULE = '''
def exact(completion, row):
    return float(completion == row["answer"])
'''


@pytest.fixture
def files(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(REWARD_MODULE)
    rows = [{"prompt": "12>", "answer": "21"}, {"prompt": "345>", "answer": "543"}]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.Table.from_pylist(rows[:1]), tmp_path / "eval.parquet")
    yield tmp_path
    sys.modules.pop("my_rewards", None)


def section(tmp_path, **kw):
    base = dict(kind="file", prompts=str(tmp_path / "train.jsonl"), eval_prompts=str(tmp_path / "eval.parquet"),
                reward="my_rewards:exact")
    return TaskSection(**{**base, **kw})


def test_prompts_cycle_through_the_file_and_rewards_see_the_row(files, tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    task = make_task(section(files), tokenizer, search_path=str(files))
    assert task.prompt(0) == tokenizer("12>").input_ids and task.prompt(3) == task.prompt(1)
    answer = tokenizer("21").input_ids + [tokenizer.eos_token_id]
    assert task.reward(0, answer) == 1.0 and task.reward(2, answer) == 1.0 and task.reward(1, answer) == 0.0
    assert len(task.eval_prompts()) == 1 and task.eval_reward(0, answer) == 1.0
    assert task.stop_token_ids == (tokenizer.eos_token_id,)


@pytest.mark.parametrize("change, message", [
    ({"reward": "my_rewards:missing"}, "has no function 'missing'"),
    ({"reward": "no_such_module:f"}, "cannot import module 'no_such_module'"),
    ({"reward": "just_a_name"}, "expected module:function"),
    ({"prompt_field": "question"}, "has no column 'question'"),
    ({"prompts": "/nonexistent.jsonl"}, "does not exist"),
])
def test_bad_task_files_are_named_in_the_error(files, tiny_model_dir, change, message):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        make_task(section(files, **change), tokenizer, search_path=str(files))


def test_a_non_finite_reward_is_a_recorded_failure_with_the_fallback_reward(files, tiny_model_dir):
    (files / "nan_rewards.py").write_text("def nan(completion, row):\n    return float('nan')\n")
    task = make_task(section(files, reward="nan_rewards:nan"), AutoTokenizer.from_pretrained(tiny_model_dir),
                     search_path=str(files))
    assert task.reward(0, [4]) == 0.0 and task.reward_failures() == {"nan": 1}
    task.close()
    sys.modules.pop("nan_rewards", None)
