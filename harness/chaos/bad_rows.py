"""Bad prompt files for `read_rows` and `FileTask`: valid rows, one made bad per case, or a broken file."""

from __future__ import annotations

import json
import types
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from harness.chaos.cases import Case, Fuzzer, error_naming, file_state, pick
from streamrl.config import TaskSection


def _close(task: object) -> None:
    close = getattr(task, "close", None)  # a file task may hold a reward worker
    if close is not None:
        close()


def zero_reward(completion: str, row: dict) -> float:
    """The reward the fuzzed file tasks name (never called: their files are refused first)."""
    return 0.0


class CharTokenizer:
    """One token per character, as a Hugging Face tokenizer is called; zero-width spaces vanish (real
    tokenizers also drop some input), which makes prompts that tokenize to nothing possible."""

    eos_token_id = 0

    def _ids(self, text: str) -> list[int]:
        return [1 + ord(c) % 4000 for c in text if c != "\u200b"]

    def __call__(self, text: str | list[str]) -> types.SimpleNamespace:
        ids = [self._ids(t) for t in text] if isinstance(text, list) else self._ids(text)
        return types.SimpleNamespace(input_ids=ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i - 1) for i in ids if i)


_LETTERS = "abcdefghijklmnopqrstuvwxyz0123456789>+=?éß中"


@dataclass
class PromptFile:
    description: str
    names: tuple[str | tuple[str, ...], ...]  # "{path}" stands for the file
    name: str  # file name, its suffix choosing the format
    data: bytes | pa.Table | None  # None: no file
    max_prompt_tokens: int | None = None  # through FileTask with a tokenizer
    eval_bad: bool = False  # the bad file is the held-out one


def _prompt(rng: np.random.Generator, length: int | None = None) -> str:
    n = int(rng.integers(1, 24)) if length is None else length
    return "".join(_LETTERS[int(i)] for i in rng.integers(0, len(_LETTERS), size=n))


def _jsonl(rows: list[dict]) -> bytes:
    return b"".join(json.dumps(r, ensure_ascii=False).encode() + b"\n" for r in rows)


def _table(rows: list[dict]) -> pa.Table:
    """Rows as a table with every key any row has (`from_pylist` takes the first row's keys only)."""
    keys = list(dict.fromkeys(key for row in rows for key in row))
    return pa.table({key: [row.get(key) for row in rows] for key in keys})


def _parquet_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes()


def _text_array(values: list[bytes]) -> pa.Array:
    """A string array straight from bytes (Arrow checks no UTF-8 here, as a foreign writer would not)."""
    offsets = np.cumsum([0] + [len(v) for v in values]).astype(np.int32)
    return pa.Array.from_buffers(pa.string(), len(values),
                                 [None, pa.py_buffer(offsets.tobytes()), pa.py_buffer(b"".join(values))])


