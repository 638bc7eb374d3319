"""Which megatron-core streamrl runs on, checked before anything is built.

streamrl's CPU parity tests (conversion, logits, gradients, a whole step at TP/DP/PP against the torch
trainer) have passed on megatron-core 0.16.x only: the newest release that installs on Python 3.11.
0.17 and later need Python 3.12 and differ where streamrl touches them (0.18 imports `triton`
unguarded from `megatron.core.models.gpt` without declaring it; 0.19 deprecates `GPTModel`), and no
run has tried them. `pyproject.toml` pins the same range; this check also catches an install made by
hand around the pin, with a message instead of an error from deep inside the library.
"""

from __future__ import annotations

from importlib import metadata

from packaging.version import Version

TESTED = (Version("0.16"), Version("0.17"))  # [lowest, first untested): keep equal to pyproject.toml's pin
DISTRIBUTION = "megatron-core"


def installed_version() -> Version | None:
    try:
        return Version(metadata.version(DISTRIBUTION))
    except metadata.PackageNotFoundError:
        return None


def check_megatron_core(version: Version | None = None) -> Version:
    """The installed megatron-core's version, or a RuntimeError that says what is installed and what
    streamrl has been tested on."""
    version = installed_version() if version is None else version
    lowest, untested = TESTED
    wanted = f"{DISTRIBUTION}>={lowest},<{untested}"
    if version is None:
        raise RuntimeError(f"trainer.backend = 'megatron' needs {DISTRIBUTION}, which is not installed: "
                           f"pip install '{wanted}'")
    if not lowest <= version < untested:
        raise RuntimeError(f"{DISTRIBUTION} {version} is installed, but streamrl's megatron backend has been tested "
                           f"on {wanted} only (newer releases change APIs it uses and have not run here): "
                           f"pip install '{wanted}', or use trainer.backend = 'torch'")
    return version
