"""Off-policy losses: float64 gradients against hand-derived formulas, on-policy reduction,
numerical safety on extreme inputs, and metrics."""

import math

import pytest
import torch

from streamrl.correction import LOSSES, LossConfig, PolicyBatch, make_loss
from streamrl.correction.losses import LOG_RATIO_CLAMP, token_means
from streamrl.trainer.step import accumulate

torch.manual_seed(0)
N, T = 4, 6


def make_batch(spread=0.3, prox_shift=0.2, seed=0):
    g = torch.Generator().manual_seed(seed)
    theta = (-torch.rand(N, T, generator=g, dtype=torch.float64) * 3).requires_grad_()
    prox = theta.detach() + spread * torch.randn(N, T, generator=g, dtype=torch.float64)
    behavior = prox + prox_shift * torch.randn(N, T, generator=g, dtype=torch.float64)
    adv = torch.randn(N, T, generator=g, dtype=torch.float64)
    mask = torch.rand(N, T, generator=g) > 0.2
    return theta, behavior, prox, adv, mask


def grad_of(loss_name, theta, behavior, prox, adv, mask, **kwargs):
    theta = theta.detach().clone().requires_grad_()
    loss, metrics = LOSSES[loss_name](PolicyBatch(theta, behavior, adv, mask, prox), **kwargs)
    loss.backward()
    return theta.grad, loss, token_means(metrics)


def ppo_mask(ratio, adv, eps_lo=0.2, eps_hi=0.2):
    """Where the PPO min picks a clipped (constant) term, the gradient is zero."""
    clipped = ratio.clamp(1 - eps_lo, 1 + eps_hi) * adv
    return ~(clipped < ratio * adv)


def test_decoupled_ppo_gradient():
    theta, b, p, adv, mask = make_batch()
    grad, _, _ = grad_of("decoupled_ppo", theta, b, p, adv, mask, is_cap=1.5)
    r, w = torch.exp(theta.detach() - p), torch.exp(p - b).clamp(max=1.5)
    expected = -w * r * adv * ppo_mask(r, adv) * mask / mask.sum()
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-12)


def test_ppo_bypass_gradient():
    theta, b, p, adv, mask = make_batch()
    grad, _, _ = grad_of("ppo_bypass", theta, b, None, adv, mask, clip_low=0.1, clip_high=0.3)
    r = torch.exp(theta.detach() - b)
    expected = -r * adv * ppo_mask(r, adv, 0.1, 0.3) * mask / mask.sum()
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-12)


def test_tis_gradient():
    theta, b, p, adv, mask = make_batch()
    grad, _, _ = grad_of("tis", theta, b, p, adv, mask, is_cap=1.2)
    r, w = torch.exp(theta.detach() - p), torch.exp(p - b).clamp(max=1.2)
    torch.testing.assert_close(grad, -w * r * adv * mask / mask.sum(), rtol=1e-12, atol=1e-12)


def test_reinforce_gradient():
    theta, b, p, adv, mask = make_batch()
    grad, _, _ = grad_of("reinforce", theta, b, None, adv, mask, is_cap=1.3, aggregation="seq_mean_token_sum")
    w = torch.exp(theta.detach() - b).clamp(max=1.3)
    torch.testing.assert_close(grad, -w * adv * mask / N, rtol=1e-12, atol=1e-12)


