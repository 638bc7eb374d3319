"""Bad run configs for `load_config`: launch/default.toml or `--set` overrides, mutated one way per case."""

from __future__ import annotations

import copy
import json
import math
import tomllib
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import tomli_w
from pydantic import BaseModel

from harness import CHECKOUT
from harness.chaos.cases import Case, Fuzzer, error_naming, file_state, pick
from streamrl.config import ConfigError, RunConfig, dump_config, load_config

DEFAULT_TOML = CHECKOUT / "launch" / "default.toml"


@dataclass
class ConfigSpec:
    """A bad config: a file (`text`; None: no file, `missing`/`directory`: a bad path) plus overrides."""

    description: str
    names: tuple[str | tuple[str, ...], ...]  # the error names each (a tuple: one of them); "{path}": the file
    text: bytes | None = None
    overrides: tuple[str, ...] = ()
    path: Literal["file", "none", "missing", "directory"] = "file"


def _strip_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else annotation
    return annotation


@dataclass(frozen=True)
class Leaf:
    path: str  # dotted, e.g. producers.sglang.base_port
    kind: str  # bool, int, float, str, literal, tuple, list
    bounds: dict[str, float]  # ge, gt, le, lt, min_length
    choices: tuple = ()
    pattern: str | None = None
    element_bounds: dict[str, float] | None = None


def _bounds(metadata: Sequence[Any]) -> tuple[dict[str, float], str | None]:
    bounds, pattern = {}, None
    for item in metadata:
        for key in ("ge", "gt", "le", "lt", "min_length"):
            if getattr(item, key, None) is not None:
                bounds[key] = getattr(item, key)
        pattern = getattr(item, "pattern", None) or pattern
    return bounds, pattern


