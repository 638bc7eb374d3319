"""The shared benchmark report: targets with the size of a miss, ratios against a stored baseline."""

import json

import pytest

from harness.benchreport import Target, compare, finish


def test_targets_say_whether_they_were_met_and_by_how_much():
    results = {"speedup": 2.0, "nested": {"stall_s": 0.001}}
    missed = Target("speedup", ">=", 2.5).check(results)
    assert missed["met"] is False and missed["off_by"] == pytest.approx(0.8)
    assert Target("nested.stall_s", "<=", 0.002).check(results)["met"] is True
    with pytest.raises(ValueError, match="unknown comparison"):
        Target("speedup", "==", 2).check(results)


def test_baseline_ratios_skip_metrics_the_baseline_lacks(tmp_path):
    baseline = {"results": {"a": {"tokens_per_s": 100.0}, "old_only": 1.0}}
    ratios = compare({"a": {"tokens_per_s": 80.0}, "b": 3.0}, baseline, ["a.tokens_per_s", "b"])
    assert ratios == {"a.tokens_per_s": pytest.approx(0.8)}


def test_a_report_holds_results_targets_and_the_comparison(tmp_path):
    base = tmp_path / "baseline.json"
    base.write_text(json.dumps({"results": {"rate": 50.0}}))
    out = tmp_path / "out" / "report.json"
    finish("demo", out, workload={"n": 1}, results={"rate": 100.0}, targets=[Target("rate", ">=", 60)],
           headline=["rate"], baseline=base)
    report = json.loads(out.read_text())
    assert report["benchmark"] == "demo" and report["workload"] == {"n": 1}
    assert report["targets"]["rate"]["met"] is True
    assert report["vs_baseline"]["ratios"] == {"rate": 2.0}
    assert report["machine"]["cpus"] >= 1


def test_a_missed_bound_of_zero_is_reported_not_a_crash(tmp_path, capsys):
    """A bound of 0 has no factor to miss by: formatting None crashed the report writer exactly when
    chaos or soak found a lost or duplicated group, and no report was written."""
    out = tmp_path / "report.json"
    finish("demo", out, workload={}, results={"groups_lost": 3}, targets=[Target("groups_lost", "<=", 0)],
           headline=[])
    assert json.loads(out.read_text())["targets"]["groups_lost"] == {
        "target": 0, "op": "<=", "measured": 3, "met": False, "off_by": None}
    assert "MISSED (by +3.000)" in capsys.readouterr().out


def test_a_baseline_of_another_workload_is_named_beside_its_ratios(tmp_path, capsys):
    base = tmp_path / "baseline.json"
    base.write_text(json.dumps({"workload": {"producers": 16, "seed": 0}, "results": {"rate": 50.0}}))
    out = tmp_path / "report.json"
    finish("demo", out, workload={"producers": 4, "seed": 0}, results={"rate": 100.0}, targets=[],
           headline=["rate"], baseline=base)
    assert json.loads(out.read_text())["vs_baseline"] == {"file": str(base), "ratios": {"rate": 2.0},
                                                          "workload_differs": ["producers"]}
    assert "its workload differs in producers" in capsys.readouterr().out


def test_counts_and_report_paths_are_refused_before_anything_is_measured(tmp_path, capsys):
    """Outside review: a count of 0 failed at the end on an empty list, and an --out that was a directory or a
    --baseline that was not JSON lost every result measured."""
    import argparse

    from harness.benchreport import check_report_paths, positive_float, positive_int

    assert positive_int("3") == 3 and positive_float("0.5") == 0.5
    for parse, text in ((positive_int, "0"), (positive_int, "-1"), (positive_int, "x"), (positive_float, "0"),
                        (positive_float, "inf"), (positive_float, "nan")):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(text)
    parser = argparse.ArgumentParser(prog="bench")
    check_report_paths(parser, tmp_path / "new" / "deeper" / "report.json")  # made at the end: fine
    (tmp_path / "baseline.json").write_text(json.dumps({"results": {}}))
    check_report_paths(parser, tmp_path / "report.json", tmp_path / "baseline.json")
    (tmp_path / "file").write_text("")
    (tmp_path / "not-json").write_text("oops")
    for out, baseline, message in ((tmp_path, None, "is a directory"),
                                   (tmp_path / "file" / "report.json", None, "cannot hold it"),
                                   (tmp_path / "report.json", tmp_path / "missing.json", "not a benchmark report"),
                                   (tmp_path / "report.json", tmp_path / "not-json", "not a benchmark report")):
        with pytest.raises(SystemExit):
            check_report_paths(parser, out, baseline)
        assert message in capsys.readouterr().err
