"""Does the real sglang source have everything streamrl asks of it? Read from a wheel, never imported.

    python -m benchmarks.sglang_conformance --out benchmarks/results/sglang_conformance.json
    python -m benchmarks.sglang_conformance --version 0.5.21 --out /tmp/sglang-0.5.21.json
    python -m benchmarks.sglang_conformance --wheel sglang-0.5.23-...whl --out F
    python -m benchmarks.sglang_conformance --source DIR --out F   # DIR holds sglang/srt/...

sglang needs CUDA to import, so its wheel (a zip) is read with `zipfile` and its Python source parsed
with `ast`. The wheel of `--version` is taken from `$STREAMRL_SGLANG_WHEELS` (default
`~/.cache/streamrl/sglang`), downloaded there with `pip download --no-deps` when missing. Every entry
of `streamrl/sglang/protocol.py` is checked (source files relative to `sglang/srt/`):

- routes: `entrypoints/http_server.py`'s `@app.<verb>(path)` / `@app.api_route(path, methods=[...])`
  handlers answer each route with its method and read the body into the declared request class, and
  that class of `managers/io_struct.py` (with its bases there) has every field streamrl sends;
- sampling keys: fields (and `__init__` arguments) of `SamplingParams` in `sampling/sampling_params.py`;
- launch flags: `--flag` constants passed to calls in `server_args.py` and `arg_groups/**`, and the flags
  derived from `A[T, "help"]` / `A[T, Arg(...)]` fields (`ServerArgs`, `arg_groups/fields/*`);
- response keys: string constants of the named files;
- the stand-in (`tests/fake_sglang.py`): every (method, path) in its `SERVED`, but `/fake/...`, is a route.

Prints one row per checked item and a summary; writes the JSON to `--out`; exits 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import difflib
import importlib.util
import json
import os
import re
import subprocess
import sys
import zipfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from streamrl.sglang import protocol  # noqa: E402

HTTP_SERVER = "entrypoints/http_server.py"
IO_STRUCT = "managers/io_struct.py"
SAMPLING = "sampling/sampling_params.py"
SERVER_ARGS = "server_args.py"
ARG_GROUPS = "arg_groups/"
ARG_FIELDS = "arg_groups/fields/"
SRT = "sglang/srt/"
# From 0.5.22 `/generate` first validates its body against this JSON contract (outside sglang/srt/), whose
# SamplingParams rejects unknown keys: read as if it sat at sglang/srt/../api/v1/api_types.py.
API_CONTRACT = "../api/v1/api_types.py"
FLAG = re.compile(r"^--[a-z0-9][a-z0-9-]*$")
VERBS = ("get", "post", "put", "delete", "patch", "head")
NOT_A_BODY = {"Request", "Response", "BackgroundTasks", "WebSocket", *vars(builtins)}  # `timeout: float`
COUNTS = {"route": "calls_checked", "field": "fields_checked", "flag": "flags_checked",
          "sampling_key": "sampling_keys_checked", "response_key": "response_keys_checked",
          "stand_in_route": "stand_in_routes_checked"}

Sources = Mapping[str, str]  # path under sglang/srt/ -> its text
RouteTable = dict[tuple[str, str], ast.FunctionDef | ast.AsyncFunctionDef]  # (METHOD, path) -> handler


@dataclass(frozen=True)
class Finding:
    kind: str  # what was checked: route, field, sampling_key, flag, response_key, stand_in_route
    streamrl: str  # what streamrl uses, e.g. "POST /begin_weight_update"
    mismatch: str | None = None  # route, method, request, field, …; None when the source conforms
    sglang: str = ""  # what the source has instead

    def as_mismatch(self) -> dict[str, str]:
        return {"what": self.mismatch or "", "streamrl": self.streamrl, "sglang": self.sglang}


# --- reading the source --------------------------------------------------------------------------


def is_needed(rel: str, response_keys: Mapping[str, Sequence[str]]) -> bool:
    return (rel in (HTTP_SERVER, IO_STRUCT, SAMPLING, SERVER_ARGS) or rel in response_keys
            or (rel.startswith(ARG_GROUPS) and rel.endswith(".py")))


def read_wheel(wheel: Path, response_keys: Mapping[str, Sequence[str]] = protocol.RESPONSE_KEYS) -> dict[str, str]:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        sources = {name.removeprefix(SRT): archive.read(name).decode()
                   for name in names if name.startswith(SRT) and is_needed(name.removeprefix(SRT), response_keys)}
        contract = "sglang/api/v1/api_types.py"
        if contract in names:
            sources[API_CONTRACT] = archive.read(contract).decode()
        return sources


def read_tree(root: Path, response_keys: Mapping[str, Sequence[str]] = protocol.RESPONSE_KEYS) -> dict[str, str]:
    srt = root / SRT
    files = (path.relative_to(srt).as_posix() for path in srt.rglob("*.py"))
    sources = {rel: (srt / rel).read_text() for rel in files if is_needed(rel, response_keys)}
    if (srt / API_CONTRACT).is_file():
        sources[API_CONTRACT] = (srt / API_CONTRACT).read_text()
    return sources


def wheel_cache() -> Path:
    return Path(os.environ.get("STREAMRL_SGLANG_WHEELS", "~/.cache/streamrl/sglang")).expanduser()


def cached_wheel(version: str, cache: Path) -> Path | None:
    found = sorted(cache.glob(f"sglang-{version}-*.whl"))
    return found[0] if found else None


def fetch_wheel(version: str, cache: Path) -> Path:
    wheel = cached_wheel(version, cache)
    if wheel is None:
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", f"sglang=={version}", "-d", str(cache)],
                       check=True)
        wheel = cached_wheel(version, cache)
    if wheel is None:
        raise SystemExit(f"pip downloaded no sglang-{version}-*.whl into {cache}")
    return wheel


def parse(sources: Sources, rel: str) -> ast.Module:
    if rel not in sources:
        raise SystemExit(f"the sglang source has no sglang/srt/{rel}")
    return ast.parse(sources[rel], filename=rel)


def load_served(stand_in: Path) -> tuple[tuple[str, str], ...] | None:
    """The stand-in's `SERVED` (METHOD, path) pairs; None when the file or the constant is missing."""
    if not stand_in.is_file():
        return None
    spec = importlib.util.spec_from_file_location("streamrl_sglang_stand_in", stand_in)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return getattr(module, "SERVED", None)


