import numpy as np
import pyarrow as pa
import pytest
import torch

from streamrl.buffer import QueueConfig, ReplayQueue
from streamrl.buffer.synthetic import synthetic_batch
from streamrl.config import TrainerSection
from streamrl.correction import LossConfig
from streamrl.tasks.reverse import ReverseDigits
from streamrl.trainer.torch_trainer import TorchTrainer, micro_batches


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
    for a, b in zip(whole.model.parameters(), split.model.parameters()):
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
            lp = t._token_logprobs(padded.input_ids, padded.attention_mask)
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
    for a, b in zip(t.model.parameters(), restored.model.parameters()):
        torch.testing.assert_close(a, b)


def test_a_non_finite_gradient_skips_the_step_and_says_so(tiny_model_dir):
    t = trainer(tiny_model_dir)
    before = [p.detach().clone() for p in t.model.parameters()]
    with torch.no_grad():
        t.model.get_input_embeddings().weight[3, 0] = float("nan")
        before[0][3, 0] = float("nan")
    with pytest.raises(FloatingPointError, match="non-finite gradient norm at version 0"):
        t.train(batch(groups=4))
    assert t.version == 0


def test_evaluate_reports_accuracy_and_reward_on_held_out_prompts(tiny_model_dir):
    task = ReverseDigits(2)
    result = trainer(tiny_model_dir).evaluate(task, limit=20, max_new_tokens=4)
    assert result["eval_prompts"] == len(task.eval_numbers()) < 20  # about a tenth of the 100 strings
    assert 0.0 <= result["eval_accuracy"] <= result["eval_reward"] + 1e-9 <= 1.0 + 1e-9
