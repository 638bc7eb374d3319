"""The simulated workload, its engine, the one producer driving the real queue over it, and the
simulator as a backend of `streamrl launch`."""

import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from streamrl.buffer import QueueConfig, ReplayQueue, validate_batch
from streamrl.buffer.queue import assemble
from streamrl.buffer.schema import LENGTH, STOP
from streamrl.engine.local_weights import LocalWeights
from streamrl.engine.sim import SimEngine, sim_weights
from streamrl.rollout import RolloutProducer
from streamrl.sim.workload import SimWorkload
from streamrl.tasks.sim import SimTask
from streamrl.trainer.sim import SimLearner
from streamrl.weights.receiver import WeightReceiver
from streamrl.weights.registry import WeightRegistry

FAST = SimWorkload(producers=1, sequences_per_producer=8, group_size=4, groups_per_step=4, prompt_tokens=6,
                   median_tokens=12, p99_ratio=4, max_tokens=48, weights_mb=0.01, time_scale=0.002, vocab_size=64)


def test_lengths_have_the_configured_median_tail_and_cap():
    work = SimWorkload()
    lengths = work.sample_lengths(np.random.default_rng(0), 200_000)
    median = np.median(lengths)
    assert median == pytest.approx(256, rel=0.02)
    assert np.percentile(lengths, 99) / median == pytest.approx(8, rel=0.05)
    assert lengths.max() <= 4096 and lengths.min() >= 1
    assert lengths.mean() == pytest.approx(work.mean_length(), rel=0.01)
    flat = SimWorkload(p99_ratio=1).sample_lengths(np.random.default_rng(0), 100)
    assert set(flat) == {256}


def test_training_alone_is_calibrated_to_generation_alone():
    work = SimWorkload()
    assert work.calibrated_train_s_per_token() * work.generation_tokens_per_s() == pytest.approx(1.0)
    assert SimWorkload(train_s_per_token=0.5).calibrated_train_s_per_token() == 0.5


def test_the_models_generation_rate_is_the_engines_as_the_producer_drives_it():
    """SimEngine on a fake clock, a group added whenever G slots are free (the producer's rule): its rate
    is the model's. The model took every engine as always full, 4% above what the engine can do, which
    overstated the model's ceilings and made the calibrated trainer faster than generation."""
    work = SimWorkload()
    now = [0.0]
    engine = SimEngine(work.model_copy(update={"time_scale": 1.0}), seed=1, clock=lambda: now[0],
                       sleep=lambda seconds: now.__setitem__(0, now[0] + seconds))
    for key in range(1500):
        while engine.capacity - engine.active < work.group_size:
            engine.step()
        engine.add(key, [1] * work.prompt_tokens, work.group_size)
    measured = work.producers * engine.generated_tokens / now[0]
    assert measured == pytest.approx(work.generation_tokens_per_s(), rel=0.01)


