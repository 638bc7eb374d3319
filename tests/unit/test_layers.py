"""The package's layering (pyproject.toml `[tool.importlinter]`): checked as it is, and shown to catch
a lower layer that imports the runtime."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from checkout import ROOT


def lint_imports(tree: Path) -> subprocess.CompletedProcess:
    linter = shutil.which("lint-imports", path=os.path.dirname(sys.executable)) or shutil.which("lint-imports")
    if linter is None:
        pytest.fail("lint-imports is not installed: pip install -e '.[dev]'")
    env = {**os.environ, "PYTHONPATH": str(tree)}  # the copy, not the installed package
    return subprocess.run([linter, "--no-cache"], cwd=tree, env=env, capture_output=True, text=True, timeout=120)


def copy_of_the_package(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "streamrl", tmp_path / "streamrl", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def test_the_import_contract_holds(tmp_path):
    result = lint_imports(copy_of_the_package(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(("module", "imported"), [
    ("buffer/queue.py", "streamrl.runtime.launch"),
    ("correction/losses.py", "streamrl.trainer.torch_trainer"),
    ("weights/registry.py", "streamrl.engine.torch_engine"),
    ("buffer/validate.py", "pytest"),
    ("runtime/launch.py", "harness"),  # the test and benchmark harness, not in the wheel
])
def test_the_import_contract_catches_an_import_against_the_layers(tmp_path, module, imported):
    tree = copy_of_the_package(tmp_path)
    with open(tree / "streamrl" / module, "a") as f:
        f.write(f"\nimport {imported}  # noqa: E402,F401\n")
    result = lint_imports(tree)
    assert result.returncode != 0, result.stdout
    importer = "streamrl." + module.removesuffix(".py").replace("/", ".")
    assert f"{importer} -> {imported}" in result.stdout, result.stdout