def config_leaves(model: type[BaseModel] = RunConfig, prefix: str = "") -> list[Leaf]:
    """Every settable field of the run config, with what the schema allows."""
    leaves = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        annotation = _strip_optional(field.annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            leaves += config_leaves(annotation, f"{path}.")
            continue
        bounds, pattern = _bounds(field.metadata)
        origin = typing.get_origin(annotation)
        if origin is Literal:
            leaves.append(Leaf(path, "literal", bounds, choices=typing.get_args(annotation)))
        elif origin in (tuple, list):
            element = typing.get_args(annotation)[0]
            element_bounds = _bounds(typing.get_args(element)[1:])[0] if typing.get_origin(element) else None
            leaves.append(Leaf(path, origin.__name__, bounds, element_bounds=element_bounds or None))
        elif annotation in (bool, int, float, str):
            leaves.append(Leaf(path, annotation.__name__, bounds, pattern=pattern))
    return leaves


_WRONG_TYPES: dict[str, tuple[Any, ...]] = {
    "bool": (1, 0, "true", "yes", 1.5, [True]),
    "int": ("7", 2.5, True, False, [1], "1e3", {"value": 1}),
    "float": ("0.5", "inf", True, [0.5], {"value": 0.5}),
    "str": (7, 1.5, True, ["text"], {"value": "x"}),
    "literal": (3, True, ["x"]),
    "tuple": ("0.9, 0.99", 0.9, [0.9], [0.9, 0.99, 0.5], ["a", "b"], [True, False]),
    "list": ("--flag", 5, [1, 2], [True], [["a"]]),
}


def _wrong_type(leaf: Leaf, rng: np.random.Generator) -> Any:
    if leaf.kind == "literal" and rng.random() < 0.5:
        choice = str(pick(rng, leaf.choices))
        return pick(rng, (choice.upper(), f"{choice}x", f" {choice}", choice[:-1] or "?"))
    return pick(rng, _WRONG_TYPES[leaf.kind])


def _beyond_bounds(leaf: Leaf, rng: np.random.Generator) -> list[Any]:
    """Values of the right type outside the field's declared bounds (none when it declares none)."""
    step = int(rng.integers(1, 1000)) if leaf.kind == "int" else float(rng.uniform(1e-3, 100))
    b = leaf.bounds
    values = []
    if leaf.kind in ("int", "float"):
        if "ge" in b:
            values.append(b["ge"] - step)
        if "gt" in b:
            values.append(b["gt"] - (step - 1 if leaf.kind == "int" else pick(rng, (0.0, step))))
        if "le" in b:
            values.append(b["le"] + step)
        if "lt" in b:
            values.append(b["lt"] + (step - 1 if leaf.kind == "int" else pick(rng, (0.0, step))))
    elif leaf.kind == "str" and leaf.pattern:
        values += ["", "has space", "-leading-dash", "x" * (65 + int(step) % 50), "a/b", "ünïcode"]
    elif leaf.kind == "list" and "min_length" in b:
        values.append([])
    elif leaf.kind == "tuple" and leaf.element_bounds:
        eb = leaf.element_bounds
        bad = eb.get("lt", eb.get("le", 1.0)) + float(rng.uniform(0, 2)) if rng.random() < 0.5 else -step
        values.append([bad, 0.5] if rng.random() < 0.5 else [0.5, bad])
    return values


def _unrepresentable(leaf: Leaf, rng: np.random.Generator) -> list[Any]:
    """NaN and ±inf for a float, and integers beyond 64 bits for an int: no field means any of them."""
    if leaf.kind == "float":
        return [math.nan, math.inf, -math.inf]
    if leaf.kind == "int":
        step = int(rng.integers(1, 10**6))
        return [2**63 + step, -(2**63) - step, 10**30 + step]
    return []


def toml_literal(value: Any) -> str:
    """A value as `--set` takes it (TOML syntax on one line)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_literal(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(toml_literal(v) for v in value) + "]"
    return json.dumps(value)


def _set_in(tree: dict, dotted: str, value: Any) -> dict:
    tree = copy.deepcopy(tree)
    *path, leaf = dotted.split(".")
    node = tree
    for part in path:
        node = node.setdefault(part, {})
    node[leaf] = value
    return tree


class ConfigSpecs:
    """Bad configs made from one valid file (launch/default.toml, or the built-in default written out)."""

    def __init__(self, exclude: Sequence[str] = ()):
        self.text = DEFAULT_TOML.read_text() if DEFAULT_TOML.is_file() else dump_config(RunConfig())
        self.tree = tomllib.loads(self.text)
        self.leaves = [leaf for leaf in config_leaves() if leaf.path not in exclude]
        counting = np.random.default_rng(0)  # how many values a field refuses does not depend on the draw
        self.bounded = [leaf for leaf in self.leaves if _beyond_bounds(leaf, counting)]
        self.numeric = [leaf for leaf in self.leaves if leaf.kind in ("int", "float")]
        self.makers = (self.syntax, self.not_utf8, self.unknown_section, self.unknown_key, self.wrong_type,
                       self.out_of_range, self.out_of_range, self.contradiction, self.bad_override, self.bad_path)

    def make(self, index: int, rng: np.random.Generator) -> ConfigSpec:
        return self.makers[index % len(self.makers)](rng)

    def _placed(self, rng, description: str, names: tuple, dotted: str, value: Any) -> ConfigSpec:
        """The bad value in the file or as a --set override (chosen at random)."""
        if rng.random() < 0.5:
            text = tomli_w.dumps(_set_in(self.tree, dotted, value)).encode()
            return ConfigSpec(f"{description} (in the file)", names, text=text)
        item = f"{dotted}={toml_literal(value)}"
        return ConfigSpec(f"{description} (--set)", names, text=self.text.encode(), overrides=(item,))

    def syntax(self, rng) -> ConfigSpec:
        lines = self.text.splitlines()
        keyed = [i for i, line in enumerate(lines) if " = " in line and not line.startswith("#")]
        headers = [i for i, line in enumerate(lines) if line.startswith("[")]
        i, h = pick(rng, keyed), pick(rng, headers)
        edits = {
            "a key without '='": lambda: lines[:i] + [lines[i].replace(" = ", " ", 1)] + lines[i + 1:],
            "an unclosed table header": lambda: lines[:h] + [lines[h].rstrip("]")] + lines[h + 1:],
            "a key given twice": lambda: lines[:i + 1] + [lines[i]] + lines[i + 1:],
            "a table given twice": lambda: lines + [lines[h]],
            "a line of garbage": lambda: lines[:i] + [pick(rng, ("@@@", "= 3", "[[]]", "key = ", "'''"))] + lines[i:],
            "an unterminated string": lambda: lines[:i] + [lines[i].split(" = ")[0] + ' = "open'] + lines[i + 1:],
            "an unterminated array": lambda: lines[:i] + [lines[i].split(" = ")[0] + " = [1, 2"] + lines[i + 1:],
            "a malformed number": lambda: lines[:i] + [lines[i].split(" = ")[0] + " = " +
                                                       pick(rng, ("1e", "0x", "1__0", "9 00", "+-1", ".5"))]
                                          + lines[i + 1:],
        }
        what = pick(rng, sorted(edits))
        text = "\n".join(edits[what]()) + "\n"
        try:
            tomllib.loads(text)
        except tomllib.TOMLDecodeError:
            pass
        else:  # the edit happened to keep the file valid: a broken header always breaks it
            what, text = "an unclosed table header", text + "[run\n"
        return ConfigSpec(f"TOML syntax: {what}", ("{path}", "not valid TOML"), text=text.encode())

    def not_utf8(self, rng) -> ConfigSpec:
        data = self.text.encode()
        at = int(rng.integers(len(data)))
        junk = pick(rng, (b"\xff", b"\xfe\xff", b"\xc3", b"\xed\xa0\x80", b"\xe9", b"\xc0\xaf"))
        return ConfigSpec(f"bytes {junk!r} that are not UTF-8", ("{path}", "UTF-8"), text=data[:at] + junk + data[at:])

    def unknown_section(self, rng) -> ConfigSpec:
        known = list(RunConfig.model_fields)
        name = pick(rng, (f"{pick(rng, known)}s", pick(rng, known)[:-1], "optimizer", "trainer_", "Run"))
        return self._placed(rng, f"unknown section [{name}]", (name,), f"{name}.value", 1)

    def unknown_key(self, rng) -> ConfigSpec:
        leaf = pick(rng, self.leaves)
        section, _, key = leaf.path.rpartition(".")
        known = {x.path for x in self.leaves}
        for candidate in (f"{key}_{int(rng.integers(100))}", key[:-1], key.upper(), f"{key}s"):
            if f"{section}.{candidate}" not in known:
                break
        dotted = f"{section}.{candidate}"
        return self._placed(rng, f"unknown key {dotted}", (dotted,), dotted, 1)

    def wrong_type(self, rng) -> ConfigSpec:
        leaf = pick(rng, self.leaves)
        value = _wrong_type(leaf, rng)
        return self._placed(rng, f"{leaf.path} = {value!r} (wrong type)", (leaf.path,), leaf.path, value)

    def out_of_range(self, rng) -> ConfigSpec:
        if rng.random() < 0.6:
            leaf = pick(rng, self.bounded)
            value = pick(rng, _beyond_bounds(leaf, rng))
        else:
            leaf = pick(rng, self.numeric)
            value = pick(rng, _unrepresentable(leaf, rng))
        return self._placed(rng, f"{leaf.path} = {value!r} (out of range)", (leaf.path,), leaf.path, value)

    def contradiction(self, rng) -> ConfigSpec:
        n = int(rng.integers(1, 9))
        cases = [
            (["task.kind=\"file\""] + pick(rng, ([], ["task.prompts=\"p.jsonl\""], ["task.reward=\"m:f\""])),
             "task.kind", "a file task without its prompts, reward or model"),
            ([f"trainer.advantage=\"{pick(rng, ('grpo', 'rloo'))}\"", "queue.group_size=1"], "queue.group_size",
             "group size 1 with a group advantage"),
            ([f"queue.groups_per_step={n}", f"trainer.minibatches={n + 1 + int(rng.integers(10))}"],
             "trainer.minibatches", "more mini-batches than groups per step"),
            (["trainer.colocated=true"], "trainer.colocated", "a colocated trainer without sglang"),
            (["trainer.colocated=true", "producers.engine=\"sglang\"", "producers.sglang.memory_saver=true",
              "trainer.backend=\"megatron\"", f"trainer.tensor_parallel={n + 1}"], "trainer.tensor_parallel",
             "a colocated tensor-parallel trainer"),
            (["producers.engine=\"sglang\"", f"producers.num_gpus={n}", f"producers.sglang.servers={n + 1}"],
             "producers.num_gpus", "fewer producer GPUs than sglang servers"),
            ([f"trainer.tensor_parallel={n + 1}", "trainer.backend=\"torch\""], "trainer.tensor_parallel",
             "tensor parallelism with the torch backend"),
            (["model.num_heads=3", f"model.hidden_size={64 + 3 * n + 1}"], "hidden_size",
             "heads that do not divide the hidden size"),
            (["queue.max_staleness=0", f"queue.groups_per_step={n + 1}", f"queue.max_in_flight={n}"],
             "max_in_flight", "a synchronous step that can never fill"),
            (["loss.lo=1.0", "loss.hi=1.0"], "lo=", "masked-IS bounds lo = hi"),
            ([f"trainer.data_parallel={n + 1}", "trainer.backend=\"torch\""], "trainer.data_parallel",
             "data parallelism with the torch backend"),
            (["trainer.backend=\"megatron\"", "trainer.data_parallel=2", f"queue.groups_per_step={2 * n + 1}"],
             "trainer.data_parallel", "groups per step that do not split over the data-parallel ranks"),
            ([f"trainer.pipeline_parallel={n + 1}", "trainer.backend=\"torch\""], "trainer.pipeline_parallel",
             "pipeline parallelism with the torch backend"),
            (["trainer.colocated=true", "producers.engine=\"sglang\"", "producers.sglang.memory_saver=true",
              "trainer.backend=\"megatron\"", f"trainer.pipeline_parallel={n + 1}"], "trainer.pipeline_parallel",
             "a colocated pipeline-parallel trainer"),
        ]
        overrides, name, what = pick(rng, cases)
        return ConfigSpec(f"contradiction: {what}", (name,), text=self.text.encode(), overrides=tuple(overrides))

    def bad_override(self, rng) -> ConfigSpec:
        word = pick(rng, ("steps", "lr", "a", "run", "xyz"))
        cases = [
            (word, (f"--set {word!r}", "section.key=value")),
            (f"={int(rng.integers(10))}", ("section.key=value",)),
            ("  =  ", ("section.key=value",)),
            (f"{word}x.y=", (f"{word}x",)),
            ("run.=3", ("empty name",)),
            (".steps=1", ("empty name",)),
            ("run..steps=1", ("empty name",)),
            ("run.steps.x=1", ("'steps' is a value",)),
            (f"run={int(rng.integers(10))}", ("run",)),
            ("run.stepz=1", ("run.stepz",)),
            (f"run.steps={pick(rng, ('abc', '', '[1,', '1e', 'true', '1.5', '0x', 'null', '-3'))}", ("run.steps",)),
            (f"trainer.lr={pick(rng, ('fast', '', 'null', '-1', '0', 'nan', 'inf', '[0.1]'))}", ("trainer.lr",)),
            ("trainer.betas=[0.9", ("trainer.betas",)),
            (f"queue.admission={pick(rng, ('PER_STEP', 'sync', '1'))}", ("queue.admission",)),
        ]
        item, names = pick(rng, cases)
        return ConfigSpec(f"--set {item!r}", names, text=self.text.encode(), overrides=(item,))

    def bad_path(self, rng) -> ConfigSpec:
        if rng.random() < 0.5:
            return ConfigSpec("a config path that does not exist", ("{path}", "does not exist"), path="missing")
        return ConfigSpec("a config path that is a directory", ("{path}", "not a file"), path="directory")


def materialize(spec: ConfigSpec, directory: Path) -> tuple[Path | None, tuple[str, ...]]:
    """The config path the spec names (written when it is a file) and the names its error must hold."""
    path: Path | None = None
    if spec.path == "file":
        path = directory / "case.toml"
        path.write_bytes(spec.text or b"")
    elif spec.path == "missing":
        path = directory / "no-such-config.toml"
    elif spec.path == "directory":
        path = directory / "a-directory.toml"
        path.mkdir(exist_ok=True)
    names = tuple(str(path) if n == "{path}" else n for n in spec.names)
    return path, names


class ConfigFuzzer(Fuzzer):
    def __init__(self, workdir: Path, seed: int):
        super().__init__(workdir, seed)
        self.specs = ConfigSpecs()
        load_config(DEFAULT_TOML if DEFAULT_TOML.is_file() else None)  # the control: the base file is valid

    def case(self, index: int, rng: np.random.Generator) -> Case:
        spec = self.specs.make(index, rng)
        path, names = materialize(spec, self.workdir)
        return Case(spec.description, lambda: load_config(path, list(spec.overrides)),
                    error_naming(ConfigError, *names), state=lambda: file_state(self.workdir))