def test_engine_stamps_each_token_with_the_version_of_its_step_and_sleeps_the_model_time():
    slept = []
    engine = SimEngine(FAST.model_copy(update={"time_scale": 1.0}), seed=1, sleep=slept.append,
                       clock=lambda: 0.0)
    engine.add(7, [1] * 6, 4)
    with pytest.raises(ValueError, match="engine full"):
        engine.add(8, [1] * 6, 5)
    done, step = [], 0
    while engine.active:
        engine.weights.version = step // 5  # what a weight switch does between steps
        done += engine.step()
        step += 1
    assert slept[0] == pytest.approx(6 * FAST.prefill_per_token_s + FAST.decode_step_s(4))
    assert sorted(s.index for s in done) == [0, 1, 2, 3] and {s.key for s in done} == {7}
    for sample in done:
        assert len(sample.tokens) == len(sample.logprobs) == len(sample.versions)
        assert list(sample.versions) == [i // 5 for i in range(len(sample.tokens))]
        assert sample.finish == (LENGTH if len(sample.tokens) == FAST.max_tokens else STOP)
    assert step == max(len(s.tokens) for s in done)


def test_the_first_step_after_an_idle_gap_takes_its_model_time():
    """The engine may run one step ahead of a late host, but not of an idle one: with the slack kept
    across idle gaps, the first step of every synchronous batch (its prefills and first decode) was free."""
    now, slept = [0.0], []
    work = FAST.model_copy(update={"time_scale": 1.0, "median_tokens": 1, "p99_ratio": 1})  # one-token answers

    def sleep(seconds):
        slept.append(seconds)
        now[0] += seconds

    engine = SimEngine(work, seed=1, sleep=sleep, clock=lambda: now[0])
    for _batch in range(2):
        engine.add(7, [1] * 6, 4)
        engine.step()
        now[0] += 100.0  # the trainer trains; the engine has nothing to do
    assert slept == pytest.approx([6 * work.prefill_per_token_s + work.decode_step_s(4)] * 2)


def make_producer(queue, registry, work=FAST, producer_id=0, max_staleness=None):
    receiver = WeightReceiver(lambda have, timeout: registry.acquire(producer_id, have, timeout), poll_s=0.05,
                              standby=sim_weights(work))
    engine = SimEngine(work, LocalWeights(sim_weights(work), receiver), seed=producer_id)
    return RolloutProducer(producer_id, queue=queue, engine=engine, task=SimTask(work), group_size=work.group_size,
                           max_staleness=max_staleness, admit_timeout=0.02)


def test_the_producer_feeds_a_trainer_within_the_budget_and_loses_nothing():
    eta = 1
    queue = ReplayQueue(QueueConfig(group_size=4, groups_per_step=4, max_staleness=eta, max_in_flight=16))
    registry = WeightRegistry()
    learner = SimLearner(FAST)
    registry.publish(0, learner.weights())
    producers = [make_producer(queue, registry, producer_id=i) for i in range(2)]
    stop = threading.Event()
    errors = []

    def run(producer):
        try:
            producer.run(stop)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(p,)) for p in producers]
    for t in threads:
        t.start()
    consumed = []
    try:
        for _ in range(12):
            got = queue.get(timeout=30)
            assert got is not None, "the producers stopped feeding the trainer"
            table = got.groups[0].payload
            validate_batch(table, group_size=4, trainer_version=got.version)
            assert max(got.staleness) <= eta
            consumed += [(g.group_id, g.prompt_id) for g in got.groups]
            learner.train(assemble(got.groups))
            queue.set_version(learner.version)
            registry.publish(learner.version, learner.weights())
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    assert not errors
    assert max(p.engine.weights.version for p in producers) >= 10  # weights really streamed mid-generation
    assert all(p.stats.weight_updates > 0 for p in producers)
    status = queue.status()
    assert status["running"] == 0  # the producers gave back what they had not finished
    ids = [g for g, _ in consumed]
    assert len(ids) == len(set(ids)) == 48
    prompts = [p for _, p in consumed] + [g.prompt_id for g in queue.queued_groups()] + queue.returned_prompts()
    assert sorted(prompts) == list(range(status["prompt_cursor"]))  # every prompt exactly once


def test_a_failed_commit_gives_the_groups_back_and_stops_the_producer():
    queue = ReplayQueue(QueueConfig(group_size=4, groups_per_step=4, max_staleness=1, max_in_flight=16))
    registry = WeightRegistry()
    registry.publish(0, SimLearner(FAST).weights())

    class Refusing:
        def __init__(self):
            self.admit, self.abandon = queue.admit, queue.abandon

        def commit(self, batch):
            raise ConnectionError("queue actor unreachable")

    producer = make_producer(Refusing(), registry)
    with pytest.raises(ConnectionError, match="unreachable"):
        producer.run(threading.Event())
    status = queue.status()
    assert status["running"] == 0 and status["committed"] == 0
    assert status["abandoned"] == status["admitted"] > 0


