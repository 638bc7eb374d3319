"""User tasks: prompts from a Parquet or JSON-lines file, reward from a `module:function`.

The reward function is called as `function(completion: str, row: dict) -> float`, where `row` is the
prompt's record (all its columns, so a reference answer can sit next to the prompt). Training prompt
id `i` is row `i mod rows`: the cursor walks the file in order, epoch after epoch.
"""

from __future__ import annotations

import json
import reprlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pa_json
import pyarrow.parquet as pq

from streamrl.config import TaskSection
from streamrl.tasks.reward_guard import RewardGuard, import_reward


def _is_text(type_: pa.DataType) -> bool:
    if pa.types.is_dictionary(type_):
        type_ = type_.value_type
    return pa.types.is_string(type_) or pa.types.is_large_string(type_)


def _json_problem(path: Path, prompt_field: str) -> str | None:
    """The first line of a JSON-lines file that Arrow refused to read, and what is wrong with it
    (searched line by line, so only once reading has failed)."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as exc:
                return f"line {number} is not UTF-8 text ({exc.reason} at byte {exc.start})"
            except json.JSONDecodeError as exc:
                return f"line {number} is not valid JSON ({exc.msg} column {exc.colno})"
            if not isinstance(record, dict):
                return f"line {number} is not a JSON object"
            value = record.get(prompt_field)
            if value is not None and not isinstance(value, str):
                return f"line {number}: column {prompt_field!r} holds {reprlib.repr(value)}, not text"
    return None


def _read_table(path: Path, prompt_field: str, where: str) -> pa.Table:
    if path.suffix == ".parquet":
        try:
            return pq.read_table(path)
        except (pa.ArrowException, OSError) as exc:
            raise ValueError(f"{where} is not a readable Parquet file: {exc}") from None
    if path.suffix not in (".jsonl", ".json"):
        raise ValueError(f"{where}: expected .parquet or .jsonl")
    if path.stat().st_size == 0:
        raise ValueError(f"{where} has no rows")
    try:
        return pa_json.read_json(path)
    except pa.ArrowException as exc:
        raise ValueError(f"{where}: {_json_problem(path, prompt_field) or exc}") from None


def _invalid_utf8(table: pa.Table) -> str | None:
    """Where a table that failed full validation holds bytes that are not UTF-8 (Arrow's JSON reader
    and Parquet files from other writers do not check)."""
    for name, column in zip(table.column_names, table.columns):
        offset = 0
        for chunk in column.chunks:
            try:
                chunk.validate(full=True)
            except pa.ArrowInvalid:
                for index in range(len(chunk)):
                    try:
                        chunk[index].as_py()
                    except UnicodeDecodeError:
                        return f"row {offset + index}, column {name!r} is not UTF-8 text"
            offset += len(chunk)
    return None


def _first(mask: pa.ChunkedArray) -> int:
    return pc.index(mask, True).as_py()


def read_rows(path: str | Path, prompt_field: str, *,
              tokenize: Callable[[list[str]], list[list[int]]] | None = None,
              max_prompt_tokens: int | None = None) -> list[dict[str, Any]]:
    """The rows of a prompt file, each with a non-empty text prompt, checked when the file is loaded.

    With `tokenize` (texts -> token ids), every prompt is tokenized too: one that tokenizes to nothing
    or to more than `max_prompt_tokens` is refused. Errors name the file and the row (0-based, the row
    prompt id `i` maps to) or, for JSON lines that cannot be parsed, the line (1-based).
    """
    path = Path(path)
    where = f"prompt file {str(path)!r}"
    if not path.is_file():
        raise FileNotFoundError(f"{where} does not exist")
    table = _read_table(path, prompt_field, where)
    try:
        table.validate(full=True)
    except pa.ArrowInvalid as exc:
        raise ValueError(f"{where}: {_invalid_utf8(table) or exc}") from None
    if table.num_rows == 0:
        raise ValueError(f"{where} has no rows")
    if prompt_field not in table.column_names:
        raise ValueError(f"{where} has no column {prompt_field!r} (columns: {table.column_names})")
    prompts = table.column(prompt_field)
    if not _is_text(prompts.type):
        raise ValueError(f"{where}: column {prompt_field!r} must hold text, not {prompts.type}")
    if pa.types.is_dictionary(prompts.type):
        prompts = prompts.cast(prompts.type.value_type)
    if prompts.null_count:
        raise ValueError(f"{where}, row {_first(pc.is_null(prompts))}: no prompt (column {prompt_field!r} "
                         "is null or missing)")
    blank = pc.equal(pc.utf8_trim_whitespace(prompts), "")
    if pc.any(blank).as_py():
        raise ValueError(f"{where}, row {_first(blank)}: the prompt is empty")
    if tokenize is not None:
        texts = prompts.to_pylist()
        for start in range(0, len(texts), 1024):
            for row, ids in enumerate(tokenize(texts[start:start + 1024]), start=start):
                if not ids:
                    raise ValueError(f"{where}, row {row}: the prompt tokenizes to nothing")
                if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
                    raise ValueError(f"{where}, row {row}: the prompt is {len(ids)} tokens, more than the "
                                     f"{max_prompt_tokens} the model's context leaves for a prompt")
    return table.to_pylist()


class FileTask:
    name = "file"

    def __init__(self, section: TaskSection, tokenizer, search_path: str | None = None, *,
                 max_prompt_tokens: int | None = None):
        self.tokenizer = tokenizer
        self.field = section.prompt_field
        # With the model's context known (the launch check), every prompt is tokenized once up front, so
        # one that is too long or tokenizes to nothing fails the launch instead of a producer mid-run.
        lengths = {} if max_prompt_tokens is None else {
            "tokenize": lambda texts: tokenizer(texts).input_ids, "max_prompt_tokens": max_prompt_tokens}
        self.rows = read_rows(section.prompts, section.prompt_field, **lengths)
        self.eval_rows = (read_rows(section.eval_prompts, section.prompt_field, **lengths)
                          if section.eval_prompts else [])
        import_reward(section.reward, search_path)  # here too, not only in the worker: a bad spec fails at launch
        self.guard = RewardGuard(section.reward, search_path, isolation=section.reward_isolation,
                                 timeout_s=section.reward_timeout_s, low=section.reward_min,
                                 high=section.reward_max, fallback=section.reward_on_failure)
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
        return self.guard(completion, row)  # a failed reward is the fallback, counted: the run goes on

    def reward(self, prompt_id: int, response_ids: Sequence[int]) -> float:
        return self._score(self.rows[prompt_id % len(self.rows)], response_ids)

    def eval_prompts(self, limit: int | None = None) -> list[list[int]]:
        return [self._encode(row) for row in self.eval_rows[:limit]]

    def eval_reward(self, index: int, response_ids: Sequence[int]) -> float:
        return self._score(self.eval_rows[index], response_ids)

    def max_new_tokens(self) -> int:
        return 256

    def reward_failures(self) -> dict[str, int]:
        """Failed rewards so far, by kind (`raised`, `timeout`, `nan`, ...); empty while none failed."""
        return dict(self.guard.counts)

    def recent_reward_failures(self) -> list[str]:
        """The last few failed rewards, oldest first, as `kind: message`."""
        return [f"{f.kind}: {f.message}" for f in list(self.guard.recent)]  # a copy: calls may append

    def close(self) -> None:
        """Stop the reward worker process (it also ends with this process)."""
        self.guard.close()
