"""User tasks: prompts from a Parquet or JSON-lines file, reward from a `module:function`.

The reward function is called as `function(completion: str, row: dict) -> float`, where `row` is the
prompt's record (all its columns, so a reference answer can sit next to the prompt). Training prompt
id `i` is row `i mod rows`: the cursor walks the file in order, epoch after epoch.
"""

from __future__ import annotations

import importlib
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.json as pa_json
import pyarrow.parquet as pq

from streamrl.config import TaskSection


def read_rows(path: str | Path, prompt_field: str) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {str(path)!r} does not exist")
    if path.suffix == ".parquet":
        table = pq.read_table(path)
    elif path.suffix in (".jsonl", ".json"):
        table = pa_json.read_json(path)
    else:
        raise ValueError(f"prompt file {str(path)!r}: expected .parquet or .jsonl")
    if prompt_field not in table.column_names:
        raise ValueError(f"prompt file {str(path)!r} has no column {prompt_field!r} (columns: {table.column_names})")
    if table.num_rows == 0:
        raise ValueError(f"prompt file {str(path)!r} has no rows")
    if not pa.types.is_string(table.schema.field(prompt_field).type):
        raise ValueError(f"prompt file {str(path)!r}: column {prompt_field!r} must hold text, "
                         f"not {table.schema.field(prompt_field).type}")
    return table.to_pylist()


def import_reward(spec: str, search_path: str | None = None) -> Callable[[str, dict], float]:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward {spec!r}: expected module:function")
    if search_path and search_path not in sys.path:
        sys.path.insert(0, search_path)  # the launching directory, so a local reward module imports on workers
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"reward {spec!r}: cannot import module {module_name!r}: {exc}") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward {spec!r}: module {module_name!r} has no function {attr!r}")
    return fn


class FileTask:
    name = "file"

    def __init__(self, section: TaskSection, tokenizer, search_path: str | None = None):
        self.tokenizer = tokenizer
        self.field = section.prompt_field
        self.rows = read_rows(section.prompts, section.prompt_field)
        self.eval_rows = read_rows(section.eval_prompts, section.prompt_field) if section.eval_prompts else []
        self.reward_fn = import_reward(section.reward, search_path)
        if tokenizer.eos_token_id is None:
            raise ValueError("the model's tokenizer has no eos token to stop generation at")
        self.stop_token_ids = (tokenizer.eos_token_id,)
        self._cache: dict[int, list[int]] = {}

    def _encode(self, row: dict[str, Any]) -> list[int]:
        ids = self.tokenizer(row[self.field]).input_ids
        if not ids:
            raise ValueError(f"prompt {row[self.field]!r} tokenizes to nothing")
        return ids

    def prompt(self, prompt_id: int) -> list[int]:
        index = prompt_id % len(self.rows)
        if index not in self._cache:
            self._cache[index] = self._encode(self.rows[index])
        return self._cache[index]

    def _score(self, row: dict[str, Any], response_ids: Sequence[int]) -> float:
        completion = self.tokenizer.decode(list(response_ids), skip_special_tokens=True)
        value = float(self.reward_fn(completion, row))
        if not math.isfinite(value):
            raise ValueError(f"reward function returned {value} for prompt {row[self.field]!r}")
        return value

    def reward(self, prompt_id: int, response_ids: Sequence[int]) -> float:
        return self._score(self.rows[prompt_id % len(self.rows)], response_ids)

    def eval_prompts(self, limit: int | None = None) -> list[list[int]]:
        return [self._encode(row) for row in self.eval_rows[:limit]]

    def eval_reward(self, index: int, response_ids: Sequence[int]) -> float:
        return self._score(self.eval_rows[index], response_ids)

    def max_new_tokens(self) -> int:
        return 256
