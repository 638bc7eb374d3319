"""Failed rewards (raised, hung, NaN, None, not a number, out of range) are recorded per sample and the run goes on."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from checkout import EXAMPLES
from transformers import AutoTokenizer

from streamrl.config import ConfigError, TaskSection, load_config
from streamrl.tasks import make_task
from streamrl.tasks.reward_guard import RewardGuard

REWARDS = '''
import math, os, subprocess, time

def reward(completion, row):
    """Does what the completion says; otherwise returns the completion's length."""
    if completion == "raise":
        raise KeyError("answer")
    if completion == "hang":
        time.sleep(600)
    if completion == "exit":
        os._exit(3)
    if completion == "take":
        return float(len(row.pop("answer")))  # changes the row it was given
    if completion == "huge":
        return 10**400  # an int no float holds
    if completion == "weird":
        return Weird()
    if completion in ("run child", "leave child"):  # a code-execution reward: the candidate runs in a subprocess
        child = subprocess.Popen(["sleep", "600"])
        with open(row["pid_file"] + ".part", "w") as f:
            f.write(str(child.pid))
        os.replace(row["pid_file"] + ".part", row["pid_file"])
        return 1.0 if completion == "leave child" else float(child.wait())
    return {"nan": math.nan, "inf": -math.inf, "none": None, "text": "1.0", "big": 1e30,
            "list": [1.0], "true": True}.get(completion, float(len(completion)))


class Weird:
    def __float__(self):
        raise RuntimeError("cannot convert")

    def __repr__(self):
        raise RuntimeError("no repr either")
