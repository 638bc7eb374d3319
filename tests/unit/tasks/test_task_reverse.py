import time

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


def test_the_held_out_set_is_found_lazily_in_the_same_order_however_it_is_asked_for():
    every = [n for n in range(1000) if ReverseDigits(3).is_held_out(n)]
    task = ReverseDigits(3)
    assert task.eval_numbers(5) == every[:5]  # a prefix first, then the rest: one order
    assert task.eval_numbers() == every and task.eval_numbers(10**6) == every
    enc = task.vocab.encode
    assert task.eval_reward(7, enc(f"{every[7]:03d}"[::-1]) + [EOS]) == 1.0

    started = time.perf_counter()
    big = ReverseDigits(12)  # 10^11 held-out numbers: an evaluation of 256 must not list them all
    prompts = big.eval_prompts(256)
    assert len(prompts) == 256 and time.perf_counter() - started < 1.0
    numbers = big.eval_numbers(256)
    assert numbers == sorted(numbers) and all(big.is_held_out(n) for n in numbers)
    assert big.eval_reward(255, big.vocab.encode(f"{numbers[255]:012d}"[::-1]) + [EOS]) == 1.0


def test_the_character_tokenizer_decodes_characters_back_to_back_however_it_is_loaded(tiny_model_dir, tmp_path):
    """Built without a decoder, it decoded "2 1" when used as built or loaded without the model's
    config.json (AutoTokenizer's Qwen2 class hid it): a file task's reward then saw spaced answers."""
    import shutil

    from transformers import AutoTokenizer

    from streamrl.models.tiny import build_tokenizer

    bare = tmp_path / "tokenizer-only"
    shutil.copytree(tiny_model_dir, bare)
    (bare / "config.json").unlink()
    for tokenizer in (build_tokenizer(CharVocab()), AutoTokenizer.from_pretrained(tiny_model_dir),
                      AutoTokenizer.from_pretrained(bare)):
        ids = tokenizer.encode("21>12", add_special_tokens=False)
        assert len(ids) == 5 and tokenizer.decode(ids) == "21>12"
