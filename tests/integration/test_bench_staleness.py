"""`streamrl bench staleness`: aggregation over seeds, the expectations as measured, and one tiny real run."""

import importlib.util
import json
import subprocess
import sys

import pytest
from checkout import BENCHMARKS, ROOT

SCRIPT = BENCHMARKS / "staleness.py"


def load_script():
    spec = importlib.util.spec_from_file_location("staleness_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_run(eta, correction, seed, final):
    measured = 3 if eta == "auto" else eta  # an auto run's staleness, as measured
    return {"eta": eta, "correction": correction, "seed": seed, "final_reward": final, "mean_reward": final / 2,
            "eval_accuracy": 0.5,
            "staleness_mean": measured * 0.8, "staleness_max": measured, "wall_s": 10.0, "ess_mean": 0.9,
            "kl_behavior_proximal_mean": 0.001 * measured,
            "clipped_fraction_mean": 0.0, "truncated_fraction_mean": 0.01, "masked_fraction_mean": 0.0,
            "curve": {"step": [1, 2], "reward": [0.1, final], "elapsed_s": [1.0, 2.0]}}


def test_results_are_keyed_by_eta_then_correction_with_the_spread_over_seeds():
    bench = load_script()
    runs = [fake_run(0, "decoupled_ppo", s, f) for s, f in enumerate([0.6, 0.8])]
    runs += [fake_run(0, "naive", s, f) for s, f in enumerate([0.7, 0.7])]
    runs += [fake_run(4, "decoupled_ppo", s, f) for s, f in enumerate([0.62, 0.64])]
    runs += [fake_run(8, "naive", s, f) for s, f in enumerate([0.3, 0.32])]
    results = bench.aggregate(runs)
    cell = results["0"]["decoupled_ppo"]
    assert cell["final_reward_mean"] == pytest.approx(0.7)
    assert cell["final_reward_std"] == pytest.approx(0.1 * 2 ** 0.5)  # sample std (ddof 1)
    assert cell["final_reward_sem"] == pytest.approx(0.1)
    assert cell["seeds"] == [0, 1] and results["8"]["naive"]["staleness_mean"] == pytest.approx(6.4)
    checks = bench.expectations(results)
    corrected = checks["decoupled_ppo_eta4_vs_eta0"]
    assert corrected["ratio"] == pytest.approx(0.63 / 0.7) and corrected["gap"] == pytest.approx(-0.07)
    assert corrected["gap_se"] == pytest.approx((0.1 ** 2 + 0.01 ** 2) ** 0.5)
    assert corrected["held"] is False  # 10% short of on-policy
    naive = checks["naive_eta8_vs_eta0"]
    assert naive["gap"] == pytest.approx(0.39) and naive["held"] is True  # 0.39 against an SE of 0.01


def test_a_gap_within_the_noise_is_not_called_measurable():
    bench = load_script()
    runs = [fake_run(0, "naive", s, f) for s, f in enumerate([0.3, 0.9])]
    runs += [fake_run(8, "naive", s, f) for s, f in enumerate([0.2, 0.8])]
    assert bench.expectations(bench.aggregate(runs))["naive_eta8_vs_eta0"]["held"] is False


def test_final_reward_is_the_mean_of_the_last_tenth_of_steps():
    bench = load_script()
    assert bench.final_mean(list(range(100))) == pytest.approx(94.5)  # the last 10 steps
    assert bench.final_mean([1.0] * 5 + [3.0] * 5) == pytest.approx(2.0)  # short runs: the last 10


def timed(eta, correction, seed, final, reach_s):
    """A fake run whose 10-step mean reward reaches 0.5 at `reach_s` seconds (never: None)."""
    run = fake_run(eta, correction, seed, final)
    times = [float(t) for t in range(1, 41)]
    rewards = [0.0] * 40 if reach_s is None else [1.0 if t >= reach_s else 0.0 for t in times]
    run["curve"] = {"step": list(range(1, 41)), "reward": rewards, "elapsed_s": times}
    run["wall_s"] = 40.0
    return run


def test_time_to_target_is_when_the_10_step_mean_first_reaches_it():
    bench = load_script()
    assert bench.time_to({"reward": [0.0] * 5 + [1.0] * 10, "elapsed_s": list(range(15))}, 0.5) == 9.0
    assert bench.time_to({"reward": [0.2] * 20, "elapsed_s": list(range(20))}, 0.5) is None


def test_the_headline_reports_the_best_correction_and_auto_against_the_synchronous_run():
    bench = load_script()
    runs = [timed(0, c, s, 0.625, 30) for c in ("decoupled_ppo", "m2po") for s in (0, 1)]
    runs += [timed(4, "decoupled_ppo", s, 0.5, 20) for s in (0, 1)] + [timed(4, "m2po", s, 0.6, 20) for s in (0, 1)]
    runs += [timed("auto", "m2po", 0, 0.625, 10), timed("auto", "m2po", 1, 0.625, None)]
    results = bench.aggregate(runs)  # target: 0.8 × 0.625 = 0.5
    assert results["0"]["m2po"]["target_reward"] == pytest.approx(0.5)
    # the 10-step mean reaches 0.5 five steps after the reward does (at 14 s, 34 s); never: the whole run's 40 s
    assert results["auto"]["m2po"]["time_to_target_s_mean"] == pytest.approx((14 + 40) / 2)
    assert results["auto"]["m2po"]["reached_target"] == 1
    figures = bench.headline(results)
    assert figures["best_eta4_correction"] == "m2po" and figures["best_eta4_over_eta0"] == pytest.approx(0.96)
    assert figures["auto_correction"] == "m2po" and figures["auto_final_over_eta0"] == pytest.approx(1.0)
    assert figures["auto_time_to_target_over_sync"] == pytest.approx(27 / 34)
    checked = {t.key: t.check({"headline": figures}) for t in bench.headline_targets(figures)}
    assert checked["headline.best_eta4_over_eta0"]["met"]
    assert not checked["headline.auto_time_to_target_over_sync"]["met"]


@pytest.mark.ray
def test_a_tiny_sweep_writes_every_pair_it_ran(tmp_path):
    out = tmp_path / "staleness.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.staleness", "--etas", "1", "auto", "--corrections", "naive",
                           "m2po", "--seeds", "0", "--steps", "6", "--producers", "2", "--diagnose", "2",
                           "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    for eta in ("1", "auto"):
        for correction in ("naive", "m2po"):
            cell = report["results"][eta][correction]
            assert {"final_reward_mean", "final_reward_std", "staleness_mean", "kl_behavior_proximal_mean",
                    "time_to_target_s_mean"} <= set(cell)
            assert cell["runs"][0]["steps"] == 6
            # the diagnosis: every step's data figures; the diagnosed steps' fresh samples and the step's move
            assert cell["zero_signal_fraction_mean"] is not None and cell["update_kl_mean"] > 0
            assert 0 <= cell["regenerated_fraction"] <= 1
    assert report["results"]["1"]["naive"]["staleness_max"] <= 1
    assert {"per_correction"} <= set(report["results"]["headline"])  # no η = 0 run here: no ratios to report
    assert report["targets"] == {} and report["vs_baseline"]["ratios"] == {}
    assert out.with_suffix(".png").is_file()
