"""Unbiasedness of the importance-weighted policy gradient in a 20-armed categorical bandit.

Behaviour μ ≠ target π = softmax(z). The analytic gradient of J(z) = Σ_a π_a r_a is
∂J/∂z_k = π_k (r_k − J). The estimate is the gradient of streamrl's `reinforce` loss on samples
a ~ μ with A = r(a): with an infinite cap it is plain IS, (1/n) Σ (π/μ)(a) r(a) ∇ log π(a).
"""

import math

import torch

from streamrl.correction import PolicyBatch, reinforce

ARMS, SAMPLES = 20, 400_000


def bandit(seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(ARMS, generator=g, dtype=torch.float64)
    behavior = torch.softmax(torch.randn(ARMS, generator=g, dtype=torch.float64) * 0.8, 0)
    rewards = torch.rand(ARMS, generator=g, dtype=torch.float64)
    return logits, behavior, rewards, g


def estimate(logits, behavior, rewards, actions, is_cap):
    z = logits.clone().requires_grad_()
    logp = torch.log_softmax(z, 0)[actions][:, None]  # one "token" per sample
    batch = PolicyBatch(logp, torch.log(behavior)[actions][:, None], rewards[actions][:, None],
                        torch.ones(len(actions), 1, dtype=torch.bool))
    loss, metrics = reinforce(batch, is_cap=is_cap)
    loss.backward()
    return -z.grad, metrics


def per_sample_gradients(logits, behavior, rewards, actions, is_cap):
    pi = torch.softmax(logits, 0)
    w = (pi[actions] / behavior[actions]).clamp(max=is_cap)
    score = torch.nn.functional.one_hot(actions, ARMS).double() - pi  # ∇_z log π(a)
    return (w * rewards[actions])[:, None] * score


def test_importance_weighted_gradient_converges_to_the_analytic_gradient():
    logits, behavior, rewards, g = bandit()
    pi = torch.softmax(logits, 0)
    analytic = pi * (rewards - (pi * rewards).sum())
    actions = torch.multinomial(behavior, SAMPLES, replacement=True, generator=g)
    plain, metrics = estimate(logits, behavior, rewards, actions, is_cap=math.inf)
    per_sample = per_sample_gradients(logits, behavior, rewards, actions, math.inf)
    torch.testing.assert_close(plain, per_sample.mean(0))  # the loss computes exactly this estimator
    stderr = per_sample.std(0) / math.sqrt(SAMPLES)
    # Stated tolerance: every component within 4 standard errors, and max error < 0.005 at 400k samples.
    assert ((plain - analytic).abs() <= 4 * stderr + 1e-12).all()
    assert float((plain - analytic).abs().max()) < 5e-3
    # Error shrinks like 1/sqrt(n): the first 4,000 samples are clearly further off than all 400,000.
    small, _ = estimate(logits, behavior, rewards, actions[:4000], is_cap=math.inf)
    assert float((small - analytic).norm()) > 3 * float((plain - analytic).norm())
    assert 0 < float(metrics["ess"]) < 1


def test_truncated_estimator_has_bounded_lower_variance():
    logits, behavior, rewards, g = bandit()
    actions = torch.multinomial(behavior, SAMPLES, replacement=True, generator=g)
    cap = 2.0
    plain = per_sample_gradients(logits, behavior, rewards, actions, math.inf)
    truncated = per_sample_gradients(logits, behavior, rewards, actions, cap)
    var_plain, var_trunc = float(plain.var(0).sum()), float(truncated.var(0).sum())
    # |g| <= C · max r · |e_a − π| <= C · max r · sqrt(2): the variance is bounded by its square.
    bound = (cap * float(rewards.max())) ** 2 * 2
    print(f"per-sample gradient variance: plain IS {var_plain:.4f}, truncated (C={cap}) {var_trunc:.4f}, "
          f"bound {bound:.4f}")
    assert var_trunc <= bound and var_trunc < var_plain
    ratios = torch.softmax(logits, 0) / behavior
    assert float(ratios.max()) > cap  # the cap really bites in this bandit
