import copy
import dataclasses

import numpy as np
import pyarrow as pa
import pytest
import torch

from harness.synthetic import synthetic_batch
from streamrl.buffer import QueueConfig, ReplayQueue
from streamrl.config import TrainerSection
from streamrl.correction import LossConfig
from streamrl.tasks.reverse import ReverseDigits
from streamrl.trainer.step import forward_logprobs, micro_batches, minibatch_rows
from streamrl.trainer.torch_trainer import TorchTrainer


def batch(groups=4, group_size=4, seed=0, response_len=(2, 7)):
    queue = ReplayQueue(QueueConfig(group_size=group_size, groups_per_step=groups, max_in_flight=64))
    tickets = queue.admit(0, groups).tickets
    return synthetic_batch(tickets, group_size, prompt_len=(2, 5), response_len=response_len, vocab_size=17,
                           rng=np.random.default_rng(seed))


def trainer(model_dir, micro_batch_tokens=8192, loss="decoupled_ppo", lr=1e-3):
    return TorchTrainer(model_dir, trainer=TrainerSection(micro_batch_tokens=micro_batch_tokens, lr=lr),
                        loss=LossConfig(name=loss), group_size=4)


def test_micro_batches_cover_every_row_once_within_the_budget():
    lengths = np.array([5, 3, 9, 2, 7, 7, 1, 20])
    chunks = list(micro_batches(lengths, token_budget=14))
    assert sorted(np.concatenate(chunks).tolist()) == list(range(8))
    for chunk in chunks:
        assert len(chunk) * lengths[chunk].max() <= 14 or len(chunk) == 1


@pytest.mark.parametrize("loss", ["decoupled_ppo", "tis", "ppo_bypass"])
def test_micro_batching_gives_the_same_update_as_one_batch(tiny_model_dir, loss):
    data = batch()
    whole, split = trainer(tiny_model_dir, loss=loss), trainer(tiny_model_dir, micro_batch_tokens=12, loss=loss)
    m_whole, m_split = whole.train(data), split.train(data)
    assert m_whole["loss"] == pytest.approx(m_split["loss"], abs=1e-5)
    assert m_whole["grad_norm"] == pytest.approx(m_split["grad_norm"], rel=1e-4)
    for a, b in zip(whole.backend.model.parameters(), split.backend.model.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert whole.version == split.version == 1


def test_one_step_moves_the_policy_toward_higher_reward_samples(tiny_model_dir):
    # Two samples per group: the rewarded one's log-prob should rise after a step.
    data = batch(groups=2, group_size=4, response_len=4)
    rewards = np.array([1, 0, 0, 0, 0, 0, 0, 1], dtype=np.float32)
    data = data.set_column(data.schema.get_field_index("reward"), "reward", pa.array(rewards))
    t = trainer(tiny_model_dir, lr=1e-2)
    from streamrl.buffer.padded import to_padded
    padded = to_padded(data)

    def seq_logprob():
        with torch.no_grad():
            lp = t.backend.token_logprobs(padded.input_ids, padded.attention_mask)
        return (lp * padded.loss_mask[:, 1:]).sum(-1)

    before = seq_logprob()
    t.train(data)
    after = seq_logprob()
    assert (after - before)[[0, 7]].min() > (after - before)[[1, 2, 3, 4, 5, 6]].max()


def test_checkpoint_round_trip_restores_weights_optimizer_and_version(tiny_model_dir, tmp_path):
    t = trainer(tiny_model_dir)
    t.train(batch(seed=1))
    t.save(tmp_path)
    restored = trainer(tmp_path / "model")
    restored.load_optimizer(tmp_path)
    assert restored.version == 1
    data = batch(seed=2)
    t.train(data)
    restored.train(data)  # same weights + same Adam moments -> same next step
    for a, b in zip(t.backend.model.parameters(), restored.backend.model.parameters()):
        torch.testing.assert_close(a, b)


def test_a_resume_trains_with_the_optimizer_settings_configured_not_those_saved(tiny_model_dir, tmp_path):
    t = trainer(tiny_model_dir)
    t.train(batch(seed=1))
    t.save(tmp_path)
    changed = TorchTrainer(tmp_path / "model", trainer=TrainerSection(weight_decay=0.5, betas=(0.5, 0.6)),
                           loss=LossConfig(), group_size=4)
    changed.load_optimizer(tmp_path)
    for group in changed.backend.optimizer.param_groups:  # the decay is applied outside AdamW: see below
        assert group["weight_decay"] == 0.0 and tuple(group["betas"]) == (0.5, 0.6)
    assert changed.backend.optimizer.state  # the moments themselves are the checkpoint's


def test_weight_decay_shrinks_matrices_only_as_adamw_with_megatrons_parameter_groups(tiny_model_dir):
    """Megatron decays neither biases nor norm scales (1-D parameters); every parameter used to be."""
    t = TorchTrainer(tiny_model_dir, trainer=TrainerSection(weight_decay=0.5), loss=LossConfig(), group_size=4)
    reference = copy.deepcopy(t.backend.model)
    params = list(reference.parameters())
    assert any(p.ndim < 2 for p in params) and any(p.ndim >= 2 for p in params)
    adamw = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.5},
                               {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                              lr=0.1, betas=TrainerSection().betas)
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        for ours, theirs in zip(t.backend.model.parameters(), params, strict=True):
            ours.grad = torch.randn(ours.shape, generator=generator)
            theirs.grad = ours.grad.clone()
        t.backend.optimizer_step(0.1)
        adamw.step()
    for ours, theirs in zip(t.backend.model.parameters(), params, strict=True):
        torch.testing.assert_close(ours, theirs)


