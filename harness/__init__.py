"""The test and benchmark harness: fuzzers, the fault campaign, the soak, synthetic batches and the
benchmark report. Development only: it lives in the source checkout beside `tests/` and `benchmarks/`,
imports streamrl, and is not part of the installed package (streamrl imports nothing from it)."""

from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent  # the source checkout the harness lives in
