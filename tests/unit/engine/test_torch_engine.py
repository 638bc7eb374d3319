"""The torch engine: continuous batching with exact behaviour log-probs, rows joining and leaving at any
decode step, the prefix prefilled once per group, and weights switched between steps."""

import inspect

import numpy as np
import pytest
import torch

from streamrl.buffer.schema import LENGTH, STOP
from streamrl.engine import torch_engine
from streamrl.engine.base import generate
from streamrl.engine.local_weights import LocalWeights
from streamrl.engine.torch_engine import TorchEngine, cache_keyword, counter_uniforms, draw, nucleus_logprobs
from streamrl.models.hf import load_policy
from streamrl.tasks.reverse import EOS

NO_STOP = [99]  # a stop id outside the vocabulary: every row runs to max_new_tokens


def engine_for(model, version=0, **kwargs):
    settings = dict(pad_id=0, stop_ids=[EOS], max_new_tokens=6, seed=3) | kwargs
    return TorchEngine(LocalWeights(model, version=version), **settings)


def teacher_forced_logprobs(model, prompt, response, temperature=1.0):
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1].float() / temperature
    lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    return lp[len(prompt) - 1:].numpy()


def run_until_done(engine):
    done = {}
    while engine.active:
        for sample in engine.step():
            done[(sample.key, sample.index)] = sample
    return done


