"""sglang weights by disk (`producers.sglang.weights = "disk"`): each version written once as a Hugging
Face directory (safetensors beside the base model's config and tokenizer), then loaded by every server
with `/update_weights_from_disk`. The newest `keep` versions stay on disk.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from streamrl.sglang.client import SglangClient

Loader = Callable[[SglangClient], None]  # as `weights.server_paths.Loader` (which imports this module)

MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json")


class DiskWeights:
    """Published weights as a Hugging Face directory an sglang server can load: the arrays as
    safetensors next to the base model's config and tokenizer. Keeps the newest `keep` versions."""

    def __init__(self, base_model: str | Path, root: str | Path, keep: int = 2):
        self.base, self.root, self.keep = Path(base_model), Path(root), keep
        self.root.mkdir(parents=True, exist_ok=True)
        for torn in [*self.root.glob("v*.partial"), *self.root.glob("v*.replaced")]:  # a killed writer's
            shutil.rmtree(torn)

    def write(self, version: int, arrays: dict[str, np.ndarray]) -> Path:
        """Write `version`, replacing one already there: the producer this one replaces (it keeps the
        producer id, so the directory) or the run before a resume wrote it, and after a resume that
        rewound, with other weights."""
        target = self.root / f"v{version:08d}"
        partial = target.with_suffix(".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        for name in MODEL_FILES:
            if (self.base / name).is_file():
                shutil.copy2(self.base / name, partial / name)
        save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, str(partial / "model.safetensors"))
        replaced = target.with_suffix(".replaced")
        if target.exists():  # a directory is renamed onto only an empty one
            target.rename(replaced)
        partial.rename(target)  # a server never sees a half-written version
        if replaced.exists():
            shutil.rmtree(replaced)
        for old in sorted(self.root.glob("v" + "[0-9]" * 8))[:-self.keep]:
            shutil.rmtree(old)
        return target

    def loader(self, version: int, arrays: dict[str, np.ndarray]) -> Loader:
        """Write the version once; each server then loads it from the directory."""
        return disk_loader(str(self.write(version, arrays)))


def disk_loader(path: str) -> Loader:
    """Loads a written version into a server (kept by the engine, to reload after a restart)."""
    return lambda client: client.update_weights_from_disk(path)
