import numpy as np
import pytest
import torch

from streamrl.buffer.schema import LENGTH, STOP
from streamrl.engine.sampler import TorchSampler, nucleus_logprobs
from streamrl.models.hf import load_policy
from streamrl.tasks.reverse import EOS
from streamrl.weights.arrays import load_state_arrays, state_arrays


def teacher_forced_logprobs(model, prompt, response, temperature=1.0):
    ids = torch.tensor([list(prompt) + list(response)])
    logits = model(input_ids=ids).logits[0, :-1].float() / temperature
    lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    return lp[len(prompt) - 1:]


def test_behaviour_logprobs_match_a_full_forward_with_left_padding_and_shared_prefill(tiny_model_dir):
    model, _ = load_policy(tiny_model_dir)
    prompts = [[1, 4, 5, 6, 15], [1, 7, 15], [1, 9, 9, 15]]  # different lengths: left padding
    sampler = TorchSampler(model, pad_id=0, stop_ids=[EOS], max_new_tokens=6, temperature=0.7, seed=3)
    gen = sampler.generate(prompts, 5, samples_per_prompt=4)
    assert len(gen.offsets) == 13 and (gen.versions == 5).all()
    for row in range(12):
        expected = teacher_forced_logprobs(model, prompts[row // 4], gen.response(row), temperature=0.7)
        np.testing.assert_allclose(gen.logprobs[gen.offsets[row]:gen.offsets[row + 1]], expected.numpy(), atol=1e-4)


def test_stop_tokens_end_rows_and_finish_reasons_are_recorded(tiny_model_dir):
    model, _ = load_policy(tiny_model_dir)
    sampler = TorchSampler(model, pad_id=0, stop_ids=[EOS], max_new_tokens=8, seed=0)
    gen = sampler.generate([[1, 4, 15]] * 64)
    for row in range(64):
        response = gen.response(row)
        if gen.finish[row] == STOP:
            assert response[-1] == EOS and EOS not in response[:-1]
        else:
            assert gen.finish[row] == LENGTH and len(response) == 8 and EOS not in response
    assert {STOP, LENGTH} <= set(gen.finish.tolist())  # an untrained model does both


def test_greedy_is_deterministic_and_independent_of_batching(tiny_model_dir):
    model, _ = load_policy(tiny_model_dir)
    sampler = TorchSampler(model, pad_id=0, stop_ids=[EOS], max_new_tokens=5)
    together = sampler.generate([[1, 4, 5, 15], [1, 8, 15]], greedy=True)
    alone = sampler.generate([[1, 8, 15]], greedy=True)
    np.testing.assert_array_equal(together.response(1), alone.response(0))


def test_top_p_keeps_the_smallest_nucleus_and_renormalises():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    lp = nucleus_logprobs(logits, 1.0, 0.7)
    assert torch.isinf(lp[0, 2:]).all() and lp[0, 2:].lt(0).all()
    torch.testing.assert_close(lp[0, :2].exp(), torch.tensor([0.5, 0.3]) / 0.8)
    torch.testing.assert_close(nucleus_logprobs(logits, 1.0, 0.01)[0, 0], torch.tensor(0.0))  # never empty
    torch.testing.assert_close(nucleus_logprobs(logits, 1.0, 1.0), torch.log_softmax(logits, -1))


def test_weights_swapped_mid_generation_are_stamped_on_the_tokens_they_sampled(tiny_model_dir):
    model, _ = load_policy(tiny_model_dir)
    old, _ = load_policy(tiny_model_dir)
    other, _ = load_policy(tiny_model_dir)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    new_weights = state_arrays(other)
    calls = []

    def refresh():  # version 0 for the prefill and the first two boundaries, then version 1
        calls.append(1)
        if len(calls) == 3:
            load_state_arrays(model, new_weights)
        return 0 if len(calls) < 3 else 1

    sampler = TorchSampler(model, pad_id=0, stop_ids=[99], max_new_tokens=5, seed=1)  # no stop: 5 tokens
    gen = sampler.generate([[1, 4, 5, 15]], refresh)
    assert gen.versions.tolist() == [0, 0, 1, 1, 1]
    # Tokens before the swap carry the old weights' log-probs; after it, other numbers (new weights).
    before = teacher_forced_logprobs(old, [1, 4, 5, 15], gen.tokens).numpy()
    np.testing.assert_allclose(gen.logprobs[:2], before[:2], atol=1e-4)
    assert np.abs(gen.logprobs[2:] - before[2:]).min() > 1e-3


def test_empty_prompts_and_missing_stop_ids_are_rejected(tiny_model_dir):
    model, _ = load_policy(tiny_model_dir)
    with pytest.raises(ValueError, match="stop token"):
        TorchSampler(model, pad_id=0, stop_ids=[], max_new_tokens=3)
    sampler = TorchSampler(model, pad_id=0, stop_ids=[EOS], max_new_tokens=3)
    with pytest.raises(ValueError, match="at least one token"):
        sampler.generate([[1, 2], []])
