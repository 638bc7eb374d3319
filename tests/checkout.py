"""Where things are in the source checkout the tests run from (test modules sit at different depths)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
LAUNCH = ROOT / "launch"
EXAMPLES = ROOT / "examples"
FAKE_SGLANG = ROOT / "tests" / "fake_sglang.py"
