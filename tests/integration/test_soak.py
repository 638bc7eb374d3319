"""A short soak of the queue actor under many producers: nothing lost or duplicated, memory and the
object store bounded. The figures themselves are for `streamrl bench soak`, not asserted here."""

import time

import pytest

from harness.chaos.soak import SoakConfig, growth, store_bounds

pytestmark = pytest.mark.ray


def test_ten_second_soak_loses_nothing_and_stays_bounded(ray_local):
    from harness.chaos.soak import run_soak

    started = time.time()
    report = run_soak(producers=4, duration_s=10.0, weights_mb=2.0, seed=0)
    took = time.time() - started
    acc = report["accounting"]
    summary = {k: report[k] for k in ("accounting", "memory", "object_store", "queue")}
    assert acc["ok"], summary
    assert acc["committed"] > 0 and acc["lost"] == 0 and acc["duplicated_consumed"] == 0, summary
    assert report["steps"] > 0 and report["admit_ms"]["n"] > 0 and report["commit_ms"]["n"] > 0
    assert report["memory_bounded"], summary
    assert report["object_store_bounded"], summary
    assert report["queue"]["bounded"], summary
    assert report["object_store"]["weights_stored_versions"] == 1  # producers left: only the newest stays
    assert took <= 60, took


def test_growth_ignores_warmup_and_single_spikes():
    import numpy as np

    t = np.arange(10.0)
    values = np.array([0, 50, 100, 100, 100, 300, 100, 100, 100, 100], dtype=float)  # warm-up, then flat
    grown, slope = growth(t, values, after=2.0)
    assert grown == 0.0
    leak = 100 + 10 * t
    grown, slope = growth(t, leak, after=2.0)
    assert grown == pytest.approx(50.0) and slope == pytest.approx(600.0)


def test_config_refuses_a_capacity_that_cannot_fill_a_step():
    with pytest.raises(ValueError, match="capacity_tokens"):
        SoakConfig(capacity_tokens=1000)


def test_store_bound_grows_with_producers_and_weights():
    small = store_bounds(SoakConfig(producers=2, weights_mb=1.0), steps_per_s=10.0)
    big = store_bounds(SoakConfig(producers=8, weights_mb=1.0), steps_per_s=10.0)
    assert big["weights"] - small["weights"] == 6 * 2**20
    assert small["drained"] == 2 * 2**20 + 2**20


@pytest.mark.parametrize("leak", ["weights", "batches"])
def test_the_verdict_catches_a_leak(ray_local, leak):
    from harness.chaos.soak import run_soak

    report = run_soak(producers=2, duration_s=4.0, weights_mb=1.0, seed=1, inject_leak=leak)
    assert report["accounting"]["ok"]
    assert not report["object_store_bounded"], report["object_store"]
    assert report["object_store"]["after_drain_mb"] > report["object_store"]["bound_drained_mb"]