@pytest.mark.ray
@pytest.mark.parametrize("eta, admission", [(0, "continuous"), (1, "per_step"), (3, "continuous")])
def test_the_simulator_runs_through_streamrl_launch_within_its_budget(ray_local, tmp_path, eta, admission):
    """`producers.engine = trainer.backend = task.kind = "sim"`: the same driver, actors, queue and stop
    path as a user's run, with the model's arithmetic replaced by the timing model."""
    from harness.chaos.audit import audit_run
    from streamrl.runtime.launch import launch, prepare

    sets = ["producers.engine=sim", "trainer.backend=sim", "task.kind=sim", "producers.count=2",
            "producers.num_cpus=0.25", "trainer.num_cpus=0.5", "queue.group_size=4", "queue.groups_per_step=4",
            "queue.max_in_flight=16", f"queue.max_staleness={eta}", f"queue.admission={admission}", "run.steps=8",
            "run.eval_every=0", "run.checkpoint_every=4", "run.time_limit_s=null", "logging.progress=none",
            f"run.output_dir={str(tmp_path)!r}", "run.name=sim", "sim.sequences_per_producer=8",
            "sim.prompt_tokens=8", "sim.median_tokens=16", "sim.p99_ratio=4", "sim.max_tokens=64",
            "sim.weights_mb=0.05", "sim.time_scale=0.02", "sim.vocab_size=64"]
    config, run_dir, _ = prepare(None, sets)
    summary = launch(config, run_dir)
    metrics = run_dir.read("metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 9)) and summary["staleness_max"] <= eta
    assert all(m["response_tokens"] > 0 and m["train_s"] > 0 for m in metrics)
    assert len(summary["producers"]) == 2 and all(p["groups"] > 0 and p["engine_s"] > 0 for p in summary["producers"])
    assert summary["eval_accuracy_last"] is None  # nothing is learned, nothing evaluated
    assert (run_dir.latest_checkpoint() / "trainer" / "trainer.json").is_file()
    assert not (run_dir.path / "model").exists()  # the simulator builds no model
    # and it resumes from its checkpoint like any run: same versions, nothing lost or trained twice
    config, opened, checkpoint = prepare(None, ["run.steps=12", "logging.progress=none"], resume=str(run_dir.path))
    assert launch(config, opened, checkpoint)["steps"] == 12
    audit = audit_run(run_dir.path)
    assert audit["steps"] == 12 and audit["steps_in_order"], audit
    assert audit["groups_lost"] == 0 and audit["groups_duplicated"] == 0, audit


def test_groups_that_can_no_longer_be_trained_in_budget_are_stopped_and_given_back():
    # ~14 s per response: nothing can finish on a loaded machine before the test moves the version on
    long = FAST.model_copy(update={"median_tokens": 4000, "p99_ratio": 1.0, "max_tokens": 4000, "time_scale": 0.2})
    queue = ReplayQueue(QueueConfig(group_size=4, groups_per_step=4, max_staleness=1, max_in_flight=16))
    registry = WeightRegistry()
    learner = SimLearner(long)
    registry.publish(0, learner.weights())
    producer = make_producer(queue, registry, work=long, max_staleness=1)
    stop = threading.Event()
    thread = threading.Thread(target=producer.run, args=(stop,))
    thread.start()
    try:
        deadline = time.monotonic() + 10
        # admitted is not enough: a group that joins the engine after version 2 arrives is fresh
        while producer.engine.active < producer.engine.capacity and time.monotonic() < deadline:
            time.sleep(0.01)
        first = [t.ticket_id for t in queue.running_tickets()]
        queue.set_version(2)  # the trainer moved two versions on while these groups were generating
        registry.publish(2, learner.weights())
        while producer.stats.aborted_groups < len(first) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        stop.set()
        thread.join(timeout=30)
    assert producer.stats.aborted_groups == len(first) == 2  # version 0 groups, 2 > η versions old
    assert all(queue.ticket_state(t) == "abandoned" for t in first)
    assert queue.status()["committed"] == 0  # nothing was finished only to be thrown away
    assert sorted(queue.returned_prompts()) == list(range(queue.status()["prompt_cursor"]))


def test_the_models_own_schedule_rates_bound_what_a_run_can_reach():
    rates = SimWorkload().schedule_rates(batches=100)
    assert rates["async"] == pytest.approx(SimWorkload().generation_tokens_per_s())
    assert rates["sync"] < rates["one_step"] < rates["async"]
    flat = SimWorkload(p99_ratio=1.0).schedule_rates(batches=20)  # no tail: sync loses only the overlap
    assert flat["async"] / flat["sync"] == pytest.approx(2.0, rel=0.1)
    assert SimWorkload(p99_ratio=16).schedule_rates(batches=100)["sync"] < rates["sync"]


SIMULATED_PROCESSES = """
import sys
import pyarrow
from streamrl.config import load_config
import streamrl.runtime.actors  # what Ray imports in every producer and trainer process
from streamrl.runtime.build import make_engine, make_learner
from streamrl.tasks import make_task

cfg = load_config("launch/sim.toml", ["sim.weights_mb=1.0", "sim.time_scale=0.001"])
learner = make_learner("sim", cfg, cfg.model_dump(), "", None, None, reference_dir="")
engine, task = make_engine(cfg, run_name="sim", producer_id=0, model_dir="", seed=0, weights=None)
trainer_task = make_task(cfg.task, learner.tokenizer, seed=0, sim=cfg.sim_workload())
for step in range(2):  # as a producer does: weights first, then generation, then the trainer's next version
    assert engine.weights.offer(learner.version, learner.weights(), lambda version: None)
    engine.weights.refresh()
    assert engine.weights.version == learner.version
    assert engine.weights.model.arrays["weight"][0] == learner.version
    engine.add(step, task.prompt(step), 2)
    while engine.active:
        finished = engine.step()
    assert (finished[-1].versions == learner.version).all()
    learner.train(pyarrow.table({"prompt_ids": [[1, 2]], "response_ids": [finished[-1].tokens.tolist()]}))
imported = sorted({"torch", "transformers", "safetensors"} & set(sys.modules))
assert not imported, f"the simulated processes imported {imported}"
"""


def test_the_simulated_engine_and_trainer_run_without_importing_torch():
    """Seven processes import torch at once on start-up otherwise: ~14 s of each `streamrl launch` of the
    simulator on two cores, five times in `streamrl bench pipeline --engine sim`."""
    done = subprocess.run([sys.executable, "-c", SIMULATED_PROCESSES], cwd=Path(__file__).resolve().parents[2],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
