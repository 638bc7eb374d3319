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


@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.7])
def test_logprobs_at_a_temperature_divide_in_float32_as_the_sampler_does(temperature):
    """Divided in bf16 first, the logits were rounded again: up to 0.18 nats from the sampler's
    `log_softmax(logits.float() / T)` at T = 0.6 on LLM-sized logits."""
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(2, 16, 4096, generator=g) * 5).to(torch.bfloat16)
    targets = torch.randint(0, 4096, (2, 16), generator=g)
    sampler = torch.log_softmax(logits.float() / temperature, -1).gather(-1, targets[..., None]).squeeze(-1)
    torch.testing.assert_close(token_logprobs(logits, targets, chunk=5, temperature=temperature), sampler,
                               atol=1e-5, rtol=0)
    leaf = (torch.randn(3, 7, 50, generator=g, dtype=torch.float64)).requires_grad_()
    picks = torch.randint(0, 50, (3, 7), generator=g)
    weights = torch.randn(3, 7, generator=g, dtype=torch.float64)
    reference = torch.log_softmax(leaf / temperature, -1).gather(-1, picks[..., None]).squeeze(-1)
    (expected,) = torch.autograd.grad((reference * weights).sum(), leaf)
    (got,) = torch.autograd.grad((token_logprobs(leaf, picks, chunk=4, temperature=temperature) * weights).sum(), leaf)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        token_logprobs(logits, targets, temperature=0.0)


@pytest.mark.parametrize("group_size", [5, 7, 12])
def test_a_group_of_equal_rewards_gets_exactly_zero_advantage(group_size):
    """Their float32 mean can be one rounding step off; divided by std ~1e-7 + eps, the residue gave every
    sample of the group the same advantage, up to 0.03 at a reward of 15.93."""
    for reward in torch.linspace(0.01, 20.0, 400).tolist():
        assert grpo_advantages(torch.full((group_size,), reward), group_size).abs().max() == 0


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
