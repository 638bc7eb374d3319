"""The trainer step without a trainer: `streamrl.trainer.step.run_step` over a bigram model of these
tests' own (a real torch module in float64, no Hugging Face model, no distributed torch). Data
parallelism is two ranks in two threads that exchange their gradients and metrics through a barrier."""

import copy
import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from harness.synthetic import synthetic_batch
from streamrl.buffer import QueueConfig, ReplayQueue
from streamrl.buffer.padded import to_padded
from streamrl.config import TrainerSection
from streamrl.correction import LossConfig, token_logprobs
from streamrl.trainer.step import StepPlan, merge_ranks, run_step

VOCAB, GROUP = 17, 4


class Exchange:
    """All-gather between threads (the test's stand-in for a process group: same calls, same order)."""

    def __init__(self, ranks: int):
        self.barrier = threading.Barrier(ranks, timeout=30)
        self.slots = [None] * ranks

    def all_gather(self, rank: int, value):
        self.barrier.wait()
        self.slots[rank] = value
        self.barrier.wait()
        gathered = list(self.slots)
        self.barrier.wait()
        return gathered


class Bigram(torch.nn.Module):
    def __init__(self):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.table = torch.nn.Parameter(0.5 * torch.randn(VOCAB, VOCAB, generator=generator, dtype=torch.float64))

    def forward(self, input_ids):
        return self.table[input_ids]  # next-token logits at every position


class BigramBackend:
    """A `streamrl.trainer.step.Backend`; rank `rank` of `ranks` data-parallel ranks sharing `exchange`."""

    def __init__(self, *, rank=0, ranks=1, exchange=None, reference=False):
        self.model, self.rank, self.ranks, self.exchange = Bigram(), rank, ranks, exchange
        self.reference = copy.deepcopy(self.model).requires_grad_(False) if reference else None
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.calls: list[tuple[str, list[np.ndarray]]] = []

    def _logprobs(self, model, batch, lengths, rows):
        ids = batch.input_ids[torch.from_numpy(rows), :int(lengths[rows].max())]
        return token_logprobs(model(ids)[:, :-1], ids[:, 1:])

    def shard(self, rows):
        return rows if self.ranks == 1 else rows.reshape(-1, GROUP)[self.rank::self.ranks].ravel()

    @torch.no_grad()
    def logprobs(self, batch, lengths, parts, *, reference=False):
        self.calls.append(("reference" if reference else "logprobs", parts))
        model = self.reference if reference else self.model
        return [self._logprobs(model, batch, lengths, rows) for rows in parts]

    def backward(self, batch, lengths, parts, loss_of):
        self.calls.append(("backward", parts))
        for rows in parts:
            loss_of(rows, self._logprobs(self.model, batch, lengths, rows)).backward()

    def clip_gradients(self, max_norm):
        grad = self.model.table.grad
        if self.exchange is not None:
            grad.copy_(sum(self.exchange.all_gather(self.rank, grad.clone())))
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    def optimizer_step(self, lr):
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()

    def zero_grad(self):
        self.optimizer.zero_grad(set_to_none=True)

    def snapshot(self):
        return copy.deepcopy(self.model.state_dict()), copy.deepcopy(self.optimizer.state_dict())

    def restore(self, saved):
        self.model.load_state_dict(saved[0])
        self.optimizer.load_state_dict(saved[1])

    def gather_metrics(self, totals):
        return self.all_gather(totals)

    def all_gather(self, value):
        return [value] if self.exchange is None else self.exchange.all_gather(self.rank, value)

    def flat_gradient(self):
        return self.model.table.grad.flatten().clone()


def padded_batch(groups=8, seed=0):
    tickets = ReplayQueue(QueueConfig(group_size=GROUP, groups_per_step=groups, max_in_flight=64)).admit(0, groups).tickets
    return to_padded(synthetic_batch(tickets, GROUP, prompt_len=(2, 5), response_len=(2, 9), vocab_size=VOCAB,
                                     rng=np.random.default_rng(seed)))


def plan(loss="decoupled_ppo", **section):
    section = {"lr": 1e-2, "minibatches": 2, "grad_clip": 1.0, **section}
    return StepPlan.of(TrainerSection(**section), LossConfig(name=loss), GROUP)


def step(backend, the_plan, batch, seed=0):
    return run_step(backend, the_plan, batch, version=0, optimizer_steps=0, rng=np.random.default_rng(seed))


@pytest.mark.parametrize("loss", ["decoupled_ppo", "tis", "masked_is", "ppo_bypass", "m2po", "gspo"])
def test_the_micro_batch_cut_does_not_change_the_step(loss):
    batch = padded_batch()
    whole, cut = BigramBackend(), BigramBackend()
    m_whole = step(whole, plan(loss, micro_batch_tokens=8192), batch)
    m_cut = step(cut, plan(loss, micro_batch_tokens=12), batch)
    assert len(cut.calls[-1][1]) > 4 > len(whole.calls[-1][1])  # many micro-batches against one or two
    # gspo: one weight per sequence, gradient entries that nearly cancel; AdamW's normalisation turns the
    # summation order of micro-batches into 1e-9 (the other losses agree to 1e-12)
    atol = 1e-8 if loss == "gspo" else 1e-12
    torch.testing.assert_close(whole.model.table, cut.model.table, atol=atol, rtol=0)
    if loss == "m2po":
        assert 0 < m_whole["masked_fraction"] < 1  # the mask is really at work
    assert m_whole.keys() == m_cut.keys()
    for name in m_whole:
        assert m_whole[name] == pytest.approx(m_cut[name], rel=1e-6, abs=1e-12), name  # reported in float32


