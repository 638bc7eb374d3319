"""The long-tailed reversal task: the length distribution it promises, deterministic prompts, a held-out
split never trained on, partial credit."""

import numpy as np
import pytest

from streamrl.config import TaskSection
from streamrl.tasks import make_task
from streamrl.tasks.long_tail import ReverseLongTail
from streamrl.tasks.reverse import BOS, EOS, CharVocab


def test_response_lengths_have_the_promised_long_tail():
    task = ReverseLongTail(median_digits=2, max_digits=28, tail=8.0)
    lengths = np.array([len(task.target(task.digits(i))) + 1 for i in range(20_000)])  # answer + <eos>
    median, p99 = np.median(lengths), np.percentile(lengths, 99)
    assert median == 3 and p99 / median >= 8 and lengths.max() <= 29
    flat = ReverseLongTail(median_digits=4, max_digits=8, tail=1.0)
    assert {len(flat.digits(i)) for i in range(200)} == {4}


def test_prompts_are_deterministic_and_the_held_out_split_is_never_trained_on():
    task, again = ReverseLongTail(seed=3), ReverseLongTail(seed=3)
    assert [task.prompt(i) for i in range(50)] == [again.prompt(i) for i in range(50)]
    assert [task.prompt(i) for i in range(50)] != [ReverseLongTail(seed=4).prompt(i) for i in range(50)]
    trained = {task.digits(i) for i in range(5_000)}
    held_out = {CharVocab().decode(p[1:-1]) for p in task.eval_prompts()}
    assert len(held_out) > 100 and not trained & held_out
    assert all(ReverseLongTail.is_held_out(d) for d in held_out)
    assert task.eval_prompts(10) == ReverseLongTail(seed=9).eval_prompts(10)  # one held-out set for every seed


def test_the_reward_gives_partial_credit_and_needs_the_end_token():
    task = ReverseLongTail(seed=1)
    prompt_id = next(i for i in range(100) if len(task.digits(i)) >= 4)
    digits = task.digits(prompt_id)
    assert task.prompt(prompt_id) == [BOS, *CharVocab().encode(digits), CharVocab().encode(">")[0]]
    right = task.target(digits)
    assert task.reward(prompt_id, [*right, EOS]) == 1.0
    assert task.reward(prompt_id, right) == 0.5  # no <eos>: halved
    half = [*right[: len(right) // 2], *[right[0]] * (len(right) - len(right) // 2)]
    assert 0 < task.reward(prompt_id, [*half, EOS]) < 1
    assert task.eval_reward(0, [*task.target(task._held_out[0]), EOS]) == 1.0


def test_the_config_selects_it_and_bad_settings_name_the_field():
    task = make_task(TaskSection(kind="long_tail", digits=3, max_digits=10, tail=4.0), seed=2)
    assert isinstance(task, ReverseLongTail) and task.max_new_tokens() == 12
    with pytest.raises(ValueError, match="median_digits"):
        ReverseLongTail(median_digits=5, max_digits=4)
    with pytest.raises(ValueError, match="tail"):
        TaskSection(kind="long_tail", tail=0.5)


@pytest.mark.parametrize("digits, max_digits", [(1, 1), (5, 5), (5, 4), (12, 5), (3, 28)])
def test_the_config_refuses_exactly_the_lengths_the_task_refuses(digits, max_digits):
    """digits above max_digits passed the config and failed only once the actors built the task (review)."""
    from streamrl.config import ConfigError, load_config

    overrides = ["task.kind=long_tail", f"task.digits={digits}", f"task.max_digits={max_digits}"]
    try:
        ReverseLongTail(median_digits=digits, max_digits=max_digits)
    except ValueError:
        with pytest.raises(ConfigError, match=f"digits={digits} above max_digits={max_digits}"):
            load_config(overrides=overrides)
    else:
        make_task(load_config(overrides=overrides).task)
