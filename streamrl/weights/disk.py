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
        self._written: list[Path] = []  # by this object, oldest first: what `keep` counts
        self.root.mkdir(parents=True, exist_ok=True)
        # Everything here was written by the producer this one replaces (same id, same directory) or by the
        # run before a resume, for servers that are gone. Kept, a resumed run's versions sorted below them
        # (v100 after a crash at v120) and were pruned the moment they were written.
        for stale in self.root.glob("v*"):
            shutil.rmtree(stale)

    def write(self, version: int, arrays: dict[str, np.ndarray]) -> Path:
        """Write `version` (replacing it if written before) and remove what this object wrote before the
        newest `keep`."""
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
        self._written = [*(path for path in self._written if path != target), target]
        for old in self._written[:-self.keep]:
            shutil.rmtree(old)
        del self._written[:-self.keep]
        return target

    def loader(self, version: int, arrays: dict[str, np.ndarray]) -> Loader:
        """Write the version once; each server then loads it from the directory."""
        return disk_loader(str(self.write(version, arrays)))


def disk_loader(path: str) -> Loader:
    """Loads a written version into a server (kept by the engine, to reload after a restart)."""
    return lambda client: client.update_weights_from_disk(path)