@pytest.mark.parametrize("minibatches, loss", [(1, "decoupled_ppo"), (2, "decoupled_ppo"), (1, "m2po"), (2, "m2po")])
def test_two_data_parallel_ranks_take_exactly_the_one_rank_step(minibatches, loss):
    """Each rank trains on its half of each mini-batch's groups with the loss over the whole mini-batch's
    tokens; the summed gradient, the weights after the step and the merged metrics are the one rank's."""
    batch, the_plan = padded_batch(), plan(loss, minibatches=minibatches)
    alone = BigramBackend()
    expected = step(alone, the_plan, batch)
    exchange = Exchange(2)
    ranks = [BigramBackend(rank=r, ranks=2, exchange=exchange) for r in range(2)]
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda backend: step(backend, the_plan, batch), ranks))
    for backend, metrics in zip(ranks, results):
        trained = np.concatenate([rows for kind, parts in backend.calls if kind == "backward" for rows in parts])
        assert len(trained) == len(batch.rewards) // 2  # half the rows, whole groups of them
        torch.testing.assert_close(backend.model.table, alone.model.table, atol=1e-12, rtol=0)
        assert metrics.keys() == expected.keys()
        for name in expected:
            assert metrics[name] == pytest.approx(expected[name], rel=1e-6, abs=1e-12), name  # reported in float32


def test_every_row_is_trained_once_per_step_and_p_is_taken_before_the_first_optimizer_step():
    backend = BigramBackend()
    metrics = step(backend, plan(minibatches=3, micro_batch_tokens=20), padded_batch(groups=7))
    kinds = [kind for kind, _ in backend.calls]
    assert kinds == ["logprobs", "backward", "backward", "backward"] and metrics["optimizer_steps"] == 3
    trained = np.concatenate([rows for kind, parts in backend.calls[1:] for rows in parts])
    assert sorted(trained.tolist()) == list(range(7 * GROUP))
    for _, parts in backend.calls[1:]:
        for rows in parts:  # whole groups per mini-batch, each micro-batch within the token budget or alone
            assert len(rows) == 1 or len(rows) * int(max(padded_batch(groups=7).prompt_lengths[rows]
                                                         + padded_batch(groups=7).response_lengths[rows])) <= 20


@pytest.mark.parametrize("loss, minibatches, passes", [
    ("decoupled_ppo", 1, []),  # one optimizer step: p is θ.detach(), no extra pass
    ("decoupled_ppo", 2, ["logprobs"]),
    ("reinforce", 2, []),  # a loss that never reads p
    ("m2po", 1, ["logprobs"]),  # its mask needs the whole batch's p before the first gradient
])
def test_no_grad_passes_run_only_when_the_loss_reads_them(loss, minibatches, passes):
    backend = BigramBackend()
    step(backend, plan(loss, minibatches=minibatches), padded_batch())
    assert [kind for kind, _ in backend.calls if kind != "backward"] == passes


def test_a_kl_penalty_takes_one_reference_pass_over_every_row():
    backend = BigramBackend(reference=True)
    the_plan = StepPlan.of(TrainerSection(lr=1e-2), LossConfig(name="reinforce", kl_coef=0.1), GROUP)
    metrics = step(backend, the_plan, padded_batch())
    (kind, parts), = [call for call in backend.calls if call[0] != "backward"]
    assert kind == "reference" and sorted(np.concatenate(parts).tolist()) == list(range(8 * GROUP))
    assert metrics["kl_ref"] == pytest.approx(0.0, abs=1e-12)  # θ starts at the reference


def test_a_non_finite_gradient_in_a_later_minibatch_restores_the_backend_and_raises():
    backend = BigramBackend()
    step(backend, plan(), padded_batch(seed=1))  # AdamW state to restore
    before = copy.deepcopy(backend.snapshot())
    the_plan, calls = plan(), []

    def poisoned(policy_batch, **kwargs):  # the second mini-batch's loss is NaN
        calls.append(1)
        loss, metrics = plan().loss_fn(policy_batch, **kwargs)
        return (loss * float("nan") if len(calls) > 1 else loss), metrics

    with pytest.raises(FloatingPointError, match="non-finite gradient norm at version 0"):
        step(backend, dataclasses.replace(the_plan, loss_fn=poisoned), padded_batch(seed=2))
    assert len(calls) == 2  # the first mini-batch was applied, then undone
    torch.testing.assert_close(backend.model.table, before[0]["table"], atol=0, rtol=0)
    after = backend.optimizer.state_dict()["state"][0]
    for key, value in before[1]["state"][0].items():
        torch.testing.assert_close(after[key], value, atol=0, rtol=0)


