"""User tasks: prompts from a Parquet or JSON-lines file, reward from a `module:function`.

A prompt is text, or chat messages (`[{"role": ..., "content": ...}, ...]`). With
`task.chat_template = true` the tokenizer's chat template turns either into the model's input (text
becomes one user message, after `task.system_prompt` if set), ending where the assistant's answer
starts: what an instruction-tuned model was trained to see. Without it, text goes to the model as it
is, and messages are refused (there is no right way to flatten them without the template).

The reward function is called as `function(completion: str, row: dict) -> float`, where `completion`
is the decoded response and `row` the prompt's record (all its fields, so a reference answer can sit
next to the prompt). A JSON-lines row is its line's object exactly as Python's `json` reads it: each
line its own record, so `4` stays the int 4 beside a `0.5` on another line, integers keep every digit,
and a field may hold different types on different lines (or be absent). A Parquet row has the file's
declared column types. A function with the attribute `batched = True` is called once per group instead,
as `function(completions: list[str], row: dict) -> list[float]` (a verifier that is cheaper in bulk, or
one that compares a group's answers). Training prompt id `i` is row `i mod rows`: the cursor walks the
file in order, epoch after epoch.
"""

from __future__ import annotations

import json
import reprlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from streamrl.config import TaskSection
from streamrl.tasks.reward_guard import RewardGuard, import_reward, is_batched

ROLES = ("system", "user", "assistant", "tool")
MAX_NEW_TOKENS = 256  # a response's length when `sampling.max_new_tokens` does not say
_JSON_SPACE = " \t\r\n"


def _messages_problem(messages: list[Any]) -> str | None:
    if not messages:
        return "the chat has no messages"
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"message {i} is {reprlib.repr(message)}, not an object with a role and content"
        if message.get("role") not in ROLES:
            return f"message {i} has role {message.get('role')!r}, not one of {', '.join(ROLES)}"
        if not isinstance(message.get("content"), str):
            return f"message {i} has no text content"
    if messages[-1]["role"] == "assistant":
        return "the chat ends with an assistant message: the model would answer itself"
    return None


def _prompt_problem(prompt: Any, field: str, messages: bool) -> str | None:
    """What is wrong with one row's prompt, the same checks for both formats; None when it is usable."""
    if isinstance(prompt, str):
        return "the prompt is empty" if prompt.isspace() or not prompt else None
    if prompt is None:
        return f"no prompt (column {field!r} is null or missing)"
    if isinstance(prompt, list):
        if messages:
            return _messages_problem(prompt)
        if prompt and all(isinstance(m, dict) for m in prompt):
            return (f"column {field!r} holds chat messages, which need the model's chat template: set "
                    "task.chat_template = true")
    wanted = "text or chat messages ([{role, content}, ...])" if messages else "text"
    return f"column {field!r} holds {reprlib.repr(prompt)} ({type(prompt).__name__}), not {wanted}"


def _read_json_lines(path: Path, where: str) -> tuple[list[dict[str, Any]], list[int]]:
    """The objects of a JSON-lines file, one per non-blank line, and the numbers of the blank lines
    (to turn a row back into its line). Python's `json` rather than Arrow's reader: Arrow infers one type
    per column, which turned every integer into a float once one line held a fraction, rounded integers
    past 2**53, refused a column that mixed types, and refused a line longer than its block."""
    rows: list[dict[str, Any]] = []
    blank: list[int] = []
    decode = json.JSONDecoder().raw_decode  # json.loads less its per-call overhead: half the time per line
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]  # a byte-order mark, as some Windows editors write
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(f"{where}: line {number} is not UTF-8 text ({exc.reason} at byte {exc.start})") \
                    from None
            try:
                record, end = decode(text)
                if text[end:].strip(_JSON_SPACE):
                    raise json.JSONDecodeError("Extra data", text, end)
            except (ValueError, RecursionError):  # a JSONDecodeError is a ValueError
                if not text.strip(_JSON_SPACE):
                    blank.append(number)
                    continue
                record = _loads(text, f"{where}: line {number}")
            if type(record) is not dict:
                raise ValueError(f"{where}: line {number} is not a JSON object")
            if ("\\ud" in text or "\\uD" in text) and (escape := _unpaired_surrogate(record)):
                raise ValueError(f"{where}: line {number} is not UTF-8 text (an unpaired surrogate, {escape})")
            rows.append(record)
    return rows, blank


