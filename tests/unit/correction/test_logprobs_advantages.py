import pytest
import torch

from streamrl.correction import broadcast_to_tokens, grpo_advantages, rloo_advantages, token_entropy, token_logprobs


@pytest.mark.parametrize("chunk", [1, 7, 64, 10_000])
def test_chunked_logprobs_equal_log_softmax_gather(chunk):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 50, 301, generator=g) * 4).requires_grad_()
    targets = torch.randint(0, 301, (3, 50), generator=g)
    reference = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)
    got = token_logprobs(logits, targets, chunk=chunk)
    torch.testing.assert_close(got, reference, atol=1e-5, rtol=0)
    weights = torch.randn(3, 50, generator=g)
    (grad_ref,) = torch.autograd.grad((reference * weights).sum(), logits)
    (grad_got,) = torch.autograd.grad((got * weights).sum(), logits)
    torch.testing.assert_close(grad_got, grad_ref, atol=1e-5, rtol=0)


def test_chunked_logprobs_from_bfloat16_logits_are_float32():
    logits = torch.randn(2, 9, 33).to(torch.bfloat16)
    targets = torch.randint(0, 33, (2, 9))
    got = token_logprobs(logits, targets, chunk=4)
    reference = torch.log_softmax(logits.float(), -1).gather(-1, targets[..., None]).squeeze(-1)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, reference, atol=1e-5, rtol=0)


def test_entropy_matches_the_definition():
    logits = torch.randn(2, 11, 40)
    p = torch.softmax(logits, -1)
    torch.testing.assert_close(token_entropy(logits, chunk=5), -(p * p.log()).sum(-1), atol=1e-5, rtol=0)


def test_shape_mismatch_is_refused():
    with pytest.raises(ValueError, match="disagree"):
        token_logprobs(torch.randn(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))


def test_grpo_and_rloo_advantages():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5])
    adv = grpo_advantages(rewards, 4)
    torch.testing.assert_close(adv[:4], torch.tensor([1.0, -1.0, -1.0, 1.0]) * 0.5 / (0.5 + 1e-4))
    assert adv[4:].abs().max() == 0  # an all-equal group carries no signal
    torch.testing.assert_close(grpo_advantages(rewards, 4, scale=False)[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]))
    loo = rloo_advantages(rewards, 4)
    torch.testing.assert_close(loo[:4], torch.tensor([1 - 1 / 3, -2 / 3, -2 / 3, 1 - 1 / 3]))
    with pytest.raises(ValueError, match="groups of 3"):
        grpo_advantages(rewards, 3)
    mask = torch.tensor([[True, True, False], [False, True, True]])
    torch.testing.assert_close(broadcast_to_tokens(torch.tensor([2.0, -1.0]), mask),
                               torch.tensor([[2.0, 2.0, 0.0], [0.0, -1.0, -1.0]]))
