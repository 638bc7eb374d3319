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


@pytest.mark.parametrize("source, message", [
    ('raise RuntimeError("boom at import")\n', r"RuntimeError: boom at import \(at failing_rewards\.py:1\)"),
    ("def exact(completion, row:\n", r"SyntaxError: .*\(failing_rewards\.py, line 1\)"),
    ("import sys\nsys.exit(3)\n", r"SystemExit: 3 \(at failing_rewards\.py:2\)"),
    ("import no_such_dependency\n", r"cannot import module 'failing_rewards': No module named 'no_such_dependency'"),
])
def test_a_reward_module_that_fails_as_it_is_imported_is_refused_naming_it(files, tiny_model_dir, source, message):
    """Only an ImportError was caught: a module that raised anything else at import, or did not parse,
    ended `streamrl launch` in a traceback of the import machinery (outside review)."""
    (files / "failing_rewards.py").write_text(source)
    with pytest.raises(ValueError, match=r"reward 'failing_rewards:exact': .*" + message):
        make_task(section(files, reward="failing_rewards:exact"), AutoTokenizer.from_pretrained(tiny_model_dir),
                  search_path=str(files))


def test_a_reward_modules_exit_is_placed_on_its_own_line_when_a_library_wraps_sys_exit(files, tiny_model_dir,
                                                                                      monkeypatch):
    """wandb wraps sys.exit once a run has used it: the deepest frame was then the wrapper's (the suite
    failed this way when a wandb test ran first), not the module's own line."""
    real_exit = sys.exit

    def wrapped_exit(code=None):  # as wandb's ExitHooks.exit does
        real_exit(code)

    monkeypatch.setattr(sys, "exit", wrapped_exit)
    (files / "exiting_rewards.py").write_text("import sys\nsys.exit(3)\n")
    with pytest.raises(ValueError, match=r"raised SystemExit: 3 \(at exiting_rewards\.py:2\)"):
        make_task(section(files, reward="exiting_rewards:exact"), AutoTokenizer.from_pretrained(tiny_model_dir),
                  search_path=str(files))


def test_a_non_finite_reward_is_a_recorded_failure_with_the_fallback_reward(files, tiny_model_dir):
    (files / "nan_rewards.py").write_text("def nan(completion, row):\n    return float('nan')\n")
    task = make_task(section(files, reward="nan_rewards:nan"), AutoTokenizer.from_pretrained(tiny_model_dir),
                     search_path=str(files))
    assert task.reward(0, [4]) == 0.0 and task.reward_failures() == {"nan": 1}
    task.close()
    sys.modules.pop("nan_rewards", None)


# A chat template in the tiny tokenizer's own characters: system "=S,", user text, the assistant after ">".
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'system' %}={{ m.content }},"
            "{% elif m.role == 'user' %}{{ m.content }}{% else %}>{{ m.content }}{{ eos_token }}{% endif %}"
            "{% endfor %}{% if add_generation_prompt %}>{% endif %}")