def _loads(text: str, where: str) -> Any:
    """A line that `raw_decode` refused: `json.loads` reads one with leading spaces, and words the error
    of any other."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where} is not valid JSON ({exc.msg} column {exc.colno})") from None
    except (ValueError, RecursionError) as exc:  # an integer of over 4300 digits; arrays nested too deep
        raise ValueError(f"{where} cannot be read ({exc})") from None


def _unpaired_surrogate(record: dict[str, Any]) -> str | None:
    """A half of a surrogate pair that a record's strings hold alone, as its escape: `json` reads
    `"\\ud800"` as it is, but it is no character and no tokenizer can take it (Arrow refused it)."""
    try:
        json.dumps(record, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"\\u{ord(exc.object[exc.start]):04x}"
    return None


def _line(row: int, blank: list[int]) -> int:
    """The 1-based line of a JSON-lines file that holds 0-based row `row`, given its blank lines."""
    line = row + 1
    for number in blank:  # ascending: each blank line at or above the row moves it down one
        if number > line:
            break
        line += 1
    return line


def _invalid_utf8(table: pa.Table) -> str | None:
    """Where a table that failed full validation holds bytes that are not UTF-8 (Parquet files from
    other writers need not check)."""
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


def _read_parquet(path: Path, where: str) -> tuple[list[dict[str, Any]], list[str]]:
    """The rows of a Parquet file and its columns."""
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        raise ValueError(f"{where} is not a readable Parquet file: {exc}") from None
    try:
        table.validate(full=True)
    except pa.ArrowInvalid as exc:
        raise ValueError(f"{where}: {_invalid_utf8(table) or exc}") from None
    return table.to_pylist(), table.column_names


def read_rows(path: str | Path, prompt_field: str, *,
              tokenize: Callable[[list[Any]], list[list[int]]] | None = None,
              max_prompt_tokens: int | None = None, messages: bool = False) -> list[dict[str, Any]]:
    """The rows of a prompt file, each with a non-empty prompt, checked when the file is loaded: text,
    or with `messages` also chat messages.

    With `tokenize` (prompts -> token ids), every prompt is tokenized too: one that tokenizes to nothing
    or to more than `max_prompt_tokens` is refused. Errors name the file and the row (0-based, the row
    prompt id `i` maps to; in a JSON-lines file also its line) or, for JSON lines that cannot be read,
    the line (1-based).
    """
    path = Path(path)
    where = f"prompt file {str(path)!r}"
    if not path.is_file():
        raise FileNotFoundError(f"{where} does not exist")
    if path.suffix == ".parquet":
        rows, columns = _read_parquet(path, where)

        def locate(row: int) -> str:
            return f"row {row}"
    elif path.suffix in (".jsonl", ".json"):
        rows, blank = _read_json_lines(path, where)
        columns = None  # each row has its own keys

        def locate(row: int) -> str:
            return f"row {row} (line {_line(row, blank)})"
    else:
        raise ValueError(f"{where}: expected .parquet or .jsonl")
    if not rows:
        raise ValueError(f"{where} has no rows")
    if columns is None and prompt_field not in rows[0]:  # in JSON lines, a column is a key any row has
        columns = list(dict.fromkeys(key for record in rows for key in record))
    if columns is not None and prompt_field not in columns:
        raise ValueError(f"{where} has no column {prompt_field!r} (columns: {columns})")
    prompts = [record.get(prompt_field) for record in rows]
    for row, prompt in enumerate(prompts):
        if type(prompt) is str and prompt and not prompt.isspace():
            continue  # the common case, without a call
        problem = _prompt_problem(prompt, prompt_field, messages)
        if problem:
            raise ValueError(f"{where}, {locate(row)}: {problem}")
    _check_lengths(prompts, where, locate, tokenize, max_prompt_tokens)
    return rows


def _check_lengths(prompts: list[Any], where: str, locate: Callable[[int], str],
                   tokenize: Callable[[list[Any]], list[list[int]]] | None, max_prompt_tokens: int | None) -> None:
    if tokenize is None:
        return
    for start in range(0, len(prompts), 1024):
        for row, ids in enumerate(tokenize(prompts[start:start + 1024]), start=start):
            if not ids:
                raise ValueError(f"{where}, {locate(row)}: the prompt tokenizes to nothing")
            if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
                raise ValueError(f"{where}, {locate(row)}: the prompt is {len(ids)} tokens, more than the "
                                 f"{max_prompt_tokens} the model's context leaves for a prompt "
                                 "(max_position_embeddings − the response's sampling.max_new_tokens)")


def stop_token_ids(tokenizer) -> tuple[int, ...]:
    """Where a response ends: the tokenizer's eos token and every `eos_token_id` of the model's
    `generation_config.json` beside it. Chat models end a turn with a token the tokenizer need not call
    eos (Qwen2.5-Instruct lists `<|im_end|>` and `<|endoftext|>`, Llama 3 Instruct `<|eot_id|>` beside
    `<|end_of_text|>`): stopping at the tokenizer's alone ran such responses on to `max_new_tokens`."""
    ids = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    model_dir = getattr(tokenizer, "name_or_path", "")
    path = Path(model_dir, "generation_config.json")
    if model_dir and path.is_file():
        try:
            listed = json.loads(path.read_text()).get("eos_token_id")
        except (json.JSONDecodeError, AttributeError) as exc:  # not JSON, or JSON but not an object
            raise ValueError(f"{path} is not a JSON object ({exc})") from exc
        listed = [listed] if isinstance(listed, int) else listed if listed is not None else []
        if not isinstance(listed, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                   for i in listed):
            raise ValueError(f"{path}: eos_token_id must be a token id or a list of them, not {listed!r}")
        ids += listed
    if not ids:
        raise ValueError("the model's tokenizer has no eos token to stop generation at")
    return tuple(dict.fromkeys(ids))