'''

FAILURES = [("raise", "raised", "KeyError: 'answer' (at guard_rewards.py:7)"), ("nan", "nan", "returned nan"),
            ("inf", "nan", "returned -inf"), ("none", "none", "returned None"),
            ("text", "not_a_number", "returned str, not a number: '1.0'"),
            ("list", "not_a_number", "returned list, not a number"),
            ("big", "out_of_range", "returned 1e+30, outside [-10, 10]"),
            ("huge", "out_of_range", "returned int too large for a float"),
            ("weird", "not_a_number", "returned Weird, not a number: RuntimeError: cannot convert")]


@pytest.fixture
def rewards(tmp_path):
    (tmp_path / "guard_rewards.py").write_text(REWARDS)
    yield str(tmp_path)
    sys.modules.pop("guard_rewards", None)


def alive(pid: int) -> bool:
    """Any of the process's threads still running (a killed process's main thread can be a zombie while
    another thread still holds its files); an exited process nobody has reaped yet is not alive."""
    states = []
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass
    return any(state not in "ZX" for state in states)


def wait_gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


def child_pid(pid_file: Path, within_s: float = 30.0) -> int:
    """The pid of the process the reward started, once it has written it."""
    deadline = time.monotonic() + within_s
    while not pid_file.exists():
        assert time.monotonic() < deadline, "the reward did not start its child"
        time.sleep(0.05)
    return int(pid_file.read_text())


def kill_if_alive(pid_file: Path) -> None:
    """A test that failed must not leave the reward's `sleep 600` behind."""
    if pid_file.exists() and alive(pid := int(pid_file.read_text())):
        os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("isolation", ["process", "inline"])
def test_each_failed_reward_gets_the_fallback_is_recorded_and_the_next_call_works(rewards, isolation):
    guard = RewardGuard("guard_rewards:reward", rewards, isolation=isolation, low=-10, high=10, fallback=-0.5,
                        keep=len(FAILURES))
    try:
        for completion, _, _ in FAILURES:
            assert guard(completion, {}) == -0.5
            assert guard("ok", {}) == 2.0
        assert guard("true", {}) == 1.0 and guard("x" * 10, {}) == 10.0  # a bool is a number; bounds inclusive
        assert guard.counts == {"raised": 1, "nan": 2, "none": 1, "not_a_number": 3, "out_of_range": 2}
        for failure, (_, kind, message) in zip(guard.recent, FAILURES, strict=True):
            assert failure.kind == kind and failure.message.startswith(message)
        if isolation == "process":
            assert guard.caller.starts == 1  # none of these failures cost the worker its life
        row = {"answer": "abc"}
        assert guard("take", row) == 3.0 and guard("take", row) == 3.0 and row == {"answer": "abc"}
    finally:
        guard.close()


def test_a_hang_is_cut_at_the_timeout_and_a_new_worker_takes_the_next_call(rewards):
    guard = RewardGuard("guard_rewards:reward", rewards, timeout_s=0.5)
    try:
        assert guard("ok", {}) == 2.0
        hung = guard.caller.pid
        started = time.monotonic()
        assert guard("hang", {}) == 0.0
        assert 0.5 <= time.monotonic() - started < 10.0  # cut, not waited out (the function sleeps 600 s)
        assert guard.counts == {"timeout": 1} and "no result within 0.5 s" in guard.recent[-1].message
        assert wait_gone(hung, 5.0)
        assert guard("ok", {}) == 2.0 and guard.caller.pid != hung and guard.caller.starts == 2
    finally:
        guard.close()


@pytest.mark.parametrize("ends", ["timeout", "close"])
def test_a_timed_out_or_closed_worker_leaves_none_of_the_rewards_processes_running(rewards, tmp_path, ends):
    guard = RewardGuard("guard_rewards:reward", rewards, timeout_s=2.0)
    pid_file = tmp_path / "child.pid"
    try:
        if ends == "timeout":  # killed while the reward waits for its child
            assert guard("run child", {"pid_file": str(pid_file)}) == 0.0 and guard.counts == {"timeout": 1}
            assert wait_gone(child_pid(pid_file), 5.0)
            assert "worker and its child processes killed" in guard.recent[-1].message
            assert guard("ok", {}) == 2.0 and guard.caller.starts == 2
        else:  # the reward returned, but left its child running
            assert guard("leave child", {"pid_file": str(pid_file)}) == 1.0
            assert alive(child_pid(pid_file))
        worker = guard.caller.pid
        guard.close()
        assert wait_gone(worker, 5.0) and wait_gone(child_pid(pid_file), 5.0)
    finally:
        guard.close()
        kill_if_alive(pid_file)


def test_a_worker_that_dies_mid_call_or_between_calls_is_replaced(rewards):
    guard = RewardGuard("guard_rewards:reward", rewards)
    try:
        assert guard("exit", {}) == 0.0
        assert guard.recent[-1].kind == "raised" and "exit code 3" in guard.recent[-1].message
        assert guard("ok", {}) == 2.0
        first = guard.caller.pid
        subprocess.run(["kill", "-KILL", str(first)], check=True)  # killed from outside while idle: not a failure
        assert wait_gone(first, 5.0)
        assert guard("ok", {}) == 2.0 and guard.counts == {"raised": 1} and guard.caller.starts == 3
        worker = guard.caller.pid
    finally:
        guard.close()
    assert wait_gone(worker, 5.0)


def test_a_reward_the_worker_cannot_import_is_an_error_not_a_failed_reward(tmp_path):
    guard = RewardGuard("no_such_reward_module:f", str(tmp_path))
    with pytest.raises(ValueError, match="cannot import module 'no_such_reward_module'.*in the reward worker"):
        guard("ok", {})


ORPHAN = '''
import sys, time
from streamrl.tasks.reward_guard import RewardGuard
guard = RewardGuard("guard_rewards:reward", sys.argv[1], timeout_s=600)
guard("ok", {})
print(guard.caller.pid, flush=True)
guard(sys.argv[2], {"pid_file": sys.argv[3]})
if sys.argv[4] == "sigkill":
    time.sleep(600)
'''


@pytest.mark.parametrize("parent_ends, reward", [
    ("sigkill", "hang"),  # while the reward hangs
    ("sigkill", "run child"),  # while the reward waits for its child
    ("sigkill", "leave child"),  # while the worker is idle, the reward's child still running
    ("exits without close", "ok"),
    ("exits without close", "leave child"),
])
def test_the_worker_and_the_rewards_processes_do_not_outlive_the_parent(rewards, tmp_path, parent_ends, reward):
    pid_file = tmp_path / "child.pid"
    parent = subprocess.Popen([sys.executable, "-c", ORPHAN, rewards, reward, str(pid_file), parent_ends],
                              stdout=subprocess.PIPE, text=True)
    try:
        worker = int(parent.stdout.readline())
        assert alive(worker)
        child = child_pid(pid_file) if "child" in reward else None
        if parent_ends == "sigkill":
            time.sleep(0.3)  # the call under way, or over
            parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=30)
        assert wait_gone(worker, 5.0)
        assert child is None or wait_gone(child, 5.0)
    finally:
        parent.kill()
        parent.wait()
        kill_if_alive(pid_file)


ROW_REWARDS = '''
def by_row(completion, row):
    if row["answer"] == "boom":
        raise ValueError("no reference answer")
    if row["answer"] == "nan":
        return float("nan")
    return float(completion == row["answer"])