# --- what the source declares --------------------------------------------------------------------


def constant_str(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def name_of(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return constant_str(node)  # a quoted annotation


def route_table(tree: ast.Module) -> RouteTable:
    """(METHOD, path) -> handler of every `@app.<verb>(path)` / `@app.api_route(path, methods=[...])`."""
    table: RouteTable = {}
    for function in ast.walk(tree):
        if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for decorator in function.decorator_list:
            if not (isinstance(decorator, ast.Call) and isinstance(decorator.func, ast.Attribute) and decorator.args):
                continue
            path, verb = constant_str(decorator.args[0]), decorator.func.attr
            if path is None:  # e.g. os.environ.get("SGLANG_OLLAMA_CHAT_ROUTE", "/api/chat")
                continue
            if verb in VERBS:
                methods = [verb.upper()]
            elif verb == "api_route":
                listed = next((k.value for k in decorator.keywords if k.arg == "methods"), None)
                methods = ["GET"] if listed is None else [m for m in map(constant_str, ast.walk(listed)) if m]
            else:
                continue
            for method in methods:
                table[(method.upper(), path)] = function
    return table


def annotated_class(annotation: ast.AST | None) -> str | None:
    """`Cls`, `Annotated[Cls, Body()]`, `Optional[Cls]`, `Cls | None` -> "Cls"."""
    if isinstance(annotation, ast.Subscript) and name_of(annotation.value) in ("Annotated", "A", "Optional"):
        inner = annotation.slice
        return annotated_class(inner.elts[0] if isinstance(inner, ast.Tuple) else inner)
    if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):
        none = isinstance(annotation.left, ast.Constant) and annotation.left.value is None
        return annotated_class(annotation.right if none else annotation.left)
    return None if annotation is None else name_of(annotation)


def body_class(handler: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    """The class the handler reads the body into: its first parameter annotated with a class (not Request,
    not a builtin such as a query's `float`)."""
    arguments = handler.args
    for argument in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs):
        cls = annotated_class(argument.annotation)
        if cls is not None and cls not in NOT_A_BODY:
            return cls
    return None


def class_fields(tree: ast.Module) -> dict[str, set[str]]:
    """Each top-level class's fields: its class-body annotations and those of its bases in the same file."""
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}

    def fields(name: str) -> set[str]:
        node = classes[name]
        own = {s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
        inherited = (fields(base) for base in map(name_of, node.bases) if base in classes and base != name)
        return own.union(*inherited)

    return {name: fields(name) for name in classes}


def sampling_keys(tree: ast.Module, cls: str = "SamplingParams") -> set[str]:
    """The class's fields, and its `__init__` arguments when it defines one."""
    node = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls), None)
    if node is None:
        raise SystemExit(f"no class {cls} in sglang/srt/{SAMPLING}")
    keys = {s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    for init in node.body:
        if isinstance(init, ast.FunctionDef) and init.name == "__init__":
            arguments = init.args
            keys |= {a.arg for a in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs)} - {"self"}
    return keys