class FileTask:
    name = "file"

    def __init__(self, section: TaskSection, tokenizer, search_path: str | None = None, *,
                 max_prompt_tokens: int | None = None):
        self.tokenizer = tokenizer
        self.field = section.prompt_field
        self.chat_template, self.system_prompt = section.chat_template, section.system_prompt
        if self.chat_template and not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"task.chat_template = true, but the tokenizer of {tokenizer.name_or_path!r} has no "
                             "chat template; set task.chat_template = false (prompts go in as plain text)")
        # With the model's context known (the launch check), every prompt is tokenized once up front, so
        # one that is too long or tokenizes to nothing fails the launch instead of a producer mid-run.
        lengths = {} if max_prompt_tokens is None else {
            "tokenize": lambda prompts: [self.encode(p) for p in prompts], "max_prompt_tokens": max_prompt_tokens}
        self.rows = read_rows(section.prompts, section.prompt_field, messages=self.chat_template, **lengths)
        self.eval_rows = (read_rows(section.eval_prompts, section.prompt_field, messages=self.chat_template,
                                    **lengths) if section.eval_prompts else [])
        # here too, not only in the worker: a bad spec fails at launch
        batched = is_batched(import_reward(section.reward, search_path))
        self.guard = RewardGuard(section.reward, search_path, isolation=section.reward_isolation,
                                 timeout_s=section.reward_timeout_s, low=section.reward_min,
                                 high=section.reward_max, fallback=section.reward_on_failure, batched=batched)
        self.stop_token_ids = stop_token_ids(tokenizer)
        self._cache: dict[int, list[int]] = {}

    def encode(self, prompt: str | list[dict[str, Any]]) -> list[int]:
        """The model's input for a prompt: the text's tokens, or the chat template's rendering of the
        messages (text as one user message) up to the assistant's turn, tokenized as rendered (the
        template writes the special tokens itself)."""
        if not self.chat_template:
            return self.tokenizer(prompt).input_ids
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if self.system_prompt is not None and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def _encode(self, row: dict[str, Any]) -> list[int]:
        ids = self.encode(row[self.field])
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

    def rewards(self, prompt_id: int, responses: Sequence[Sequence[int]]) -> list[float]:
        """One group's rewards: a single call of a batched reward function."""
        completions = [self.tokenizer.decode(list(ids), skip_special_tokens=True) for ids in responses]
        return self.guard.group(completions, self.rows[prompt_id % len(self.rows)])

    def eval_prompts(self, limit: int | None = None) -> list[list[int]]:
        return [self._encode(row) for row in self.eval_rows[:limit]]

    def eval_reward(self, index: int, response_ids: Sequence[int]) -> float:
        return self._score(self.eval_rows[index], response_ids)

    def max_new_tokens(self) -> int:
        return MAX_NEW_TOKENS

    def reward_failures(self) -> dict[str, int]:
        """Failed rewards so far, by kind (`raised`, `timeout`, `nan`, ...); empty while none failed."""
        return dict(self.guard.counts)

    def recent_reward_failures(self) -> list[str]:
        """The last few failed rewards, oldest first, as `kind: message`."""
        return [f"{f.kind}: {f.message}" for f in list(self.guard.recent)]  # a copy: calls may append

    def close(self) -> None:
        """Stop the reward worker process (it also ends with this process)."""
        self.guard.close()