def test_behaviour_logprobs_match_a_full_forward_with_left_padding_and_shared_prefill(tiny_model_dir):
    model, _ = load_policy(tiny_model_dir)
    prompts = [[1, 4, 5, 6, 15], [1, 7, 15], [1, 9, 9, 15]]  # different lengths: left padding
    gen = generate(engine_for(model, version=5, temperature=0.7), prompts, samples_per_prompt=4)
    assert len(gen.offsets) == 13 and (gen.versions == 5).all()
    for row in range(12):
        expected = teacher_forced_logprobs(model, prompts[row // 4], gen.response(row), temperature=0.7)
        np.testing.assert_allclose(gen.logprobs[gen.offsets[row]:gen.offsets[row + 1]], expected, atol=1e-5)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_a_bfloat16_sampler_stamps_float32_logprobs_of_its_own_bfloat16_distribution(tiny_model_dir, attention):
    """model.dtype = bfloat16: the weights and the arithmetic are bf16, the log-probs float32 and exactly
    those of the bf16 model (a cached decode and a full forward in bf16 differ by bf16's rounding only),
    off from the float32 model's by more: the gap the trainer's mismatch metric reports."""
    model, _ = load_policy(tiny_model_dir, dtype="bfloat16", attention=attention)
    full, _ = load_policy(tiny_model_dir)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    prompts = [[1, 4, 5, 6, 15], [1, 7, 15]]
    gen = generate(engine_for(model), prompts, samples_per_prompt=3)
    assert gen.logprobs.dtype == np.float32
    gaps = []
    for row in range(6):
        mine = gen.logprobs[gen.offsets[row]:gen.offsets[row + 1]]
        np.testing.assert_allclose(mine, teacher_forced_logprobs(model, prompts[row // 3], gen.response(row)),
                                   atol=1e-3)
        gaps.append(np.abs(mine - teacher_forced_logprobs(full, prompts[row // 3], gen.response(row))).max())
    assert max(gaps) > 1e-4


def test_a_group_that_joins_mid_batch_gets_what_it_would_get_alone(tiny_model_dir):
    """Rows join at decode-step boundaries of a busy batch (other rows mid-way, of other lengths) and
    others leave around them: the same tokens and log-probs as the same group sampled alone."""
    model, _ = load_policy(tiny_model_dir)
    busy = engine_for(model, stop_ids=NO_STOP, max_new_tokens=8)
    busy.add(10, [1, 4, 5, 6, 7, 8, 15], 4)  # a long prompt: the late group is left-padded to its width
    busy.step(), busy.step(), busy.step()
    busy.add(20, [1, 9, 15], 3)
    busy.step()
    busy.add(30, [1, 2, 3, 4, 5, 6, 7, 8, 9, 15], 2)  # longer than the running width: the batch is padded
    together = run_until_done(busy)
    for key, prompt, n in ((20, [1, 9, 15], 3), (30, [1, 2, 3, 4, 5, 6, 7, 8, 9, 15], 2)):
        lone = engine_for(model, stop_ids=NO_STOP, max_new_tokens=8)
        lone.add(key, prompt, n)
        alone = run_until_done(lone)
        for index in range(n):
            mine, ref = together[(key, index)], alone[(key, index)]
            np.testing.assert_array_equal(mine.tokens, ref.tokens)
            np.testing.assert_allclose(mine.logprobs, ref.logprobs, atol=1e-5)
            np.testing.assert_allclose(mine.logprobs, teacher_forced_logprobs(model, prompt, mine.tokens), atol=1e-5)
    assert len({tuple(together[(20, i)].tokens) for i in range(3)}) > 1  # the samples of a group differ


def test_stop_tokens_end_rows_and_finish_reasons_are_recorded(tiny_model_dir):
    model, _ = load_policy(tiny_model_dir)
    gen = generate(engine_for(model, max_new_tokens=8, seed=0), [[1, 4, 15]] * 64)
    for row in range(64):
        response = gen.response(row)
        if gen.finish[row] == STOP:
            assert response[-1] == EOS and EOS not in response[:-1]
        else:
            assert gen.finish[row] == LENGTH and len(response) == 8 and EOS not in response
    assert {STOP, LENGTH} <= set(gen.finish.tolist())  # an untrained model does both


def test_greedy_is_deterministic_and_independent_of_batching(tiny_model_dir):
    model, _ = load_policy(tiny_model_dir)
    together = generate(engine_for(model, greedy=True, max_new_tokens=5), [[1, 4, 5, 15], [1, 8, 15]])
    alone = generate(engine_for(model, greedy=True, max_new_tokens=5), [[1, 8, 15]])
    np.testing.assert_array_equal(together.response(1), alone.response(0))


def test_top_p_keeps_the_smallest_nucleus_and_renormalises():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    lp = nucleus_logprobs(logits, 1.0, 0.7)
    assert torch.isinf(lp[0, 2:]).all() and lp[0, 2:].lt(0).all()
    torch.testing.assert_close(lp[0, :2].exp(), torch.tensor([0.5, 0.3]) / 0.8)
    torch.testing.assert_close(nucleus_logprobs(logits, 1.0, 0.01)[0, 0], torch.tensor(0.0))  # never empty
    torch.testing.assert_close(nucleus_logprobs(logits, 1.0, 1.0), torch.log_softmax(logits, -1))


def test_draws_follow_the_distribution_and_never_pick_an_excluded_token():
    lp = nucleus_logprobs(torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])), 1.0, 0.7).expand(20_000, 4)
    u = counter_uniforms(7, np.zeros(20_000, np.int64), np.arange(20_000), np.zeros(20_000, np.int64))
    counts = np.bincount(draw(lp, torch.from_numpy(u)).numpy(), minlength=4)
    assert counts[2] == counts[3] == 0
    np.testing.assert_allclose(counts[:2] / 20_000, [0.625, 0.375], atol=0.015)
    edges = draw(torch.log(torch.tensor([[0.0, 1.0, 0.0]])).expand(3, 3), torch.tensor([0.0, 0.5, 1 - 2**-53]))
    assert edges.tolist() == [1, 1, 1]


def test_counter_uniforms_are_splitmix64_of_the_sequence_and_position():
    def splitmix(x):  # the reference, in Python integers
        mask = (1 << 64) - 1
        x = (x + 0x9E3779B97F4A7C15) & mask
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
        return x ^ (x >> 31)

    key, index, position, seed = 123456789012, 5, 17, 3
    expected = splitmix(splitmix(splitmix(splitmix(seed) ^ key) ^ index) ^ position) >> 11
    got = counter_uniforms(seed, np.array([key]), np.array([index]), np.array([position]))
    assert got[0] == expected * 2.0**-53 and 0 <= got[0] < 1


def test_weights_switched_between_steps_are_stamped_on_the_tokens_they_computed(tiny_model_dir):
    model, _ = load_policy(tiny_model_dir)
    other, _ = load_policy(tiny_model_dir)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    engine = engine_for(model, stop_ids=NO_STOP, max_new_tokens=5, seed=1)
    engine.add(0, [1, 4, 5, 15], 1)
    engine.step(), engine.step()  # two tokens; the third's logits were computed by version 0 as well
    engine.weights.model, engine.weights.version = other, 1  # what `refresh` does at a step boundary
    (sample,) = run_until_done(engine).values()
    assert sample.versions.tolist() == [0, 0, 0, 1, 1]
    before = teacher_forced_logprobs(model, [1, 4, 5, 15], sample.tokens)
    np.testing.assert_allclose(sample.logprobs[:3], before[:3], atol=1e-5)
    assert np.abs(sample.logprobs[3:] - before[3:]).min() > 1e-3  # other weights


def test_rows_leave_on_cancel_and_abort_and_the_cache_follows_the_longest_live_row(tiny_model_dir):
    model, _ = load_policy(tiny_model_dir)
    engine = engine_for(model, stop_ids=NO_STOP, max_new_tokens=30, capacity=6)
    engine.add(1, [1, 2, 3, 4, 5, 6, 7, 8, 9, 15], 2)
    engine.add(2, [1, 4, 15], 2)
    with pytest.raises(ValueError, match="engine full"):
        engine.add(3, [1, 5, 15], 3)
    with pytest.raises(ValueError, match="already running"):
        engine.add(2, [1, 5, 15], 1)
    for _ in range(5):
        engine.step()
    engine.cancel(1)  # the long prompt leaves: its padding columns go with it
    assert engine.active == 2 and engine._mask.shape[1] == 3 + 5
    engine.add(3, [1, 5, 15], 3)
    engine.step()
    assert engine.active == 5
    engine.abort()
    assert engine.active == 0
    with pytest.raises(RuntimeError, match="no active sequence"):
        engine.step()


def test_active_never_undercounts_a_group_joining_while_it_is_read(tiny_model_dir):
    """The admit thread reads `active` while the decode loop joins groups. With the join landing between
    its two reads, a group counted in neither: the producer asked for slots the engine lacked and its
    next `add` raised "engine full", stopping it (outside review, replayed with a tracer)."""
    model, _ = load_policy(tiny_model_dir)
    engine = engine_for(model, capacity=8)
    engine.add(1, [1, 4, 5], 4)
    engine.step()
    engine.add(2, [1, 7], 4)

    class JoinWhileCounted(list):  # the decode loop's join runs the moment the reader takes the rows' length
        def __len__(self):
            if engine._joins:
                engine._join()
            return super().__len__()

    engine._rows = JoinWhileCounted(engine._rows)
    assert engine.active >= 8


def test_bad_arguments_are_refused(tiny_model_dir):
    model, _ = load_policy(tiny_model_dir)
    with pytest.raises(ValueError, match="stop token"):
        engine_for(model, stop_ids=[])
    engine = engine_for(model)
    with pytest.raises(ValueError, match="at least one token"):
        engine.add(0, [], 1)
    with pytest.raises(ValueError, match="n must be >= 1"):
        engine.add(0, [1, 2], 0)


@pytest.mark.parametrize("greedy", [False, True])
def test_weights_that_compute_nan_logits_stop_the_engine_naming_the_version(tiny_model_dir, greedy):
    """A draw from NaN logits picked the index one past the vocabulary (a gather error; on a GPU, a
    device-side assert)."""
    model, _ = load_policy(tiny_model_dir)
    with torch.no_grad():
        model.lm_head.weight[3, 0] = float("nan")
    engine = engine_for(model, version=7, greedy=greedy)
    engine.add(0, [1, 2, 3], 2)
    with pytest.raises(FloatingPointError, match=r"weights version 7 computed non-finite logits for sequence 0/0 "
                                                 r"at token 0: the policy diverged"):
        run_until_done(engine)
    assert draw(torch.full((1, 4), float("nan")), torch.tensor([0.5])).tolist() == [3]


def test_a_sliding_window_model_is_refused_when_the_engine_is_made(tiny_model_dir):
    """Not when a second group first joins the running batch (a producer failing mid-run)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config.from_pretrained(tiny_model_dir, use_sliding_window=True, sliding_window=4,
                                         layer_types=["sliding_attention"] * 2)
    with pytest.raises(ValueError, match=r"plain KV cache; this model's has \['DynamicSlidingWindowLayer'\]"):
        engine_for(AutoModelForCausalLM.from_config(config))


def _with_forward(model, keyword):
    """`model`'s forward replaced by one that declares its cache as `keyword` (as a transformers release does),
    passes it on to the real forward under the name that one declares, and records per call whether the
    cache came under `keyword` (and not the other name)."""
    forward = model.forward
    real = "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"
    given = []

    def forward_taking_cache(*args, cache=None, **kwargs):
        given.append(cache is not None and "past_key_values" not in kwargs)
        return forward(*args, **{real: cache}, **kwargs)

    def forward_taking_past_key_values(*args, past_key_values=None, **kwargs):
        given.append(past_key_values is not None and "cache" not in kwargs)
        return forward(*args, **{real: past_key_values}, **kwargs)

    model.forward = forward_taking_cache if keyword == "cache" else forward_taking_past_key_values
    return given


@pytest.mark.parametrize("keyword", ["cache", "past_key_values"])
def test_the_cache_goes_under_the_name_the_forward_declares(tiny_model_dir, keyword):
    """transformers >= 5.24 declares `cache`, 5.0-5.23 `past_key_values`; each takes the other into **kwargs
    unused. Whichever the forward declares gets the cache, and the samples are those of the real model."""
    model, _ = load_policy(tiny_model_dir)
    prompts = [[1, 4, 5, 6, 15], [1, 7, 15]]
    expected = generate(engine_for(model, stop_ids=NO_STOP), prompts, samples_per_prompt=2)
    given = _with_forward(model, keyword)
    got = generate(engine_for(model, stop_ids=NO_STOP), prompts, samples_per_prompt=2)
    assert given == [True] * (1 + 5)  # one prefill, five decode steps
    np.testing.assert_array_equal(got.tokens, expected.tokens)
    np.testing.assert_allclose(got.logprobs, expected.logprobs, atol=1e-6)


def test_the_keyword_is_looked_up_once_per_model(tiny_model_dir, monkeypatch):
    """Not per step; again when `refresh` swaps in another model (the double-buffered receiver does)."""
    model, _ = load_policy(tiny_model_dir)
    other, _ = load_policy(tiny_model_dir)
    _with_forward(other, "past_key_values")
    looked_up = []
    monkeypatch.setattr(torch_engine, "cache_keyword", lambda m: looked_up.append(m) or cache_keyword(m))
    engine = engine_for(model, stop_ids=NO_STOP, max_new_tokens=4)
    engine.add(0, [1, 4, 5, 15], 2)
    engine.step(), engine.step()
    engine.weights.model, engine.weights.version = other, 1  # what `refresh` does at a step boundary
    run_until_done(engine)
    assert looked_up == [model, other]


def test_a_model_that_ignores_the_cache_kwarg_fails_loudly_at_prefill(tiny_model_dir, monkeypatch):
    """A forward that declares neither `cache` nor `past_key_values` and drops the cache from its **kwargs
    (a custom wrapper): the cache stays empty and every decode step would run without context. The first
    prefill refuses that."""
    model, _ = load_policy(tiny_model_dir)
    forward = model.forward

    def forward_of_a_custom_model(*args, **kwargs):
        kwargs.pop("cache", None), kwargs.pop("past_key_values", None)
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", forward_of_a_custom_model)
    engine = engine_for(model)
    engine.add(0, [1, 4, 5, 15], 2)
    with pytest.raises(RuntimeError, match=r"the KV cache passed as `past_key_values=` \(0 of 4 prompt positions; "
                                           r"transformers 5\.\d+.*must take it under one of these names"):
        engine.step()