def test_a_non_finite_gradient_skips_the_step_and_says_so(tiny_model_dir):
    t = trainer(tiny_model_dir)
    before = [p.detach().clone() for p in t.backend.model.parameters()]
    with torch.no_grad():
        t.backend.model.get_input_embeddings().weight[3, 0] = float("nan")
        before[0][3, 0] = float("nan")
    with pytest.raises(FloatingPointError, match="non-finite gradient norm at version 0"):
        t.train(batch(groups=4))
    assert t.version == 0


def test_evaluate_reports_accuracy_and_reward_on_held_out_prompts(tiny_model_dir):
    task = ReverseDigits(2)
    result = trainer(tiny_model_dir).evaluate(task, limit=20, max_new_tokens=4)
    assert result["eval_prompts"] == len(task.eval_numbers()) < 20  # about a tenth of the 100 strings
    assert 0.0 <= result["eval_accuracy"] <= result["eval_reward"] + 1e-9 <= 1.0 + 1e-9


def minibatch_trainer(model_dir, minibatches, loss="decoupled_ppo", lr=1e-2):
    return TorchTrainer(model_dir, trainer=TrainerSection(minibatches=minibatches, lr=lr), loss=LossConfig(name=loss),
                        group_size=4)


@pytest.mark.parametrize("loss", ["decoupled_ppo", "naive", "tis"])
def test_minibatches_step_each_share_of_groups_against_the_proximal_policy_of_the_step_start(tiny_model_dir, loss):
    data = batch(groups=6, seed=3)
    t = minibatch_trainer(tiny_model_dir, minibatches=2, loss=loss)
    metrics = t.train(data)
    assert t.version == 1 and metrics["optimizer_steps"] == 2

    # Reference: the same two AdamW steps written out over whole padded tensors, p computed once before.
    ref = minibatch_trainer(tiny_model_dir, minibatches=1, loss=loss)
    from streamrl.buffer.padded import to_padded
    from streamrl.correction import PolicyBatch, broadcast_to_tokens, grpo_advantages

    padded = to_padded(data)
    mask = padded.loss_mask[:, 1:]
    adv = broadcast_to_tokens(grpo_advantages(padded.rewards, 4), mask)
    with torch.no_grad():
        p = ref.backend.token_logprobs(padded.input_ids, padded.attention_mask)
    for part in np.array_split(np.random.default_rng(0).permutation(6), 2):
        rows = torch.from_numpy((part[:, None] * 4 + np.arange(4)).ravel())
        ref.backend.optimizer.zero_grad()
        theta = ref.backend.token_logprobs(padded.input_ids[rows], padded.attention_mask[rows])
        loss_value, _ = ref.plan.loss_fn(PolicyBatch(theta, padded.behavior_logprobs[rows, 1:], adv[rows], mask[rows],
                                                proximal_logprobs=p[rows]), denominator=float(mask[rows].sum()))
        loss_value.backward()
        torch.nn.utils.clip_grad_norm_(ref.backend.model.parameters(), 1.0)
        ref.backend.optimizer.step()
    for a, b in zip(t.backend.model.parameters(), ref.backend.model.parameters()):
        # sdpa over other widths: ≤ 1.1e-5 measured; a wrong p (θ.detach()) is off by 1.6e-2
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