def test_naive_gradient_ignores_the_behaviour_policy():
    theta, b, p, adv, mask = make_batch()
    grad, _, _ = grad_of("naive", theta, b, p, adv, mask)
    grad_other_b, _, _ = grad_of("naive", theta, b - 5.0, p, adv, mask)
    r = torch.exp(theta.detach() - p)
    torch.testing.assert_close(grad, -r * adv * ppo_mask(r, adv) * mask / mask.sum(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, grad_other_b)


@pytest.mark.parametrize("reweight", [True, False])
def test_masked_is_token_gradient(reweight):
    theta, b, p, adv, mask = make_batch(prox_shift=0.8)
    grad, _, metrics = grad_of("masked_is", theta, b, p, adv, mask, lo=0.7, hi=1.4, reweight=reweight)
    ratio_b = torch.exp(p - b)
    kept = mask & (ratio_b >= 0.7) & (ratio_b <= 1.4)
    assert 0 < kept.sum() < mask.sum()  # the case really masks something
    r = torch.exp(theta.detach() - p)
    w = ratio_b if reweight else torch.ones_like(r)
    # rejected tokens weigh zero but still count: divided by every response token, not the kept ones
    torch.testing.assert_close(grad, -w * r * adv * ppo_mask(r, adv) * kept / mask.sum(), rtol=1e-12, atol=1e-12)
    assert math.isclose(float(metrics["masked_fraction"]), 1 - float(kept.sum() / mask.sum()), rel_tol=1e-9)


@pytest.mark.parametrize("level", ["sequence", "geometric"])
def test_masked_is_sequence_levels_drop_whole_sequences(level):
    theta, b, p, adv, mask = make_batch(prox_shift=0.3)
    lr = torch.where(mask, p - b, 0.0).sum(-1)
    per_seq = lr if level == "sequence" else lr / mask.sum(-1)
    lo, hi = float(torch.exp(per_seq).median()) * 0.999, 1e9  # rejects about half the sequences
    lo = min(lo, 1.0)
    grad, _, _ = grad_of("masked_is", theta, b, p, adv, mask, level=level, lo=lo, hi=max(hi, 1.0), reweight=False)
    kept_seq = (torch.exp(per_seq) >= lo) & (torch.exp(per_seq) <= hi)
    kept = mask & kept_seq[:, None]
    assert 0 < int(kept_seq.sum()) < N
    r = torch.exp(theta.detach() - p)
    torch.testing.assert_close(grad, -r * adv * ppo_mask(r, adv) * kept / mask.sum(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_kl_penalty_gradient(estimator):
    theta, b, p, adv, mask = make_batch()
    ref = theta.detach() + 0.4 * torch.randn(N, T, dtype=torch.float64)
    mask[0, 0] = True
    ref[0, 0] = -math.inf  # no penalty there, and no gradient (k1 passed on θ.detach() − θ's before)
    t = theta.detach().clone().requires_grad_()
    loss, metrics = LOSSES["reinforce"](PolicyBatch(t, b, torch.zeros_like(adv), mask, None, ref),
                                        kl_coef=0.5, kl_estimator=estimator)
    loss.backward()
    d = torch.ones_like(ref) if estimator == "k1" else 1 - torch.exp(ref - theta.detach())
    d[0, 0] = 0.0
    torch.testing.assert_close(t.grad, 0.5 * d * mask / mask.sum(), rtol=1e-12, atol=1e-12)
    assert "kl_ref" in token_means(metrics)


def test_the_kl_penalty_reaches_tokens_the_is_mask_rejects():
    """A rejection distrusts the behaviour log-prob, which the distance to the reference does not read:
    the penalty's gradient is the same with and without masking (it was dropped on rejected tokens)."""
    theta, b, p, adv, mask = make_batch(prox_shift=0.8)
    ref = theta.detach() + 0.4 * torch.randn(N, T, dtype=torch.float64)
    no_signal = torch.zeros_like(adv)
    grads = []
    for hi in (1.4, 1e9):
        t = theta.detach().clone().requires_grad_()
        loss, metrics = LOSSES["masked_is"](PolicyBatch(t, b, no_signal, mask, p, ref), lo=0.7 if hi < 1e9 else 0.0,
                                            hi=hi, kl_coef=0.5, kl_estimator="k1")
        loss.backward()
        grads.append(t.grad)
        if hi < 1e9:
            assert 0 < float(metrics["masked_fraction"]) < 1  # the case really rejects something
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grads[0], 0.5 * mask.double() / mask.sum(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_on_policy_every_loss_is_the_standard_policy_gradient(name):
    theta, _, _, adv, mask = make_batch()
    if name == "gspo":  # a sequence-level ratio: the same as the token-level one for a sequence's advantage
        adv = adv[:, :1].expand_as(adv)
    same = theta.detach().clone()
    grad, _, metrics = grad_of(name, theta, same, same, adv, mask)
    torch.testing.assert_close(grad, -adv * mask / mask.sum(), rtol=1e-12, atol=1e-12)  # PPO = REINFORCE at r = 1
    assert float(metrics["ratio_mean"]) == pytest.approx(1.0) and float(metrics["ess"]) == pytest.approx(1.0)
    assert float(metrics["kl_behavior_proximal"]) == pytest.approx(0.0, abs=1e-12)


EXTREMES = {
    "huge ratios": lambda b, m, a: (b - 1e4, m, a),
    "tiny ratios": lambda b, m, a: (b + 1e4, m, a),
    "-inf behaviour": lambda b, m, a: (torch.where(torch.rand_like(b) > 0.5, -math.inf, b), m, a),
    "nan behaviour": lambda b, m, a: (torch.where(torch.rand_like(b) > 0.5, math.nan, b), m, a),
    "+inf behaviour": lambda b, m, a: (torch.full_like(b, math.inf), m, a),
    "all masked": lambda b, m, a: (b, torch.zeros_like(m), a),
    "masked rows": lambda b, m, a: (b, m & (torch.arange(N)[:, None] % 2 == 0), a),
    "zero advantages": lambda b, m, a: (b, m, torch.zeros_like(a)),
}
VARIANTS = [(name, {}) for name in LOSSES] + [("masked_is", {"level": "sequence"}),
                                              ("masked_is", {"level": "geometric"})]


@pytest.mark.parametrize("extreme", sorted(EXTREMES))
@pytest.mark.parametrize("name,kwargs", VARIANTS)
def test_extreme_inputs_give_finite_loss_and_gradients(extreme, name, kwargs):
    theta, b, p, adv, mask = make_batch()
    b, mask, adv = EXTREMES[extreme](b, mask, adv)
    ref = theta.detach() - 50.0
    t = theta.detach().clone().requires_grad_()
    loss, metrics = LOSSES[name](PolicyBatch(t, b, adv, mask, p, ref), kl_coef=0.1, **kwargs)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(t.grad).all()
    assert all(torch.isfinite(v).all() for v in metrics.values()), metrics
    if extreme == "all masked" or extreme == "+inf behaviour":
        assert float(loss.detach()) == 0.0 and float(t.grad.abs().max()) == 0.0
        assert float(metrics["masked_fraction"]) == pytest.approx(1.0 if extreme == "+inf behaviour" else 0.0)
    if "behaviour" in extreme:
        assert float(metrics["nonfinite_fraction"]) > 0


@pytest.mark.parametrize("name,kwargs", VARIANTS)
def test_a_non_finite_current_log_prob_is_masked_like_a_non_finite_behaviour_one(name, kwargs):
    """θ = −inf where the mask is off changes nothing; θ = NaN inside it is the same as b = NaN there
    (masked, counted in the denominator); a non-finite reference log-prob gets no KL penalty."""
    theta, b, p, adv, mask = make_batch()
    mask[0, 0], mask[1, 2] = False, True
    ref = theta.detach() - 0.5

    def run(t, b, ref):
        t = t.detach().clone().requires_grad_()
        loss, metrics = LOSSES[name](PolicyBatch(t, b, adv, mask, p, ref), kl_coef=0.1, **kwargs)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(t.grad).all()
        assert all(torch.isfinite(v).all() for v in metrics.values()), metrics
        return loss.detach(), t.grad, metrics

    clean, clean_grad, _ = run(theta, b, ref)
    off_mask = theta.detach().clone()
    off_mask[0, 0] = -math.inf
    loss, grad, _ = run(off_mask, b, ref)
    torch.testing.assert_close(loss, clean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, clean_grad, rtol=1e-12, atol=1e-12)

    nan_theta, nan_b = theta.detach().clone(), b.clone()
    nan_theta[1, 2] = nan_b[1, 2] = math.nan
    loss, grad, metrics = run(nan_theta, b, ref)
    expected, expected_grad, _ = run(theta, nan_b, ref)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-12)
    assert float(grad[1, 2]) == 0.0 and float(metrics["nonfinite_fraction"]) == pytest.approx(1 / float(mask.sum()))

    nan_ref = ref.clone()
    nan_ref[1, 2] = math.nan
    _, grad, metrics = run(theta, b, nan_ref)
    assert torch.isfinite(token_means(metrics)["kl_ref"])


def test_log_ratios_are_clamped_before_exp():
    theta, b, p, adv, mask = make_batch()
    _, _, metrics = grad_of("decoupled_ppo", theta, b - 1e4, p, adv, mask)
    assert float(metrics["ratio_max"]) == pytest.approx(math.exp(LOG_RATIO_CLAMP))
    assert float(metrics["truncated_fraction"]) == 1.0


def test_metrics_ess_truncation_and_staleness():
    theta, b, p, adv, mask = make_batch(prox_shift=0.6)
    versions = torch.randint(0, 5, (N, T))
    t = theta.detach().clone().requires_grad_()
    _, metrics = LOSSES["decoupled_ppo"](PolicyBatch(t, b, adv, mask, p, None, versions), is_cap=1.5,
                                         trainer_version=6)
    metrics = token_means(metrics)
    w = torch.exp(p - b).clamp(max=1.5)[mask]
    assert float(metrics["ess"]) == pytest.approx(float(w.sum() ** 2 / (w.numel() * (w ** 2).sum())), rel=1e-9)
    assert float(metrics["truncated_fraction"]) == pytest.approx(float((torch.exp(p - b)[mask] > 1.5).float().mean()))
    assert float(metrics["staleness_max"]) == float((6 - versions)[mask].max())
    assert float(metrics["staleness_mean"]) == pytest.approx(float((6 - versions)[mask].float().mean()))
    r = torch.exp(p - b)[mask]
    assert float(metrics["kl_behavior_proximal"]) == pytest.approx(float((r - 1 - torch.log(r)).mean()), rel=1e-9)


@pytest.mark.parametrize("name", ["decoupled_ppo", "ppo_bypass"])
def test_the_mismatch_is_measured_on_the_trainers_own_versions_tokens_only(name):
    """Tokens sampled by the trainer's current version (age 0) carry the train/inference gap; older ones
    also carry the policy's change and must not count."""
    theta, b, p, adv, mask = make_batch(prox_shift=0.6)
    versions = torch.randint(4, 7, (N, T))
    current = mask & (versions == 6)
    trainer_side = p if name == "decoupled_ppo" else theta.detach()  # what the loss compares b with
    gap = trainer_side - b
    _, metrics = LOSSES[name](PolicyBatch(theta.detach().clone().requires_grad_(), b, adv, mask,
                                          p if name == "decoupled_ppo" else None, None, versions), trainer_version=6)
    k3 = torch.exp(gap) - 1 - gap
    assert float(metrics["mismatch_count"]) == float(current.sum())
    assert float(metrics["mismatch_kl_sum"]) == pytest.approx(float(k3[current].sum()), rel=1e-9)
    assert float(metrics["mismatch_abs_max"]) == pytest.approx(float(gap[current].abs().max()), rel=1e-9)
    _, none_current = LOSSES[name](PolicyBatch(theta, b, adv, mask, p, None, versions), trainer_version=9)
    assert float(none_current["mismatch_count"]) == 0 and float(none_current["mismatch_kl_sum"]) == 0


def test_factory_binds_the_config_and_checks_it():
    theta, b, p, adv, mask = make_batch()
    loss_fn = make_loss(LossConfig(name="decoupled_ppo", is_cap=1.1, clip_low=0.1))
    assert LossConfig().name == "decoupled_ppo" and LossConfig().needs_proximal  # corrected by default
    expected, _ = LOSSES["decoupled_ppo"](PolicyBatch(theta, b, adv, mask, p), is_cap=1.1, clip_low=0.1)
    got, _ = loss_fn(PolicyBatch(theta, b, adv, mask, p))
    assert float(got.detach()) == float(expected.detach())
    with pytest.raises(ValueError, match="is_cap"):
        LossConfig(is_cap=0.5)
    with pytest.raises(ValueError, match="name"):
        LossConfig(name="ppo_magic")
    with pytest.raises(ValueError, match="needs proximal_logprobs"):
        LOSSES["tis"](PolicyBatch(theta, b, adv, mask))


MASKING = [(name, {}) for name in sorted(LOSSES)] + [
    ("masked_is", {"level": level, "lo": 0.8, "hi": 1.25, "reweight": reweight})
    for level in ("token", "sequence", "geometric") for reweight in (True, False)]


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"])
@pytest.mark.parametrize("name,kwargs", MASKING)
def test_denominator_makes_micro_batches_add_up(name, kwargs, aggregation):
    """The loss called alone on the whole batch and the trainer's way (micro-batches, each divided by the
    whole batch's token or row count) agree in value and gradient, for every loss and masking level,
    with rejected and non-finite tokens in the batch."""
    theta, b, p, adv, mask = make_batch(prox_shift=0.6, seed=3)
    b = torch.where(torch.arange(T) == T - 1, -math.inf, b)  # a non-finite behaviour log-prob per row
    t_whole = theta.detach().clone().requires_grad_()
    whole, metrics = LOSSES[name](PolicyBatch(t_whole, b, adv, mask, p), aggregation=aggregation, **kwargs)
    whole.backward()
    if name == "masked_is":
        assert 0 < float(metrics["masked_fraction"]) < 1  # the case really rejects something
    denominator = float(mask.sum()) if aggregation == "token_mean" else float(N)
    t_parts = theta.detach().clone().requires_grad_()
    parts = sum(LOSSES[name](PolicyBatch(t_parts[rows], b[rows], adv[rows], mask[rows], p[rows]),
                             aggregation=aggregation, denominator=denominator, **kwargs)[0]
                for rows in (slice(0, 1), slice(1, 3), slice(3, N)))
    parts.backward()
    torch.testing.assert_close(parts, whole, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(t_parts.grad, t_whole.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name,kwargs", MASKING)
def test_per_token_metrics_of_micro_batches_combine_to_the_whole_batchs(name, kwargs):
    """The trainer adds micro-batches' metrics and takes `token_means` once. `clipped_fraction` (a mean
    over kept tokens, read by the automatic staleness controller) was a mean of micro-batch means weighted
    by their response tokens: off wherever the IS mask rejected more in one micro-batch than another."""
    theta, b, p, adv, mask = make_batch(prox_shift=0.6, seed=3)
    versions = torch.randint(4, 7, (N, T))
    b = torch.where(torch.arange(T) == T - 1, -math.inf, b)
    ref = theta.detach() + 0.3
    common = dict(kl_coef=0.1, trainer_version=6, **kwargs)
    _, whole = LOSSES[name](PolicyBatch(theta, b, adv, mask, p, ref, versions), **common)
    totals: dict[str, float] = {}
    for rows in (slice(0, 1), slice(1, 3), slice(3, N)):
        _, part = LOSSES[name](PolicyBatch(theta[rows], b[rows], adv[rows], mask[rows], p[rows], ref[rows],
                                           versions[rows]), **common)
        accumulate(totals, part, share=float(mask[rows].sum() / mask.sum()))
    whole, combined = token_means(whole), token_means(totals)
    for metric in ("ratio_mean", "clipped_fraction", "truncated_fraction", "kl_behavior_proximal", "kl_ref",
                   "staleness_mean", "masked_fraction"):
        assert combined[metric] == pytest.approx(float(whole[metric]), rel=1e-6, abs=1e-12), metric


def test_a_kl_penalty_without_reference_log_probs_is_refused_not_skipped():
    theta, b, p, adv, mask = make_batch()
    with pytest.raises(ValueError, match=r"kl_coef=0.1 needs the reference policy's log-probs"):
        make_loss(LossConfig(kl_coef=0.1))(PolicyBatch(theta, b, adv, mask, p))


# ---- trust regions for stale data: m2po and gspo --------------------------------------------------------
def m2po_mask_by_the_paper(is_log_ratio, adv, mask, tau):
    """Algorithm 1 of the M2PO paper, literally: mask the trust-region token of largest (log r)² while the
    mean over the trust-region tokens left exceeds τ."""
    region = mask & (((adv > 0) & (is_log_ratio > 0)) | ((adv < 0) & (is_log_ratio < 0)))
    m2 = is_log_ratio ** 2
    left, masked = region.clone(), torch.zeros_like(mask)
    while left.any() and float(m2[left].mean()) > tau:
        worst = torch.where(left, m2, -1.0).argmax()
        left.view(-1)[worst] = False
        masked.view(-1)[worst] = True
    return masked


@pytest.mark.parametrize("tau", [0.005, 0.04, 0.1])
def test_m2po_masks_as_the_papers_algorithm_and_its_gradient_is_the_unclipped_behaviour_ratio(tau):
    from streamrl.correction.losses import m2po_cutoff, m2po_values

    theta, b, p, adv, mask = make_batch(prox_shift=0.6)
    expected_mask = m2po_mask_by_the_paper(p - b, adv, mask, tau)
    values, _ = m2po_values(p - b, adv, mask)
    assert float(values.mean()) > tau and 0 < int(expected_mask.sum()) < int(mask.sum())  # it really masks
    cutoff = m2po_cutoff(values, tau)
    assert float(values[values < cutoff].mean()) <= tau < float(values[values <= cutoff].mean())  # the fewest
    grad, _, metrics = grad_of("m2po", theta, b, p, adv, mask, m2_tau=tau)
    kept = mask & ~expected_mask
    r_b = torch.exp(theta.detach() - b)  # no ε-clip: M2PO's trust region is the mask alone
    torch.testing.assert_close(grad, -r_b * adv * kept / mask.sum(), rtol=1e-12, atol=1e-12)
    assert float(metrics["masked_fraction"]) == pytest.approx(float(expected_mask.sum() / mask.sum()))
    assert m2po_cutoff(values, 10.0) == math.inf  # within the budget: nothing masked


def test_m2po_masks_tokens_tied_at_the_cutoff_together_and_the_rest_meets_the_budget():
    from streamrl.correction.losses import m2po_cutoff

    values = torch.tensor([1.0] * 4 + [0.0] * 6, dtype=torch.float64)  # identical responses tie
    cutoff = m2po_cutoff(values, 0.35)
    assert cutoff == 1.0 and int((values >= cutoff).sum()) == 4  # one removal would do: all four tied go
    assert float(values[values < cutoff].mean()) <= 0.35


def test_m2po_micro_batches_with_the_whole_batchs_cutoff_add_up_and_without_it_do_not():
    from streamrl.correction.losses import m2po_cutoff, m2po_values

    theta, b, p, adv, mask = make_batch(prox_shift=0.4, seed=4)
    whole_t = theta.detach().clone().requires_grad_()
    whole, _ = LOSSES["m2po"](PolicyBatch(whole_t, b, adv, mask, p))
    whole.backward()
    cutoff = m2po_cutoff(m2po_values(p - b, adv, mask)[0], 0.04)
    rows = (slice(0, 1), slice(1, 3), slice(3, N))

    def parts(**kwargs):
        t = theta.detach().clone().requires_grad_()
        total = sum(LOSSES["m2po"](PolicyBatch(t[r], b[r], adv[r], mask[r], p[r]), denominator=float(mask.sum()),
                                   **kwargs)[0] for r in rows)
        total.backward()
        return total, t.grad

    total, grad = parts(cutoff=cutoff)
    torch.testing.assert_close(total, whole, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, whole_t.grad, rtol=1e-12, atol=1e-12)
    alone, _ = parts()  # each micro-batch's own cutoff: another mask, another loss
    assert abs(float(alone.detach()) - float(whole.detach())) > 1e-3


def test_gspo_gradient_is_the_sequence_ratios_with_a_truncated_sequence_weight():
    theta, b, p, adv, mask = make_batch(spread=0.02, prox_shift=0.3, seed=2)
    adv = adv[:, :1].expand_as(adv)  # a sequence's advantage, as GRPO gives
    lo, hi, cap = 0.004, 0.005, 1.1
    grad, _, metrics = grad_of("gspo", theta, b, p, adv, mask, seq_clip_low=lo, seq_clip_high=hi, is_cap=cap)
    count = mask.sum(-1, keepdim=True)
    s = torch.exp(torch.where(mask, theta.detach() - p, 0.0).sum(-1, keepdim=True) / count)
    w = torch.exp(torch.where(mask, p - b, 0.0).sum(-1, keepdim=True) / count).clamp(max=cap)
    a = adv[:, :1]
    active = ~(s.clamp(1 - lo, 1 + hi) * a < s * a)  # the sequence's clip is not what the min picked
    assert 0 < int(active.sum()) < N and bool((w == cap).any())  # the case clips and truncates something
    # d/dθ_t of Σ_t' (−w s A) / Σ mask = −w A s / |y| · |y| / Σ mask (every token of the sequence alike)
    expected = (-w * a * s * active / mask.sum()).expand_as(theta) * mask
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-12)
    assert 0 < float(metrics["clipped_fraction"]) < 1


def test_topr_imitates_better_samples_and_tapers_worse_ones_by_their_sequence_ratio():
    theta, b, p, adv, mask = make_batch(spread=0.1, prox_shift=0.4, seed=3)
    adv = adv[:, :1].expand_as(adv).clone()  # one advantage per sequence
    adv[0] = -adv[0].abs()
    b = b.clone()
    b[0] = theta.detach()[0] + 0.5  # a worse sample the current policy avoids: sequence ratio < 1
    grad, _, metrics = grad_of("topr", theta, b, p, adv, mask)
    log_ratio = torch.where(mask, theta.detach() - b, 0.0).sum(-1, keepdim=True)
    w = torch.where(adv > 0, 1.0, torch.exp(log_ratio).clamp(max=1.0))  # no gradient through the taper
    torch.testing.assert_close(grad, -w * adv * mask / mask.sum(), rtol=1e-12, atol=1e-12)
    worse = adv[:, 0] < 0
    assert bool(worse.any()) and bool((adv[:, 0] > 0).any())  # the case has both kinds
    assert float(w[0, 0]) < 1.0 and float(w.max()) <= 1.0 and float(metrics["ess"]) <= 1.0


def test_the_package_names_resolve_on_first_use():
    """`streamrl.correction` imports its modules lazily, so that reading a config does not import torch."""
    import streamrl.correction as correction

    assert sorted(correction.__all__) == sorted(correction._HOME)
    for name in correction.__all__:
        assert getattr(correction, name) is not None
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        correction.nothing  # noqa: B018
