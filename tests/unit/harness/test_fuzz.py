"""The bad-input campaign refuses everything it tries, the same way for a seed; and regression tests
for the gaps it found (batches, config files and --set, prompt files)."""

import json
import re
import signal
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from harness.chaos import bad_configs
from harness.chaos.bad_rows import CharTokenizer
from harness.chaos.cases import Case, error_naming, judge
from harness.chaos.fuzz import KINDS, run_bad_input_campaign
from streamrl.buffer import BatchError
from streamrl.config import ConfigError, TaskSection, load_config
from streamrl.tasks.files import FileTask, read_rows

# ---- the campaign --------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_refuses_every_bad_input_and_changes_nothing(kind):
    result = run_bad_input_campaign(100, seed=7, kinds=[kind])
    counts = result["by_kind"][kind]
    assert counts["tried"] == 100 and result["tried"] == 100
    assert counts["accepted"] == 0, result["accepted_examples"]
    assert counts["wrong_error"] == 0 and counts["state_changed"] == 0, result["wrong_examples"]


def test_the_campaign_is_deterministic_for_a_seed():
    first = run_bad_input_campaign(80, seed=3)
    assert run_bad_input_campaign(80, seed=3) == first
    assert run_bad_input_campaign(80, seed=4)["digest"] != first["digest"]
    assert {k: v["tried"] for k, v in first["by_kind"].items()} == {k: 20 for k in KINDS}


def test_a_campaign_of_a_thousand(capsys):
    started = time.perf_counter()
    result = run_bad_input_campaign(1000, seed=0)
    elapsed = time.perf_counter() - started
    with capsys.disabled():  # a measurement, not an assertion (benchmarks hold the timings)
        print(f"\nrun_bad_input_campaign(1000, 0): {result['tried']} tried, {result['accepted']} accepted, "
              f"{result['wrong_error']} wrong errors, {result['state_changed']} state changes in {elapsed:.1f} s")
    assert result["tried"] == 1000 and result["accepted"] == 0, result["accepted_examples"]
    assert result["wrong_error"] == 0 and result["state_changed"] == 0, result["wrong_examples"]


def test_judge_tells_each_verdict_apart():
    def raises(exc):
        def attempt():
            raise exc
        return attempt

    wants_value_error = error_naming(ValueError, "field")
    assert judge(Case("ok", raises(ValueError("bad field")), wants_value_error)) == ("refused", None)
    assert judge(Case("silent", lambda: None, wants_value_error))[0] == "accepted"
    assert judge(Case("type", raises(KeyError("field")), wants_value_error))[0] == "wrong_error"
    assert judge(Case("words", raises(ValueError("bad")), wants_value_error))[0] == "wrong_error"
    counter = iter(range(10))
    verdict, problem = judge(Case("state", raises(ValueError("field")), wants_value_error, state=lambda: next(counter)))
    assert verdict == "state_changed" and problem == "state differs"
    assert judge(Case("control", raises(ValueError("field")), wants_value_error,
                      after=lambda: "the valid input fails"))[0] == "state_changed"


def test_an_accepted_bad_input_is_counted(monkeypatch):
    monkeypatch.setattr(bad_configs, "load_config", lambda path=None, overrides=None: None)
    result = run_bad_input_campaign(12, seed=0, kinds=["config"])
    assert result["accepted"] == 12 and len(result["accepted_examples"]) == 10


def test_a_launch_that_passes_every_check_hits_the_trap_and_nothing_runs(monkeypatch):
    import streamrl.runtime.launch as launch_module

    real_launch, handler = launch_module.launch, signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(launch_module, "prepare", lambda *args, **kwargs: (None, None, None))
    result = run_bad_input_campaign(45, seed=0, kinds=["cli"])
    assert 0 < result["accepted"] < 45 and all("launch" in e for e in result["accepted_examples"])
    assert launch_module.launch is real_launch and signal.getsignal(signal.SIGTERM) is handler


# ---- batches ----------------------------------------------------------------------------------------------