@pytest.mark.parametrize("loss, needs_proximal", [("reinforce", False), ("ppo_bypass", False),
                                                   ("decoupled_ppo", True)])
def test_the_proximal_forward_pass_runs_only_for_losses_that_read_it(tiny_model_dir, loss, needs_proximal):
    """`LossConfig.needs_proximal` decides: with several mini-batches, a loss that never reads p (it
    anchors on the behaviour policy) does not pay for the extra no-grad pass over the whole batch."""
    t = minibatch_trainer(tiny_model_dir, minibatches=2, loss=loss)
    passes = []
    logprobs = t.backend.logprobs
    t.backend.logprobs = lambda *args, **kwargs: passes.append(1) or logprobs(*args, **kwargs)
    assert t.train(batch(groups=4, seed=5))["optimizer_steps"] == 2
    assert len(passes) == int(needs_proximal)


def test_minibatch_rows_are_whole_groups_each_trained_once():
    rng = np.random.default_rng(0)
    parts = minibatch_rows(7 * 4, group_size=4, minibatches=3, rng=rng)
    assert [len(p) for p in parts] == [12, 8, 8]
    assert sorted(np.concatenate(parts).tolist()) == list(range(28))
    for part in parts:
        assert all(set(part[i:i + 4] // 4) == {part[i] // 4} for i in range(0, len(part), 4))
    assert len(minibatch_rows(2 * 4, group_size=4, minibatches=3, rng=rng)) == 2  # never more mini-batches than groups


def test_a_non_finite_gradient_in_a_later_minibatch_rolls_the_whole_step_back(tiny_model_dir):
    t = minibatch_trainer(tiny_model_dir, minibatches=2)
    before = [p.detach().clone() for p in t.backend.model.parameters()]
    calls = []
    inner = t.plan.loss_fn

    def poisoned(policy_batch, **kwargs):  # the second mini-batch's loss is NaN
        calls.append(1)
        loss_value, metrics = inner(policy_batch, **kwargs)
        return (loss_value * float("nan") if len(calls) > 1 else loss_value), metrics

    t.plan = dataclasses.replace(t.plan, loss_fn=poisoned)
    with pytest.raises(FloatingPointError, match="non-finite gradient norm at version 0"):
        t.train(batch(groups=4))
    assert len(calls) == 2 and t.version == 0
    for a, b in zip(before, t.backend.model.parameters()):
        torch.testing.assert_close(a, b)
    assert not t.backend.optimizer.state  # AdamW's moments as before the step: none yet


# ---- the learning-rate schedule and activation checkpointing ------------------------------------------------

def test_the_schedule_warms_up_linearly_then_decays_to_its_floor():
    from streamrl.trainer.schedule import lr_at

    assert [lr_at(s, lr=1.0, warmup_steps=4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cosine = [lr_at(s, lr=2.0, schedule="cosine", warmup_steps=2, decay_steps=6, min_lr_ratio=0.1) for s in range(9)]
    assert cosine[:3] == [1.0, 2.0, 2.0] and cosine[4] == pytest.approx(0.2 + 1.8 * 0.5)  # half-way: the middle
    assert cosine[6:] == [pytest.approx(0.2)] * 3 and all(a >= b for a, b in zip(cosine[1:], cosine[2:]))
    linear = [lr_at(s, lr=1.0, schedule="linear", decay_steps=4) for s in range(6)]
    assert linear == [1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
    with pytest.raises(ValueError, match="needs decay_steps > warmup_steps"):
        lr_at(0, lr=1.0, schedule="cosine", warmup_steps=2)


def scheduled_trainer(model_dir, minibatches=2):
    section = TrainerSection(lr=1e-2, lr_schedule="cosine", warmup_steps=2, lr_decay_steps=9, min_lr_ratio=0.1,
                             minibatches=minibatches)
    return TorchTrainer(model_dir, trainer=section, loss=LossConfig(name="decoupled_ppo"), group_size=4)


def test_a_resumed_trainer_continues_the_schedule_exactly(tiny_model_dir, tmp_path):
    """3 steps, a checkpoint, a new trainer from it, 2 more steps: the learning rates and weights of an
    uninterrupted 5-step run (2 optimizer steps a batch: 10 in all, across the warm-up and the decay)."""
    from streamrl.trainer.schedule import lr_at

    data = [batch(seed=s) for s in range(5)]
    whole = scheduled_trainer(tiny_model_dir)
    lrs = [whole.train(d)["lr"] for d in data]
    first = scheduled_trainer(tiny_model_dir)
    resumed_lrs = [first.train(d)["lr"] for d in data[:3]]
    first.save(tmp_path)
    second = scheduled_trainer(tmp_path / "model")
    second.load_optimizer(tmp_path)
    assert second.optimizer_steps == 6 and second.version == 3
    resumed_lrs += [second.train(d)["lr"] for d in data[3:]]
    assert resumed_lrs == lrs  # each the rate of the step's last optimizer step
    schedule = dict(lr=1e-2, schedule="cosine", warmup_steps=2, decay_steps=9, min_lr_ratio=0.1)
    assert lrs == [lr_at(2 * i + 1, **schedule) for i in range(5)]
    for a, b in zip(whole.backend.model.parameters(), second.backend.model.parameters()):
        torch.testing.assert_close(a, b)


def test_a_rolled_back_step_leaves_the_schedule_where_it_was(tiny_model_dir):
    t = scheduled_trainer(tiny_model_dir)
    t.train(batch(seed=0))
    inner, calls = t.plan.loss_fn, []

    def poisoned(policy_batch, **kwargs):  # the second mini-batch's loss is NaN: the whole step rolls back
        calls.append(1)
        loss_value, metrics = inner(policy_batch, **kwargs)
        return (loss_value * float("nan") if len(calls) > 1 else loss_value), metrics

    t.plan = dataclasses.replace(t.plan, loss_fn=poisoned)
    with pytest.raises(FloatingPointError):
        t.train(batch(seed=1))
    assert len(calls) == 2 and t.optimizer_steps == 2 and t.version == 1


def test_activation_checkpointing_gives_the_same_update(tiny_model_dir):
    plain = trainer(tiny_model_dir, lr=1e-2)
    recomputed = TorchTrainer(tiny_model_dir, trainer=TrainerSection(lr=1e-2, gradient_checkpointing=True),
                              loss=LossConfig(name="decoupled_ppo"), group_size=4)
    data = batch(seed=3)
    assert plain.train(data)["grad_norm"] == pytest.approx(recomputed.train(data)["grad_norm"], rel=1e-5)
    for a, b in zip(plain.backend.model.parameters(), recomputed.backend.model.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_schedule_and_checkpointing_contradictions_are_refused():
    from streamrl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="warmup_steps=50 reaches the decay's end"):
        load_config(None, ["trainer.lr_schedule=cosine", "trainer.warmup_steps=50", "run.steps=40"])
    with pytest.raises(ConfigError, match="gradient_checkpointing needs trainer.backend = 'torch'"):
        load_config(None, ["trainer.gradient_checkpointing=true", "trainer.backend=megatron"])
    assert load_config(None, ["trainer.lr_schedule=linear", "run.steps=40"]).optimizer_steps == 40


def with_exact_behaviour(model_dir, data):
    """`data` with behaviour log-probs computed exactly as a float32 trainer computes them: a sampler
    that matched the trainer bit for bit."""
    from streamrl.buffer.padded import to_padded

    padded = to_padded(data)
    with torch.no_grad():
        exact = trainer(model_dir).backend.token_logprobs(padded.input_ids, padded.attention_mask)
    mask = padded.loss_mask[:, 1:].bool()
    rows = [exact[i][mask[i]].tolist() for i in range(len(exact))]
    return data.set_column(data.schema.get_field_index("behavior_logprobs"), "behavior_logprobs",
                           pa.array(rows, type=pa.list_(pa.float32())))


def test_the_train_inference_mismatch_is_reported_and_bf16_training_keeps_float32_weights(tiny_model_dir):
    data = with_exact_behaviour(tiny_model_dir, batch())
    tokens = sum(len(row) for row in data.column("behavior_logprobs").to_pylist())
    same = trainer(tiny_model_dir).train(data)
    assert same["mismatch_tokens"] == tokens  # the synthetic batch is all version 0: the trainer's own
    assert same["mismatch_abs_max"] < 1e-5 and same["mismatch_kl"] < 1e-10
    bf16 = TorchTrainer(tiny_model_dir, trainer=TrainerSection(), loss=LossConfig(), group_size=4, dtype="bfloat16")
    metrics = bf16.train(data)
    assert metrics["mismatch_abs_max"] > 1e-4 and 0 < metrics["mismatch_kl"] < 1e-2  # bf16's rounding, no more
    assert np.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    assert {p.dtype for p in bf16.backend.model.parameters()} == {torch.float32}  # the optimizer's master weights
    assert {v.dtype for s in bf16.backend.optimizer.state.values() for k, v in s.items() if k != "step"} == {torch.float32}


def test_a_bf16_trainer_at_a_temperature_divides_its_logits_in_float32_as_the_sampler_does(tiny_model_dir):
    from streamrl.trainer.torch_trainer import TorchBackend

    backend = TorchBackend(tiny_model_dir, config=TrainerSection(), temperature=0.6, dtype="bfloat16")
    with torch.no_grad():
        backend.model.lm_head.weight.mul_(40)  # logits of an LLM's size, where a second bf16 rounding shows
    ids = torch.randint(1, 17, (3, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        logits = backend.model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    assert logits.dtype == torch.bfloat16 and logits.abs().max() > 8
    sampler = torch.log_softmax(logits.float() / 0.6, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    with torch.no_grad():
        torch.testing.assert_close(backend.token_logprobs(ids, mask), sampler, atol=1e-5, rtol=0)


def test_the_trainer_computes_logits_only_where_it_needs_them_and_the_log_probs_do_not_change(tiny_model_dir):
    from streamrl.trainer.torch_trainer import TorchBackend, _takes_logits_to_keep

    backend = TorchBackend(tiny_model_dir, config=TrainerSection(), temperature=0.8)
    assert _takes_logits_to_keep(backend.model)  # the path below is the one runs take
    ids = torch.randint(1, 17, (3, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    logits = backend.model(input_ids=ids, attention_mask=mask).logits  # every position
    expected = torch.log_softmax(logits[:, :-1] / 0.8, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    got = backend.token_logprobs(ids, mask)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    (expected_grad,) = torch.autograd.grad(expected.sum(), backend.model.lm_head.weight)
    (grad,) = torch.autograd.grad(got.sum(), backend.model.lm_head.weight)
    torch.testing.assert_close(grad, expected_grad, atol=1e-5, rtol=1e-5)


def test_a_stale_only_batch_reports_no_mismatch(tiny_model_dir):
    queue = ReplayQueue(QueueConfig(group_size=4, groups_per_step=4, max_in_flight=64))
    t = trainer(tiny_model_dir)
    t.version = 3
    data = synthetic_batch(queue.admit(0, 4).tickets, 4, prompt_len=(2, 5), response_len=(2, 7), vocab_size=17,
                           rng=np.random.default_rng(0), version=1)
    assert not {"mismatch_kl", "mismatch_abs_max", "mismatch_tokens"} & set(t.train(data))


def kl_trainer(model_dir, kl_coef, estimator="k1", **section):
    return TorchTrainer(model_dir, trainer=TrainerSection(lr=3e-2, **section),
                        loss=LossConfig(name="reinforce", kl_coef=kl_coef, kl_estimator=estimator), group_size=4)


def test_the_kl_penalty_uses_reference_log_probs_of_the_initial_weights(tiny_model_dir):
    """The gradient of the step equals the gradient written out by hand: the policy term plus
    kl_coef × ∂(θ − ref) over the tokens, ref from a frozen copy of the weights the trainer started from."""
    from streamrl.buffer.padded import to_padded
    from streamrl.correction import PolicyBatch, make_loss, token_means

    data = batch()
    t = kl_trainer(tiny_model_dir, kl_coef=0.5)
    t.train(data)  # θ moves away from the reference
    padded = to_padded(data)
    mask = padded.loss_mask[:, 1:]
    adv = torch.zeros_like(mask, dtype=torch.float32)  # isolate the penalty: no policy-gradient term
    with torch.no_grad():
        ref = trainer(tiny_model_dir).backend.token_logprobs(padded.input_ids, padded.attention_mask)  # initial weights
    theta = t.backend.token_logprobs(padded.input_ids, padded.attention_mask)
    loss, metrics = make_loss(LossConfig(name="reinforce", kl_coef=0.5, kl_estimator="k1"))(
        PolicyBatch(theta, padded.behavior_logprobs[:, 1:], adv, mask, ref_logprobs=forward_logprobs(
            t.backend, padded, (padded.prompt_lengths + padded.response_lengths).numpy(), np.arange(len(mask)),
            token_budget=8192, reference=True)))
    by_hand = 0.5 * ((theta - ref) * mask).sum() / mask.sum()
    grads = torch.autograd.grad(loss, list(t.backend.model.parameters()), retain_graph=True)
    expected = torch.autograd.grad(by_hand, list(t.backend.model.parameters()))
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert float(token_means(metrics)["kl_ref"]) == pytest.approx(float(by_hand.detach()) / 0.5, rel=1e-5)


@pytest.mark.parametrize("offload", [False, True])
def test_a_large_kl_coefficient_keeps_the_policy_at_its_reference(tiny_model_dir, offload):
    data = batch(seed=1)
    free = kl_trainer(tiny_model_dir, 1e-4, "k3")  # k3 ≥ 0 on any tokens (these are not sampled from θ)
    held = kl_trainer(tiny_model_dir, 50.0, "k3", reference_offload=offload)
    for _ in range(6):
        loose, tight = free.train(data), held.train(data)
    assert loose["kl_ref"] > 0.05  # the policy moved away from its start
    assert tight["kl_ref"] < loose["kl_ref"] / 10
    assert held.backend.reference.device.type == "cpu" if offload else True


def test_a_resumed_trainer_keeps_the_initial_weights_as_its_reference(tiny_model_dir, tmp_path):
    first = kl_trainer(tiny_model_dir, 0.5)
    first.train(batch())
    first.save(tmp_path)
    resumed = TorchTrainer(tmp_path / "model", trainer=TrainerSection(lr=3e-2),
                           loss=LossConfig(name="reinforce", kl_coef=0.5, kl_estimator="k1"), group_size=4,
                           reference_dir=tiny_model_dir)
    for ours, initial in zip(resumed.backend.reference.parameters(), trainer(tiny_model_dir).backend.model.parameters()):
        torch.testing.assert_close(ours, initial, atol=0, rtol=0)


@pytest.mark.gpu
def test_on_cuda_a_bfloat16_step_keeps_float32_master_weights_and_reports_its_mismatch(tiny_model_dir):
    """Where bf16 is meant to run (a GPU): the same properties as on the CPU, with the device's kernels."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    data = with_exact_behaviour(tiny_model_dir, batch())
    bf16 = TorchTrainer(tiny_model_dir, trainer=TrainerSection(), loss=LossConfig(kl_coef=0.1), group_size=4,
                        dtype="bfloat16", attention="sdpa")
    metrics = bf16.train(data)
    assert bf16.backend.device.type == "cuda" and {p.dtype for p in bf16.backend.model.parameters()} == {torch.float32}
    assert 0 < metrics["mismatch_abs_max"] < 0.5 and np.isfinite(metrics["loss"]) and "kl_ref" in metrics


def test_a_diagnosed_step_samples_its_prompts_again_and_compares_the_gradients(tiny_model_dir):
    from streamrl.buffer import validate_batch

    class ParityOfTokens(ReverseDigits):  # a reward an untrained model's samples differ in
        def reward(self, prompt_id, response_ids):
            return float(sum(response_ids) % 2)

    task = ParityOfTokens(3)
    data = batch(groups=4, group_size=4)
    t = TorchTrainer(tiny_model_dir, trainer=TrainerSection(diagnose_every=2, minibatches=2),
                     loss=LossConfig(), group_size=4)
    t.diagnose_with(task, max_new_tokens=6, temperature=1.0, top_p=1.0)
    fresh = t.sample_again(data)
    validate_batch(fresh, group_size=4, trainer_version=t.version)  # a batch the queue would take
    assert fresh.column("group_id").to_pylist() == data.column("group_id").to_pylist()
    group_prompts = data.column("prompt_ids").to_pylist()[::4]  # a real group's rows share their prompt
    assert fresh.column("prompt_ids").to_pylist() == [p for p in group_prompts for _ in range(4)]
    assert {v for row in fresh.column("versions").to_pylist() for v in row} == {t.version}
    expected = [task.reward(p, r) for p, r in zip(fresh.column("prompt_id").to_pylist(),
                                                   fresh.column("response_ids").to_pylist())]
    assert fresh.column("reward").to_pylist() == pytest.approx(expected)
    diagnosed = t.train(data)  # version 0: diagnosed
    assert diagnosed["update_kl"] > 0 and -1 <= diagnosed["grad_cos_stale_fresh"] <= 1
    assert "update_kl" not in t.train(batch(seed=1))  # version 1: not


def test_update_kl_measures_the_step_not_the_samplers_top_p_truncation(tiny_model_dir):
    """`before` was the sampler's log-prob, renormalised over the top-p set: a step that hardly moves
    the weights read 0.04 at top_p = 0.7 (outside review). Both sides are now the trainer's."""
    class ParityOfTokens(ReverseDigits):
        def reward(self, prompt_id, response_ids):
            return float(sum(response_ids) % 2)

    for top_p in (1.0, 0.7):
        t = TorchTrainer(tiny_model_dir, trainer=TrainerSection(diagnose_every=1, lr=1e-12), loss=LossConfig(),
                         group_size=4)
        t.diagnose_with(ParityOfTokens(3), max_new_tokens=6, temperature=1.0, top_p=top_p)
        assert t.train(batch(groups=4, group_size=4))["update_kl"] < 1e-6


def test_a_model_with_dropout_is_trained_without_it_so_on_policy_ratios_are_one(tiny_model_dir, tmp_path):
    """The engines sample in eval mode: with the config's dropout on in training, θ differed from the
    behaviour log-prob of the very weights that sampled (0.075 at attention_dropout = 0.1), and two no-grad
    passes (proximal, reference) differed from each other."""
    import json
    import shutil

    from streamrl.buffer.padded import to_padded
    from streamrl.models.hf import load_policy

    model_dir = tmp_path / "dropout-model"
    shutil.copytree(tiny_model_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.3}))
    trainer = TorchTrainer(model_dir, trainer=TrainerSection(lr=1e-3), loss=LossConfig(name="decoupled_ppo"),
                           group_size=4)
    sampler, _ = load_policy(model_dir)  # as a producer holds it: eval mode
    padded = to_padded(batch(seed=0), 0)
    with torch.no_grad():
        behaviour = trainer.backend.token_logprobs(padded.input_ids, padded.attention_mask, model=sampler)
        trainer.backend.model.train()  # the mode backward leaves it in
        first = trainer.backend.token_logprobs(padded.input_ids, padded.attention_mask)
        second = trainer.backend.token_logprobs(padded.input_ids, padded.attention_mask)
    torch.testing.assert_close(first, behaviour, rtol=0, atol=1e-6)
    torch.testing.assert_close(first, second, rtol=0, atol=0)