def test_the_learning_rate_follows_the_schedule_from_the_steps_already_taken():
    backend = BigramBackend()
    the_plan = plan(lr_schedule="linear", lr_decay_steps=10, warmup_steps=2)
    metrics = run_step(backend, the_plan, padded_batch(), version=3, optimizer_steps=4, rng=np.random.default_rng(0))
    assert metrics["lr"] == pytest.approx(the_plan.lr(5)) and the_plan.lr(5) < the_plan.lr(4) < 1e-2


def test_ranks_metrics_merge_by_one_rule():
    merged = merge_ranks([{"loss": 0.25, "clip_frac": 0.1, "ratio_max": 2.0, "ratio_min": 0.5, "tokens": 10.0,
                           "mismatch_kl_sum": 1.0},
                          {"loss": 0.5, "clip_frac": 0.2, "ratio_max": 3.0, "ratio_min": 0.9, "tokens": 6.0}])
    assert merged == {"loss": 0.75, "clip_frac": pytest.approx(0.3), "ratio_max": 3.0, "ratio_min": 0.5,
                      "tokens": 16.0, "mismatch_kl_sum": 1.0}
    assert merge_ranks([{"x_max": 1.0}]) == {"x_max": 1.0}


def test_a_diagnosed_step_trains_exactly_as_an_undiagnosed_one():
    """The diagnostics' extra passes (gradients of halves of the batch and of a fresh one, KL after the
    step) leave the weights, the optimizer state and the mini-batch shuffle as they were."""
    batch, fresh = padded_batch(groups=8, seed=3), padded_batch(groups=8, seed=5)
    plain, diagnosed = BigramBackend(), BigramBackend()
    m_plain = step(plain, plan(minibatches=2), batch)
    m_diag = run_step(diagnosed, plan(minibatches=2, diagnose_every=1), batch, version=0, optimizer_steps=0,
                      rng=np.random.default_rng(0), fresh=fresh)
    torch.testing.assert_close(plain.model.table, diagnosed.model.table, atol=0, rtol=0)
    for key, value in plain.optimizer.state_dict()["state"][0].items():
        torch.testing.assert_close(diagnosed.optimizer.state_dict()["state"][0][key], value, atol=0, rtol=0)
    assert m_diag["loss"] == m_plain["loss"]
    assert m_diag["update_kl"] > 0 and "update_kl" not in m_plain  # the step moved the policy
    # every token of the synthetic batch is of version 0 and the step is at version 0: one lag
    assert m_diag["kl_by_lag"].keys() == {"0"}
    for name in ("grad_cos_stale_halves", "grad_cos_fresh_halves", "grad_cos_stale_fresh"):
        assert -1 <= m_diag[name] <= 1


def test_the_halves_gradients_are_the_gradients_of_one_step_split_by_rows():
    """The alignment compares the gradients a step follows: taken at the step's starting weights, each
    half's normalised by its own tokens, so that the token-weighted mean of two complementary halves is
    the gradient of one optimizer step on the whole batch — the stale batch's and the fresh one's."""

    class Recording(BigramBackend):
        def __init__(self):
            super().__init__()
            self.halves, self.step_gradients = [], []

        def flat_gradient(self):
            gradient = super().flat_gradient()
            self.halves.append((np.concatenate(self.calls[-1][1]), gradient))
            return gradient

        def clip_gradients(self, max_norm):
            self.step_gradients.append(self.model.table.grad.flatten().clone())
            return super().clip_gradients(max_norm)

    batch, fresh = padded_batch(groups=8, seed=4), padded_batch(groups=8, seed=6)
    backend, fresh_step = Recording(), Recording()
    run_step(backend, plan(minibatches=1, diagnose_every=1, grad_clip=1e9), batch, version=0, optimizer_steps=0,
             rng=np.random.default_rng(0), fresh=fresh)
    step(fresh_step, plan(minibatches=1, grad_clip=1e9), fresh)  # what one step on the fresh batch follows
    assert len(backend.halves) == 4 and len(backend.step_gradients) == 1
    for data, pair, whole in ((batch, backend.halves[:2], backend.step_gradients[0]),
                              (fresh, backend.halves[2:], fresh_step.step_gradients[0])):
        tokens = data.loss_mask[:, 1:].sum(-1).numpy()
        (rows_a, grad_a), (rows_b, grad_b) = pair
        assert sorted(np.concatenate([rows_a, rows_b]).tolist()) == list(range(8 * GROUP))
        n_a, n_b = tokens[rows_a].sum(), tokens[rows_b].sum()
        # to float32's precision: the behaviour log-probs and the advantages are float32
        torch.testing.assert_close((n_a * grad_a + n_b * grad_b) / (n_a + n_b), whole, atol=1e-8, rtol=1e-6)
    assert sorted(backend.halves[0][0]) == sorted(backend.halves[2][0])  # the same prompts in each half