def test_a_slice_whose_parent_has_a_null_element_elsewhere_commits(queue, rng):
    """The null check read the list column's whole child array: a valid slice raised IndexError."""
    from harness.synthetic import synthetic_batch

    tickets = queue.admit(0, 2).tickets
    good = synthetic_batch(tickets, 4, rng=rng)
    logprobs = good.column("behavior_logprobs").to_pylist()
    logprobs[0][0] = None
    index = good.schema.get_field_index("behavior_logprobs")
    parent = good.set_column(index, good.schema.field(index), pa.array(logprobs, pa.list_(pa.float32())))
    assert queue.commit(parent.slice(4, 4)) == [tickets[1].ticket_id]
    with pytest.raises(BatchError, match=r"column 'behavior_logprobs', row 0: null element"):
        queue.commit(parent.slice(0, 4))


def test_a_duplicated_column_is_named(queue, rng):
    from harness.synthetic import synthetic_batch

    good = synthetic_batch(queue.admit(0, 1).tickets, 4, rng=rng)
    twice = good.append_column(good.schema.field("reward"), good.column("reward"))
    with pytest.raises(BatchError, match=r"column 'reward': duplicate column"):
        queue.commit(twice)


# ---- config files and --set --------------------------------------------------------------------------------

@pytest.mark.parametrize("item, field", [
    ("run.steps=true", "run.steps"),  # was 1 step
    ('trainer.lr="0.001"', "trainer.lr"),  # a string was read as a number
    ("task.digits=3.0", "task.digits"),
    ("trainer.lr=inf", "trainer.lr"),
    ("trainer.collective_timeout_s=inf", "trainer.collective_timeout_s"),
    ("run.time_limit_s=nan", "run.time_limit_s"),
    ("loss.clip_high=inf", "loss.clip_high"),
    (f"run.seed={2**64}", "run.seed"),
    (f"queue.capacity_tokens={10**30}", "queue.capacity_tokens"),
    ("trainer.betas=[1.5, 0.9]", "trainer.betas"),  # torch refused it only when the trainer started
    ("trainer.betas=[0.9, -0.1]", "trainer.betas"),
    ("producers.sglang.launcher=[]", "producers.sglang.launcher"),
    (".steps=1", "empty name"),
    ("run..steps=1", "empty name"),
    ("run.=1", "empty name"),
])
def test_values_the_loader_used_to_accept_or_misreport(item, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(overrides=[item])


def test_numbers_keep_their_usual_forms():
    config = load_config(overrides=["trainer.lr=1", "run.time_limit_s=30", "trainer.betas=[0, 0.5]",
                                    "run.name=2024-06-01"])  # a date-like --set value is the string
    assert config.trainer.lr == 1.0 and config.trainer.betas == (0.0, 0.5) and config.run.name == "2024-06-01"


def test_config_files_that_are_not_utf8_dates_or_directories(tmp_path):
    latin = tmp_path / "latin.toml"
    latin.write_bytes('[run]\nname = "café"\n'.encode("latin-1"))
    with pytest.raises(ConfigError, match="latin.toml' is not UTF-8 text"):
        load_config(latin)
    dated = tmp_path / "dated.toml"
    dated.write_text("[run]\nname = 2024-06-01\n")
    with pytest.raises(ConfigError, match=r"run\.name: a TOML date is not a valid value"):
        load_config(dated)  # was a TypeError from json.dumps
    with pytest.raises(ConfigError, match="is not a file"):
        load_config(tmp_path)


# ---- prompt files ------------------------------------------------------------------------------------------

def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("rows, message", [
    ([{"prompt": "a"}, {"prompt": ""}], r"row 1 \(line 2\): the prompt is empty"),
    ([{"prompt": "a"}, {"prompt": " \t"}], r"row 1 \(line 2\): the prompt is empty"),
    ([{"prompt": "a"}, {"prompt": None}], r"row 1 \(line 2\): no prompt"),
    ([{"prompt": "a"}, {"question": "b"}], r"row 1 \(line 2\): no prompt"),
    ([{"prompt": "a"}, {"prompt": 3}], r"row 1 \(line 2\): column 'prompt' holds 3 \(int\), not text"),
    ([{"prompt": "a"}, ["b"]], r"line 2 is not a JSON object"),
])
def test_bad_rows_are_refused_at_load_time_with_the_file_and_row(tmp_path, rows, message):
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    with pytest.raises(ValueError, match=f"prompt file '{re.escape(str(path))}'.*{message}"):
        read_rows(path, "prompt")


def test_bytes_broken_files_and_empty_files(tmp_path):
    broken = tmp_path / "broken.jsonl"
    broken.write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"broken.jsonl': line 2 is not UTF-8 text"):
        read_rows(broken, "prompt")
    cut = tmp_path / "cut.jsonl"
    cut.write_bytes(b'{"prompt": "ok"}\n{"prompt": "o\n')
    with pytest.raises(ValueError, match=r"cut.jsonl': line 2 is not valid JSON"):
        read_rows(cut, "prompt")
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty.jsonl' has no rows"):
        read_rows(empty, "prompt")
    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes(b"PAR1 not really PAR1")
    with pytest.raises(ValueError, match="corrupt.parquet' is not a readable Parquet file"):
        read_rows(corrupt, "prompt")


