"""The docs: the configuration reference lists every config field with its docstring, and the site
builds with `mkdocs build --strict` (a broken link or a missing page fails it)."""

import importlib.util
import subprocess
import sys

import pytest
from checkout import ROOT

from streamrl.config import RunConfig


def config_reference():
    spec = importlib.util.spec_from_file_location("config_reference", ROOT / "docs" / "hooks" / "config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def leaf_keys(tree: dict, prefix: str = "") -> set[str]:
    keys = set()
    for key, value in tree.items():
        if isinstance(value, dict) and value and key != "extra_args":
            keys |= leaf_keys(value, f"{prefix}{key}.")
        else:
            keys.add(prefix + key)
    return keys


def test_the_reference_lists_every_field_of_the_config():
    page = config_reference().reference()
    fields = leaf_keys(RunConfig().model_dump())
    assert len(fields) > 100
    missing = sorted(f for f in fields if f"| `{f}` |" not in page)
    assert not missing, missing
    assert "Trainer steps (optimizer updates) to take" in page  # the docstring under run.steps
    assert "| `queue.max_staleness` |" in page and "| `2` |" in page.split("| `queue.max_staleness` |")[1].split("\n")[0]


def test_the_reference_replaces_the_marker_on_the_configuration_page():
    hook = config_reference()
    text = (ROOT / "docs" / "configuration.md").read_text()
    assert hook.MARKER in text
    built = hook.on_page_markdown(text, None, None, None)
    assert hook.MARKER not in built and "| `queue.max_staleness` |" in built


def test_the_docs_build_strictly(tmp_path):
    if importlib.util.find_spec("mkdocs") is None:
        pytest.fail("mkdocs is not installed: pip install -e '.[dev]'")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "configuration" / "index.html").is_file()
    assert (tmp_path / "site" / "figures" / "pipeline_sweep.png").is_file()
