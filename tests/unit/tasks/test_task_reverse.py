import pytest

from streamrl.tasks.reverse import BOS, EOS, CharVocab, ReverseDigits


def test_vocabulary_round_trip_and_errors():
    vocab = CharVocab()
    assert len(vocab) == 17
    assert vocab.decode(vocab.encode("12>3")) == "12>3"
    with pytest.raises(ValueError, match=r"\['a'\] are not in the vocabulary"):
        vocab.encode("1a")


def test_reward_is_graded_and_exact():
    task = ReverseDigits(3)
    enc = task.vocab.encode
    assert task.score(123, enc("321") + [EOS]) == 1.0
    assert task.score(123, enc("321")) == 0.5  # no end token: halved
    assert task.score(123, enc("301") + [EOS]) == pytest.approx(2 / 3)
    assert task.score(123, enc("3214") + [EOS]) == pytest.approx(3 / 4)  # extra digits cost
    assert task.score(123, [EOS]) == 0.0
    assert task.score(7, enc("700") + [EOS, 5, 5]) == 1.0  # zero-padded; tokens after eos ignored


def test_held_out_numbers_never_train_and_prompts_are_deterministic():
    task = ReverseDigits(3, seed=1)
    held_out = set(task.eval_numbers())
    assert 50 <= len(held_out) <= 150  # about a tenth of 1,000
    trained = {task.number(i) for i in range(3000)}
    assert not trained & held_out and len(trained) > 800
    assert task.prompt(42) == ReverseDigits(3, seed=1).prompt(42)
    assert task.prompt(42)[0] == BOS and task.vocab.decode(task.prompt(42)).endswith(">")
    with pytest.raises(ValueError, match="digits must be in"):
        ReverseDigits(0)