def test_large_and_dictionary_string_columns_are_text(tmp_path):
    for name, array in (("large", pa.array(["a", "b"], pa.large_string())),
                        ("dictionary", pa.array(["a", "b"]).dictionary_encode())):
        pq.write_table(pa.table({"prompt": array}), tmp_path / f"{name}.parquet")
        assert read_rows(tmp_path / f"{name}.parquet", "prompt") == [{"prompt": "a"}, {"prompt": "b"}]


def file_section(prompts, **kw):
    return TaskSection(kind="file", prompts=str(prompts), reward="harness.chaos.bad_rows:zero_reward", **kw)


def test_a_file_task_tokenizes_every_prompt_when_the_context_is_known(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "abc"}, {"prompt": "x" * 9}, {"prompt": "\u200b"}])
    tokenizer = CharTokenizer()
    task = FileTask(file_section(path), tokenizer)  # no limit: nothing tokenized up front, as before
    assert task.prompt(0) == tokenizer("abc").input_ids
    task.close()
    with pytest.raises(ValueError, match=r"row 1 \(line 2\): the prompt is 9 tokens, more than the 8"):
        FileTask(file_section(path), tokenizer, max_prompt_tokens=8)
    with pytest.raises(ValueError, match=r"row 2 \(line 3\): the prompt tokenizes to nothing"):
        FileTask(file_section(path), tokenizer, max_prompt_tokens=9)
    train = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "abc"}])
    held_out = write_jsonl(tmp_path / "held-out.jsonl", [{"prompt": "y" * 12}])
    with pytest.raises(ValueError, match=r"held-out.jsonl', row 0 \(line 1\): the prompt is 12 tokens"):
        FileTask(file_section(train, eval_prompts=str(held_out)), tokenizer, max_prompt_tokens=10)


def test_the_launch_check_refuses_a_prompt_longer_than_the_models_context(tmp_path, tiny_model_dir):
    from streamrl.runtime.preflight import check_model_and_task

    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "12>"}, {"prompt": "1" * 40 + ">"}])
    config = load_config(overrides=["task.kind=file", f"task.prompts={json.dumps(str(path))}",
                                    'task.reward="harness.chaos.bad_rows:zero_reward"',
                                    "sampling.max_new_tokens=3", f"model.path={json.dumps(str(tiny_model_dir))}"])
    positions = json.loads((tiny_model_dir / "config.json").read_text())["max_position_embeddings"]
    with pytest.raises(ConfigError, match=rf"task: prompt file .*row 1 \(line 2\): the prompt is \d+ tokens, more than "
                                          rf"the {positions - 3}"):  # room for the response
        check_model_and_task(config)