@pytest.fixture
def chat_tokenizer(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def write_chats(path, chats):
    path.write_text("".join(json.dumps({"prompt": chat, "answer": "21"}) + "\n" for chat in chats))
    return str(path)


def test_text_and_chat_prompts_go_through_the_chat_template(files, chat_tokenizer):
    ids = chat_tokenizer.convert_tokens_to_ids
    plain = make_task(section(files, chat_template=True), chat_tokenizer, search_path=str(files))
    assert plain.prompt(0) == ids(["<bos>", "1", "2", ">", ">"])  # the text "12>" as a user message
    system = make_task(section(files, chat_template=True, system_prompt="9"), chat_tokenizer, search_path=str(files))
    assert system.prompt(0) == ids(["<bos>", "=", "9", ",", "1", "2", ">", ">"])
    chats = write_chats(files / "chats.jsonl", [
        [{"role": "system", "content": "3"}, {"role": "user", "content": "12"}],
        [{"role": "user", "content": "4"}, {"role": "assistant", "content": "5"}, {"role": "user", "content": "6"}]])
    task = make_task(section(files, prompts=chats, chat_template=True, system_prompt="9", eval_prompts=None),
                     chat_tokenizer, search_path=str(files), max_prompt_tokens=20)
    assert task.prompt(0) == ids(["<bos>", "=", "3", ",", "1", "2", ">"])  # its own system message is kept
    assert task.prompt(1) == ids(["<bos>", "=", "9", ",", "4", ">", "5", "<eos>", "6", ">"])
    answer = chat_tokenizer("21").input_ids + [chat_tokenizer.eos_token_id]
    assert task.reward(0, answer) == 1.0  # the reward sees the decoded completion and the row


@pytest.mark.parametrize("chats, message", [
    ([[{"role": "user", "content": "1"}], [{"role": "robot", "content": "2"}]],
     r"row 1 \(line 2\): message 0 has role 'robot', not one of system, user, assistant, tool"),
    ([[{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"}]],
     r"row 0 \(line 1\): the chat ends with an assistant message"),
    ([[{"role": "user", "content": "1"}], []], r"row 1 \(line 2\): the chat has no messages"),
])
def test_malformed_chats_are_refused_naming_the_row(files, chat_tokenizer, chats, message):
    with pytest.raises(ValueError, match=message):
        make_task(section(files, prompts=write_chats(files / "bad.jsonl", chats), chat_template=True,
                          eval_prompts=None), chat_tokenizer, search_path=str(files))


def test_chats_without_the_template_and_a_template_the_tokenizer_lacks_are_refused(files, chat_tokenizer,
                                                                                    tiny_model_dir):
    chats = write_chats(files / "chats.jsonl", [[{"role": "user", "content": "12"}]])
    with pytest.raises(ValueError, match=r"holds chat messages, which need the model's chat template: set "
                                         r"task\.chat_template = true"):
        make_task(section(files, prompts=chats, eval_prompts=None), chat_tokenizer, search_path=str(files))
    with pytest.raises(ValueError, match=r"task\.chat_template = true, but the tokenizer .* has no chat template"):
        make_task(section(files, chat_template=True), AutoTokenizer.from_pretrained(tiny_model_dir),
                  search_path=str(files))


BATCHED = '''
def group(completions, row):
    return [float(len(completions))] * len(completions)  # one call saw the whole group
group.batched = True

def short(completions, row):
    return [1.0]
short.batched = True

def scalar(completions, row):
    import numpy
    return numpy.array(0.5)  # has __len__, which raises: one number, not one per completion
scalar.batched = True
'''


@pytest.mark.parametrize("isolation", ["process", "inline"])
def test_a_batched_reward_is_called_once_per_group(files, tiny_model_dir, isolation):
    from streamrl.tasks import group_rewards

    (files / "batched_rewards.py").write_text(BATCHED)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    task = make_task(section(files, reward="batched_rewards:group", reward_isolation=isolation, reward_max=10),
                     tokenizer, search_path=str(files))
    assert group_rewards(task, 0, [[4], [5, 6], [7]]) == [3.0, 3.0, 3.0]
    assert task.reward(0, [4]) == 1.0  # one sample alone is a group of one
    task.close()
    wrong = make_task(section(files, reward="batched_rewards:short", reward_isolation=isolation), tokenizer,
                      search_path=str(files))
    assert group_rewards(wrong, 0, [[4], [5]]) == [0.0, 0.0]  # a list of the wrong length fails each sample
    assert wrong.reward_failures() == {"not_a_number": 2}
    wrong.close()
    scalar = make_task(section(files, reward="batched_rewards:scalar", reward_isolation=isolation), tokenizer,
                       search_path=str(files))
    assert group_rewards(scalar, 0, [[4], [5]]) == [0.0, 0.0]  # was a TypeError (inline: the producer failed)
    assert scalar.reward_failures() == {"not_a_number": 2}
    scalar.close()
    sys.modules.pop("batched_rewards", None)


def test_generation_stops_at_every_eos_token_the_model_lists(files, tiny_model_dir, tmp_path_factory):
    """A chat model ends its turn with a token its tokenizer need not call eos (Qwen2.5-Instruct's
    generation_config lists <|im_end|> and <|endoftext|>): stopping at the tokenizer's alone ran every
    response on to max_new_tokens."""
    import shutil

    model_dir = tmp_path_factory.mktemp("instruct") / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert make_task(section(files), tokenizer, search_path=str(files)).stop_token_ids == (tokenizer.eos_token_id,)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, tokenizer.eos_token_id, 6]}))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    task = make_task(section(files), tokenizer, search_path=str(files))
    assert task.stop_token_ids == (tokenizer.eos_token_id, 5, 6)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": "</s>"}))
    with pytest.raises(ValueError, match="generation_config.json: eos_token_id must be a token id"):
        make_task(section(files), tokenizer, search_path=str(files))
    (model_dir / "generation_config.json").write_text('{"eos_token_id": [5,')
    with pytest.raises(ValueError, match="generation_config.json is not a JSON object"):
        make_task(section(files), tokenizer, search_path=str(files))


# ---- JSON lines: each line its own record ------------------------------------------------------------------

def write_lines(path, records, blank_after=()):
    """One JSON object a line; a blank line after each 0-based record index in `blank_after`."""
    path.write_text("".join(json.dumps(r) + "\n" + ("\n" if i in blank_after else "") for i, r in enumerate(records)))
    return path