'''


def test_a_file_task_gives_failed_rewards_the_fallback_and_counts_them(tmp_path, tiny_model_dir):
    (tmp_path / "row_rewards.py").write_text(ROW_REWARDS)
    rows = [{"prompt": "12>", "answer": "21"}, {"prompt": "34>", "answer": "boom"}, {"prompt": "56>", "answer": "nan"}]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    section = TaskSection(kind="file", prompts=str(tmp_path / "rows.jsonl"), eval_prompts=str(tmp_path / "rows.jsonl"),
                          reward="row_rewards:by_row", reward_on_failure=-1.0)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    task = make_task(section, tokenizer, search_path=str(tmp_path))
    try:
        answer = tokenizer("21").input_ids + [tokenizer.eos_token_id]
        assert [task.reward(i, answer) for i in range(4)] == [1.0, -1.0, -1.0, 1.0]
        assert task.eval_reward(1, answer) == -1.0 and task.eval_reward(0, answer) == 1.0
        assert task.reward_failures() == {"raised": 2, "nan": 1}
        assert task.recent_reward_failures()[0].startswith("raised: ValueError: no reference answer (at row_rewards.py:")
        worker = task.guard.caller.pid
    finally:
        task.close()
        sys.modules.pop("row_rewards", None)
    assert wait_gone(worker, 5.0)


@pytest.mark.parametrize("overrides, message", [
    (["task.reward_min=2", "task.reward_max=1"], "task: Value error, reward_min=2.0 is above reward_max=1.0"),
    (["task.reward_timeout_s=0"], "task.reward_timeout_s: Input should be greater than 0"),
    (["task.reward_on_failure=nan"], "task.reward_on_failure: .*finite number"),
    (["task.reward_isolation=thread"], "task.reward_isolation: Input should be 'process' or 'inline'"),
])
def test_reward_settings_are_checked_at_load(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


CONFIG = EXAMPLES / "own_task" / "config.toml"
EVERY_THIRD_RAISES = '''
calls = 0

def every_third_raises(completion, row):
    global calls
    calls += 1
    if calls % 3 == 0:
        raise RuntimeError(f"call {calls} fails on purpose")
    return float(completion[:1] == row["answer"])
'''


@pytest.mark.ray
def test_a_file_task_launch_whose_reward_raises_on_every_third_call_completes_and_counts_them(
        ray_local, tmp_path, tiny_model_dir, monkeypatch):
    from launching import tiny

    from streamrl.runtime.launch import launch, prepare

    (tmp_path / "flaky_rewards.py").write_text(EVERY_THIRD_RAISES)
    rows = [{"prompt": f"{n}>", "answer": str(n)[-1]} for n in range(10, 30)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.chdir(tmp_path)  # the reward module is imported from the launch directory
    config, run_dir, checkpoint = prepare(str(CONFIG), tiny(
        tmp_path, "flaky", "run.steps=3", "producers.count=1", "task.prompts=prompts.jsonl",
        "task.eval_prompts=prompts.jsonl", "task.reward=flaky_rewards:every_third_raises",
        "sampling.max_new_tokens=3", f"model.path={json.dumps(str(tiny_model_dir))}", "task.chat_template=false"))
    summary = launch(config, run_dir, checkpoint)
    assert summary["steps"] == 3
    producer = summary["producers"][0]
    assert producer["reward_failures"] == {"raised": producer["samples"] // 3} and producer["samples"] >= 48
    assert producer["reward_failures_recent"][-1].startswith("raised: RuntimeError: call ")
    assert json.loads((run_dir.path / "summary.json").read_text())["producers"][0]["reward_failures"] == \
        producer["reward_failures"]
    evals = run_dir.read("eval.jsonl")  # held-out rewards go through the guard in the trainer
    assert evals[-1]["eval_reward_failures"] > 0 and "eval_accuracy" in evals[-1]