class DatasetFuzzer(Fuzzer):
    def __init__(self, workdir: Path, seed: int):
        super().__init__(workdir, seed)
        self.makers = (self.empty_prompt, self.null_prompt, self.wrong_type, self.mixed_type, self.not_utf8,
                       self.too_long, self.too_long, self.no_tokens, self.no_rows, self.no_column, self.bad_json,
                       self.bad_parquet, self.bad_suffix, self.missing)
        good = workdir / "control.jsonl"
        good.write_bytes(_jsonl([{"prompt": "abc"}, {"prompt": "d\u200be"}]))
        _close(self._task(good, good, max_prompt_tokens=3))  # the control: a valid file is accepted

    @staticmethod
    def _task(prompts: Path, eval_prompts: Path | None, max_prompt_tokens: int | None):
        from streamrl.tasks.files import FileTask

        section = TaskSection(kind="file", prompts=str(prompts), eval_prompts=eval_prompts and str(eval_prompts),
                              reward=f"{__name__}:zero_reward")
        return FileTask(section, CharTokenizer(), max_prompt_tokens=max_prompt_tokens)

    def case(self, index: int, rng: np.random.Generator) -> Case:
        from streamrl.tasks.files import read_rows

        spec = self.makers[index % len(self.makers)](rng)
        directory = self.workdir / f"case{index}"
        directory.mkdir()
        path = directory / spec.name
        if isinstance(spec.data, pa.Table):
            pq.write_table(spec.data, path)
        elif spec.data is not None:
            path.write_bytes(spec.data)
        names = tuple(str(path) if n == "{path}" else n for n in spec.names)
        if spec.max_prompt_tokens is None:
            def attempt() -> object:
                return read_rows(path, "prompt")
        else:
            good = directory / "good.jsonl"
            good.write_bytes(_jsonl([{"prompt": _prompt(rng, 1)}]))

            def attempt() -> object:
                train, held_out = (good, path) if spec.eval_bad else (path, good)
                return _close(self._task(train, held_out, spec.max_prompt_tokens))
        return Case(spec.description, attempt,
                    error_naming((ValueError, FileNotFoundError), *names, not_types=(pa.ArrowException, UnicodeError)),
                    state=lambda: file_state(directory))

    def _rows(self, rng) -> tuple[list[dict], int]:
        rows = [{"prompt": _prompt(rng), "answer": _prompt(rng)} for _ in range(int(rng.integers(2, 12)))]
        return rows, int(rng.integers(len(rows)))

    def _file(self, rng, rows: list[dict]) -> tuple[str, bytes | pa.Table]:
        if rng.random() < 0.5:
            return "prompts.jsonl", _jsonl(rows)
        return "prompts.parquet", _table(rows)

    def empty_prompt(self, rng) -> PromptFile:
        rows, r = self._rows(rng)
        rows[r]["prompt"] = pick(rng, ("", " ", "\t\n", "   \u3000"))
        name, data = self._file(rng, rows)
        return PromptFile(f"row {r}: prompt {rows[r]['prompt']!r} ({name})", ("{path}", f"row {r}"), name, data)

    def null_prompt(self, rng) -> PromptFile:
        rows, r = self._rows(rng)
        if rng.random() < 0.5:
            del rows[r]["prompt"]
            what = "missing"
        else:
            rows[r]["prompt"] = None
            what = "null"
        if all("prompt" not in row or row["prompt"] is None for row in rows):
            rows[(r + 1) % len(rows)]["prompt"] = "ok"  # keep the column a text column
        name, data = self._file(rng, rows)
        return PromptFile(f"row {r}: prompt {what} ({name})", ("{path}", f"row {r}"), name, data)

    def wrong_type(self, rng) -> PromptFile:
        rows, _ = self._rows(rng)
        kind = pick(rng, ("int", "float", "bool", "list", "object"))
        value = {"int": lambda: int(rng.integers(100)), "float": lambda: float(rng.random()),
                 "bool": lambda: bool(rng.random() < 0.5), "list": lambda: [_prompt(rng)],
                 "object": lambda: {"text": _prompt(rng)}}[kind]
        for row in rows:
            row["prompt"] = value()
        name = pick(rng, ("prompts.jsonl", "prompts.parquet"))
        data = _jsonl(rows) if name.endswith(".jsonl") else _table(rows)
        if name.endswith(".parquet") and rng.random() < 0.5:
            data = pa.table({"prompt": pa.array([r["prompt"].encode() if isinstance(r["prompt"], str) else
                                                 _prompt(rng).encode() for r in rows], pa.binary())})
            kind = "binary"
        return PromptFile(f"every prompt of type {kind} ({name})", ("{path}", "'prompt'"), name, data)

    def mixed_type(self, rng) -> PromptFile:
        rows, r = self._rows(rng)
        value = pick(rng, (7, 2.5, True, ["x"], {"text": "x"}))
        rows[r]["prompt"] = value
        return PromptFile(f"row {r}: prompt {value!r} among strings", ("{path}", f"line {r + 1}"), "prompts.jsonl",
                          _jsonl(rows))

    def not_utf8(self, rng) -> PromptFile:
        rows, r = self._rows(rng)
        junk = pick(rng, (b"\xff", b"\xfe\xff", b"\xc3", b"\xed\xa0\x80", b"\xe9", b"\xc0\xaf", b"\x80abc"))
        column = pick(rng, ("prompt", "answer"))
        if rng.random() < 0.5:
            lines = _jsonl(rows).splitlines(keepends=True)
            marker = json.dumps(rows[r][column], ensure_ascii=False).encode()
            lines[r] = lines[r].replace(marker, marker[:-1] + junk + b'"', 1)
            name, data = "prompts.jsonl", b"".join(lines)
            names = ("{path}", (f"row {r}", f"line {r + 1}"))
        else:
            values = [row[column].encode() for row in rows]
            values[r] += junk
            other = "answer" if column == "prompt" else "prompt"
            table = pa.table({column: _text_array(values), other: [row[other] for row in rows]})
            name, data = "prompts.parquet", _parquet_bytes(table)
            names = ("{path}", f"row {r}")
        return PromptFile(f"row {r}: {column} with bytes {junk!r} ({name})", names, name, data)

    def too_long(self, rng) -> PromptFile:
        limit = int(rng.integers(4, 40))
        rows, r = self._rows(rng)
        for row in rows:
            row["prompt"] = _prompt(rng, int(rng.integers(1, limit + 1)))
        over = limit + int(rng.integers(1, 200))
        rows[r]["prompt"] = _prompt(rng, over)
        name, data = self._file(rng, rows)
        held_out = rng.random() < 0.3
        return PromptFile(f"row {r}: a prompt of {over} tokens, limit {limit}" + (" (held-out)" if held_out else ""),
                          ("{path}", f"row {r}", f"{over} tokens"), name, data, max_prompt_tokens=limit,
                          eval_bad=held_out)

    def no_tokens(self, rng) -> PromptFile:
        rows, r = self._rows(rng)
        rows[r]["prompt"] = "\u200b" * int(rng.integers(1, 5))
        name, data = self._file(rng, rows)
        return PromptFile(f"row {r}: a prompt that tokenizes to nothing", ("{path}", f"row {r}", ("nothing", "empty")),
                          name, data, max_prompt_tokens=64)

    def no_rows(self, rng) -> PromptFile:
        what, name, data = pick(rng, (
            ("an empty file", "prompts.jsonl", b""),
            ("blank lines only", "prompts.jsonl", b"\n" * int(rng.integers(1, 5))),
            ("a table of no rows", "prompts.parquet", pa.table({"prompt": pa.array([], pa.string())})),
        ))
        return PromptFile(what, ("{path}", "no rows"), name, data)

    def no_column(self, rng) -> PromptFile:
        rows, _ = self._rows(rng)
        other = pick(rng, ("question", "Prompt", "text", "prompts"))
        rows = [{other: row["prompt"], "answer": row["answer"]} for row in rows]
        name, data = self._file(rng, rows)
        return PromptFile(f"the prompts in column {other!r} ({name})", ("{path}", "'prompt'"), name, data)

    def bad_json(self, rng) -> PromptFile:
        rows, r = self._rows(rng)
        lines = _jsonl(rows).splitlines(keepends=True)
        what, line = pick(rng, (
            ("truncated", lines[r][: max(1, len(lines[r]) // 2)] + b"\n"),
            ("trailing garbage", lines[r].rstrip(b"\n") + b" xyz\n"),
            ("not an object", json.dumps(rows[r]["prompt"]).encode() + b"\n"),
            ("an array", b'["a", "b"]\n'),
            ("a control character", lines[r].replace(b'"prompt": "', b'"prompt": "\x01', 1)),
        ))
        lines[r] = line
        return PromptFile(f"line {r + 1}: {what}", ("{path}", f"line {r + 1}"), "prompts.jsonl", b"".join(lines))

    def bad_parquet(self, rng) -> PromptFile:
        rows, _ = self._rows(rng)
        real = _parquet_bytes(_table(rows))
        what, data = pick(rng, (
            ("random bytes", rng.bytes(int(rng.integers(0, 300)))),
            ("a truncated file", real[: int(rng.integers(0, len(real) - 1))]),
            ("garbage between magic bytes", b"PAR1" + rng.bytes(int(rng.integers(0, 200))) + b"PAR1"),
            ("JSON lines", _jsonl(rows)),
        ))
        return PromptFile(f"a Parquet file of {what}", ("{path}", ("Parquet", "no rows")), "prompts.parquet", data)

    def bad_suffix(self, rng) -> PromptFile:
        rows, _ = self._rows(rng)
        name = pick(rng, ("prompts.csv", "prompts.txt", "prompts", "prompts.JSONL", "prompts.parquet.gz"))
        return PromptFile(f"a file named {name}", ("{path}", ".parquet or .jsonl"), name, _jsonl(rows))

    def missing(self, rng) -> PromptFile:
        return PromptFile("a prompt file that does not exist", ("{path}", "does not exist"),
                          pick(rng, ("gone.jsonl", "gone.parquet")), None)