def called_flags(tree: ast.Module) -> Iterator[str]:
    """`--flag` constants anywhere in a call's arguments: `add_argument("--x", ...)`, `Arg(aliases=["--y"])`."""
    for call in ast.walk(tree):
        if isinstance(call, ast.Call):
            for argument in (*call.args, *(k.value for k in call.keywords)):
                for node in ast.walk(argument):
                    text = constant_str(node)
                    if text is not None and FLAG.match(text):
                        yield text


def field_flags(cls: ast.ClassDef) -> Iterator[str]:
    """`--field-name` of each `name: A[T, "help"]` / `A[T, Arg(...)]` field, unless `no_cli=True`.

    As sglang's `arg_utils._unwrap_annotated`, the first string or `Arg(...)` of the metadata counts;
    an `Arg(cli_name="--x")` replaces the derived name (`called_flags` finds "--x")."""
    for statement in cls.body:
        if not (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)):
            continue
        annotation = statement.annotation
        if not (isinstance(annotation, ast.Subscript) and name_of(annotation.value) in ("A", "Annotated")
                and isinstance(annotation.slice, ast.Tuple)):
            continue
        metadata = [m for m in annotation.slice.elts[1:]
                    if constant_str(m) is not None or (isinstance(m, ast.Call) and name_of(m.func) == "Arg")]
        if not metadata:
            continue
        options = {k.arg: k.value for k in metadata[0].keywords} if isinstance(metadata[0], ast.Call) else {}
        no_cli = options.get("no_cli")
        if (isinstance(no_cli, ast.Constant) and no_cli.value is True) or "cli_name" in options:
            continue
        yield "--" + statement.target.id.replace("_", "-")


def launch_flags(sources: Sources) -> set[str]:
    flags: set[str] = set()
    for rel in sorted(sources):
        if rel != SERVER_ARGS and not rel.startswith(ARG_GROUPS):
            continue
        tree = parse(sources, rel)
        flags.update(called_flags(tree))
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and (rel.startswith(ARG_FIELDS) or node.name == "ServerArgs"):
                flags.update(field_flags(node))
    return flags


def string_constants(tree: ast.Module) -> set[str]:
    return {text for text in map(constant_str, ast.walk(tree)) if text is not None}


# --- the checks ----------------------------------------------------------------------------------


def closest(word: str, candidates: Iterable[str]) -> str:
    matches = difflib.get_close_matches(word, sorted(candidates), n=2)
    return f"; closest: {', '.join(matches)}" if matches else ""


def check_routes(table: RouteTable, classes: Mapping[str, set[str]],
                 routes: Sequence[protocol.Route] = protocol.ROUTES) -> list[Finding]:
    findings = []
    paths = {path for _, path in table}
    for route in routes:
        call = f"{route.method} {route.path}"
        handler = table.get((route.method, route.path))
        if route.path not in paths:
            findings.append(Finding("route", call, "route", "no such route" + closest(route.path, paths)))
        elif handler is None:
            methods = sorted(method for method, path in table if path == route.path)
            findings.append(Finding("route", call, "method", f"{route.path} answers {', '.join(methods)}"))
        elif route.request is not None and body_class(handler) != route.request:
            findings.append(Finding("route", call, "request",
                                    f"{handler.name} reads the body into {body_class(handler) or 'no class'}"))
        else:
            findings.append(Finding("route", call))
        for field in route.fields:
            used = f"{route.request}.{field}"
            if route.request not in classes:
                findings.append(Finding("field", used, "field", f"no class {route.request} in {IO_STRUCT}"
                                        + closest(str(route.request), classes)))
            elif field not in classes[route.request]:
                have = classes[route.request]
                findings.append(Finding("field", used, "field",
                                        f"no such field{closest(field, have)}; fields: {', '.join(sorted(have))}"))
            else:
                findings.append(Finding("field", used))
    return findings


def check_present(kind: str, wanted: Iterable[str], have: set[str], where: str) -> list[Finding]:
    return [Finding(kind, item) if item in have else Finding(kind, item, kind, f"not in {where}" + closest(item, have))
            for item in wanted]


def check_response_keys(sources: Sources,
                        response_keys: Mapping[str, Sequence[str]] = protocol.RESPONSE_KEYS) -> list[Finding]:
    findings = []
    for rel, keys in response_keys.items():
        if rel not in sources:
            findings += [Finding("response_key", f"{rel}: {key}", "response_key", f"no file {rel}") for key in keys]
            continue
        have = string_constants(parse(sources, rel))
        findings += [Finding("response_key", f"{rel}: {key}") if key in have else
                     Finding("response_key", f"{rel}: {key}", "response_key",
                             "not a string constant there" + closest(key, have)) for key in keys]
    return findings