def test_a_rows_values_are_the_files_values(files, tiny_model_dir):
    """Arrow's reader gave a column one type: a fraction on one line made every answer a float (4 -> 4.0,
    so `str(row["answer"])` never matched) and integers past 2**53 came back rounded."""
    from streamrl.tasks.files import read_rows

    big = 18446744073709551617  # 2**64 + 1
    path = write_lines(files / "mixed.jsonl", [{"prompt": "2+2", "answer": 4}, {"prompt": "1/2", "answer": 0.5},
                                               {"prompt": "big", "answer": big},
                                               {"prompt": "name", "answer": "four", "extra": [1, None]}])
    rows = read_rows(path, "prompt")
    assert [row["answer"] for row in rows] == [4, 0.5, big, "four"]
    assert type(rows[0]["answer"]) is int and rows[2]["answer"] == big and "extra" not in rows[0]
    (files / "str_rewards.py").write_text("def exact(completion, row):\n    return float(completion == str(row['answer']))\n")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    task = make_task(section(files, prompts=str(path), reward="str_rewards:exact", eval_prompts=None), tokenizer,
                     search_path=str(files))
    assert task.reward(0, tokenizer("4").input_ids + [tokenizer.eos_token_id]) == 1.0
    task.close()
    sys.modules.pop("str_rewards", None)


def test_a_chat_file_whose_answers_mix_types_and_a_line_over_a_megabyte_load(files):
    from streamrl.tasks.files import read_rows

    chat = [{"role": "user", "content": "12"}]
    path = write_lines(files / "chats.jsonl", [{"prompt": chat, "answer": 21}, {"prompt": chat, "answer": "21"}])
    assert [row["answer"] for row in read_rows(path, "prompt", messages=True)] == [21, "21"]
    long = write_lines(files / "long.jsonl", [{"prompt": "short"}, {"prompt": "x " * 750_000}])  # a 1.5 MB line
    assert [len(row["prompt"]) for row in read_rows(long, "prompt")] == [5, 1_500_000]


def test_a_file_of_many_blocks_and_blank_lines_names_the_row_and_its_line(files):
    """Arrow read JSON in 1 MB blocks and named a row within its block ("row 12809" for line 200,001),
    and a type change in any column failed the file."""
    from streamrl.tasks.files import read_rows

    records = [{"prompt": f"prompt {i}", "answer": i} for i in range(40_000)] + [{"prompt": "last", "answer": "x"}]
    path = write_lines(files / "many.jsonl", records, blank_after={10})
    rows = read_rows(path, "prompt")
    assert len(rows) == 40_001 and rows[-1] == {"prompt": "last", "answer": "x"} and rows[11]["answer"] == 11
    records[30_000]["prompt"] = 7
    path = write_lines(files / "many.jsonl", records, blank_after={10, 20})
    with pytest.raises(ValueError, match=r"many.jsonl', row 30000 \(line 30003\): column 'prompt' holds 7 \(int\), "
                                         r"not text"):
        read_rows(path, "prompt")


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_a_null_or_non_object_message_is_refused_naming_the_row(files, suffix):
    from streamrl.tasks.files import read_rows

    good = [{"role": "user", "content": "hi"}]
    chats = [good, good + [None]] if suffix == ".parquet" else [good, good + [None], good + ["hi"]]
    path = files / f"chats{suffix}"
    if suffix == ".parquet":
        pq.write_table(pa.table({"prompt": chats}), path)
    else:
        write_lines(path, [{"prompt": chat} for chat in chats])
    with pytest.raises(ValueError, match=r"row 1( \(line 2\))?: message 1 is None, not an object"):
        read_rows(path, "prompt", messages=True)
    if suffix == ".jsonl":
        write_lines(path, [{"prompt": good + ["hi"]}])
        with pytest.raises(ValueError, match=r"row 0 \(line 1\): message 1 is 'hi', not an object"):
            read_rows(path, "prompt", messages=True)


def test_an_unpaired_surrogate_is_refused_and_a_byte_order_mark_is_skipped(files):
    """`json` reads the escape "\\ud800" as it is, a string no tokenizer can take (Arrow refused it,
    naming only a row within a block)."""
    from streamrl.tasks.files import read_rows

    path = files / "surrogate.jsonl"
    path.write_text('{"prompt": "\\ud83d\\ude00 ok"}\n{"prompt": "a\\ud800b"}\n')
    with pytest.raises(ValueError, match=r"surrogate.jsonl': line 2 is not UTF-8 text \(an unpaired surrogate, "
                                         r"\\ud800\)"):
        read_rows(path, "prompt")
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "\\ud83d\\ude00 ok"}\r\n  {"prompt": "b"}\r\n')
    assert read_rows(path, "prompt") == [{"prompt": "\U0001f600 ok"}, {"prompt": "b"}]


@pytest.mark.parametrize("value", ["9" * 5000, "[" * 100_000 + "]" * 100_000])
def test_a_line_json_cannot_read_is_named(files, value):
    """Python's `json` has limits (integers of 4300 digits, nesting the recursion limit allows): the line
    past them is named, not a bare ValueError or RecursionError."""
    from streamrl.tasks.files import read_rows

    path = files / "limits.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "b", "answer": ' + value + "}\n")
    with pytest.raises(ValueError, match=r"limits.jsonl': line 2 cannot be read \("):
        read_rows(path, "prompt")
