"""mkdocs hook: the benchmarks' figures (benchmarks/results/*.png) served as docs/figures/*.png.

The benchmarks write each figure beside their JSON report; the docs show those files themselves
rather than a copy that would go stale when a benchmark is run again.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def on_files(files, config):  # mkdocs' hook signature
    for figure in sorted(RESULTS.glob("*.png")):
        files.append(File.generated(config, f"figures/{figure.name}", abs_src_path=str(figure)))
    return files