def check_stand_in(table: RouteTable, served: Sequence[tuple[str, str]] | None, stand_in: str) -> list[Finding]:
    if served is None:
        return [Finding("stand_in", f"{stand_in}: SERVED", "stand_in_route", "the stand-in declares no SERVED")]
    routes = [protocol.Route(method, path, None) for method, path in served if not path.startswith("/fake/")]
    return [Finding("stand_in_route", f.streamrl, f.mismatch and "stand_in_route", f.sglang)
            for f in check_routes(table, {}, routes)]


def check_api_contract(sources: Sources, routes: Sequence[protocol.Route], sampling: Sequence[str]) -> list[Finding]:
    """The `/generate` body and its sampling keys against the JSON contract it is validated by, if any."""
    if API_CONTRACT not in sources:
        return []  # before 0.5.22
    classes = class_fields(parse(sources, API_CONTRACT))
    generate = next((r for r in routes if r.path == "/generate"), None)
    fields = [f"GenerateRequest.{name}" for name in (generate.fields if generate else ())]
    have = {f"GenerateRequest.{name}" for name in classes.get("GenerateRequest", set())}
    return [*check_present("field", fields, have, "sglang.api.v1.GenerateRequest"),
            *check_present("sampling_key", sampling, classes.get("SamplingParams", set()),
                           "sglang.api.v1.SamplingParams (unknown keys rejected)")]


def conformance(sources: Sources, served: Sequence[tuple[str, str]] | None, stand_in: str = "tests/fake_sglang.py",
                routes: Sequence[protocol.Route] = protocol.ROUTES,
                sampling: Sequence[str] = protocol.SAMPLING_KEYS,
                flags: Sequence[str] = protocol.LAUNCH_FLAGS,
                response_keys: Mapping[str, Sequence[str]] = protocol.RESPONSE_KEYS) -> list[Finding]:
    """One finding per item checked, against the source's files (paths under sglang/srt/)."""
    table = route_table(parse(sources, HTTP_SERVER))
    return [*check_routes(table, class_fields(parse(sources, IO_STRUCT)), routes),
            *check_present("sampling_key", sampling, sampling_keys(parse(sources, SAMPLING)), "SamplingParams"),
            *check_api_contract(sources, routes, sampling),
            *check_present("flag", flags, launch_flags(sources), "server_args.py / arg_groups"),
            *check_response_keys(sources, response_keys),
            *check_stand_in(table, served, stand_in)]


def report(findings: Sequence[Finding], version: str, source: str) -> dict:
    counts = {name: sum(f.kind == kind for f in findings) for kind, name in COUNTS.items()}
    return {"sglang_version": version, "source": source, "requirement": protocol.REQUIREMENT, **counts,
            "mismatches": [f.as_mismatch() for f in findings if f.mismatch is not None]}


def print_table(findings: Sequence[Finding], result: dict) -> None:
    for f in findings:
        verdict = "ok" if f.mismatch is None else f"MISMATCH ({f.mismatch}): {f.sglang}"
        print(f"{f.kind:<15} {f.streamrl:<62} {verdict[:140]}")
    counts = ", ".join(f"{result[name]} {name.removesuffix('_checked').replace('_', ' ')}" for name in COUNTS.values())
    print(f"sglang {result['sglang_version']} ({result['source']}): checked {counts}; "
          f"{len(result['mismatches'])} mismatches")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--version", default="0.5.23", help="the sglang release whose wheel is read")
    parser.add_argument("--wheel", type=Path, help="read this wheel instead of the cached/downloaded one")
    parser.add_argument("--source", type=Path, help="read an unpacked tree holding sglang/srt/ instead of a wheel")
    parser.add_argument("--stand-in", type=Path, default=ROOT / "tests" / "fake_sglang.py")
    parser.add_argument("--out", type=Path, required=True, help="the JSON report")
    args = parser.parse_args(argv)

    if args.source is not None:
        sources, origin, version = read_tree(args.source), str(args.source), args.version
    else:
        wheel = args.wheel or fetch_wheel(args.version, wheel_cache())
        sources, origin, version = read_wheel(wheel), str(wheel), wheel.name.split("-")[1]
    findings = conformance(sources, load_served(args.stand_in), str(args.stand_in))
    result = report(findings, version, origin)
    print_table(findings, result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 1 if result["mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())
