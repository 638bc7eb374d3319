"""benchmarks/sglang_conformance.py: the parser on a tiny synthetic sglang tree (always), and the real
wheels of the supported versions (when cached in `$STREAMRL_SGLANG_WHEELS`, default ~/.cache/streamrl/sglang)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
from checkout import FAKE_SGLANG, ROOT

from streamrl.sglang import protocol
from streamrl.sglang.protocol import Route

SCRIPT = ROOT / "benchmarks" / "sglang_conformance.py"
STAND_IN = FAKE_SGLANG


def load_script():
    spec = importlib.util.spec_from_file_location("sglang_conformance", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


conformance = load_script()

TINY = {
    "entrypoints/http_server.py": """
        import os
        from typing import Annotated, Optional

        @app.api_route("/generate", methods=["POST", "PUT"])
        async def generate_request(obj: GenerateReqInput, request: Request):
            return {"version": "x"}

        @app.post("/abort_request")
        async def abort_request(obj: Annotated[AbortReq, Body()], request: Request):
            pass

        @app.get("/health")
        @app.get("/health_generate")
        async def health_generate(request: Request):
            pass

        @app.api_route("/flush_cache", methods=["GET", "POST"])
        async def flush_cache(timeout: float = 0.0):
            pass

        @app.post("/pause_generation")
        def pause_generation(obj: Annotated[Optional[ContinueGenerationReqInput], Body()] = None):
            pass

        @app.post(os.environ.get("SGLANG_OLLAMA_CHAT_ROUTE", "/api/chat"))
        async def ollama_chat(request: Request):
            pass
    """,
    "managers/io_struct.py": """
        class BaseReq(msgspec.Struct, kw_only=True):
            rid: Optional[str] = None

        @dataclass
        class GenerateReqInput:
            input_ids: Optional[List[int]] = None
            sampling_params: Optional[dict] = None

        class AbortReq(BaseReq, kw_only=True):
            abort_all: bool = False

        class PauseGenerationReqInput(BaseReq, kw_only=True):
            mode: str = "abort"

        class ContinueGenerationReqInput(BaseReq, kw_only=True):
            pass
    """,
    "sampling/sampling_params.py": """
        class SamplingParams:
            max_new_tokens: int = 128

            def __init__(self, temperature: float = 1.0, *, top_p: float = 1.0):
                self.top_k = -1
    """,
    "server_args.py": """
        class ServerArgs:
            host: A[str, "The host of the HTTP server."] = "127.0.0.1"

            @staticmethod
            def add_cli_args(parser):
                parser.add_argument("--model-path", type=str)
                parser.add_argument("--tp-size", "--tensor-parallel-size", type=int, help="--not-a-flag here")
    """,
    "arg_groups/fields/serving.py": """
        class Serving(msgspec.Struct):
            port: A[int, Arg(help="The port.")] = 30000
            secret: A[bool, Arg(no_cli=True)] = False
            plain: int = 0
            renamed: A[str, Arg(cli_name="--other-name", aliases=["--alias-name"])] = ""
            first_wins: A[bool, "help", Arg(no_cli=True)] = False  # as sglang: the first counts
    """,
}
TINY_ROUTES = (
    Route("POST", "/generate", "GenerateReqInput", ("input_ids", "rid")),  # rid: not a field of GenerateReqInput
    Route("POST", "/abort_request", "AbortReq", ("rid", "abort_all")),  # rid from BaseReq
    Route("GET", "/health_generate", None),
    Route("POST", "/health", None),  # GET only
    Route("POST", "/begin_weight_update", "BeginWeightUpdateReqInput"),  # no such route
    Route("POST", "/pause_generation", "PauseGenerationReqInput", ("mode",)),  # the handler reads another class
    Route("POST", "/flush_cache", None),
    Route("POST", "/api/chat", None),  # its path is not a constant: not in the table
)
TINY_FLAGS = ("--model-path", "--tensor-parallel-size", "--host", "--port", "--secret", "--plain", "--other-name",
              "--alias-name", "--renamed", "--first-wins", "--not-a-flag")
TINY_SERVED = (("POST", "/generate"), ("GET", "/fake/calls"), ("POST", "/model_info"), ("GET", "/flush_cache"))


def write_tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / "sglang" / "srt" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def write_stand_in(path: Path, served: tuple[tuple[str, str], ...]) -> Path:
    path.write_text(f'"""A stand-in."""\n\nSERVED = {served!r}\n\nif __name__ == "__main__":\n    raise SystemExit(1)\n')
    return path


def test_a_tiny_tree_yields_exactly_its_mismatches(tmp_path):
    write_tree(tmp_path, TINY)
    sources = conformance.read_tree(tmp_path, {"entrypoints/http_server.py": ()})
    served = conformance.load_served(write_stand_in(tmp_path / "stand_in.py", TINY_SERVED))
    assert served == TINY_SERVED
    findings = conformance.conformance(
        sources, served, routes=TINY_ROUTES, sampling=("max_new_tokens", "temperature", "top_p", "top_k"),
        flags=TINY_FLAGS, response_keys={"entrypoints/http_server.py": ("version", "weight_version")})
    result = conformance.report(findings, "tiny", str(tmp_path))

    assert {(m["what"], m["streamrl"]) for m in result["mismatches"]} == {
        ("field", "GenerateReqInput.rid"),
        ("method", "POST /health"),
        ("route", "POST /begin_weight_update"),
        ("request", "POST /pause_generation"),
        ("route", "POST /api/chat"),
        ("sampling_key", "top_k"),
        ("flag", "--secret"), ("flag", "--plain"), ("flag", "--renamed"), ("flag", "--not-a-flag"),
        ("response_key", "entrypoints/http_server.py: weight_version"),
        ("stand_in_route", "POST /model_info"),
    }
    assert len(result["mismatches"]) == 12
    assert (result["calls_checked"], result["fields_checked"], result["flags_checked"], result["sampling_keys_checked"],
            result["response_keys_checked"], result["stand_in_routes_checked"]) == (8, 5, 11, 4, 2, 3)
    by_item = {m["streamrl"]: m["sglang"] for m in result["mismatches"]}
    assert "closest: /abort_request" not in by_item["POST /begin_weight_update"]
    assert by_item["POST /health"] == "/health answers GET"
    assert by_item["POST /pause_generation"] == "pause_generation reads the body into ContinueGenerationReqInput"
    assert by_item["GenerateReqInput.rid"] == "no such field; fields: input_ids, sampling_params"


def test_the_tiny_route_table_reads_every_decorator(tmp_path):
    write_tree(tmp_path, TINY)
    table = conformance.route_table(conformance.parse(conformance.read_tree(tmp_path), "entrypoints/http_server.py"))
    assert sorted(table) == [("GET", "/flush_cache"), ("GET", "/health"), ("GET", "/health_generate"),
                             ("POST", "/abort_request"), ("POST", "/flush_cache"), ("POST", "/generate"),
                             ("POST", "/pause_generation"), ("PUT", "/generate")]
    assert table[("GET", "/health")] is table[("GET", "/health_generate")]
    assert conformance.body_class(table[("GET", "/flush_cache")]) is None  # `timeout: float` is a query


def test_a_missing_stand_in_is_a_mismatch(tmp_path):
    write_tree(tmp_path, TINY)
    assert conformance.load_served(tmp_path / "absent.py") is None
    findings = conformance.check_stand_in({}, None, "absent.py")
    assert [f.as_mismatch() for f in findings] == [
        {"what": "stand_in_route", "streamrl": "absent.py: SERVED", "sglang": "the stand-in declares no SERVED"}]


def cached_wheel(version: str) -> Path:
    wheel = conformance.cached_wheel(version, conformance.wheel_cache())
    if wheel is None:
        pytest.skip(f"no sglang-{version}-*.whl in {conformance.wheel_cache()} (run "
                    f"`python benchmarks/sglang_conformance.py --version {version} --out F` once to download it)")
    return wheel


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("version", ["0.5.21", "0.5.23"])
def test_the_pinned_sglang_conforms(tmp_path, version):
    cached_wheel(version)
    out = tmp_path / "x.json"
    done = run_script("--version", version, "--out", str(out))
    result = json.loads(out.read_text())
    assert result["mismatches"] == [], done.stdout
    assert done.returncode == 0
    assert result["sglang_version"] == version and result["requirement"] == protocol.REQUIREMENT
    assert result["calls_checked"] == len(protocol.ROUTES)
    # from 0.5.22 the /generate body and its sampling keys are also checked against sglang.api.v1's contract
    contract = protocol.parse_version(version) >= (0, 5, 22)
    generate_fields = len(protocol.route("/generate").fields)
    assert result["fields_checked"] == sum(len(r.fields) for r in protocol.ROUTES) + contract * generate_fields
    assert result["flags_checked"] == len(protocol.LAUNCH_FLAGS)
    assert result["sampling_keys_checked"] == len(protocol.SAMPLING_KEYS) * (1 + contract)
    assert result["response_keys_checked"] == sum(map(len, protocol.RESPONSE_KEYS.values()))
    assert result["stand_in_routes_checked"] > 0


def extract_source(wheel: Path, root: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            rel = name.removeprefix("sglang/srt/")
            if name.startswith("sglang/srt/") and conformance.is_needed(rel, protocol.RESPONSE_KEYS):
                archive.extract(name, root)


def mutate(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert text.count(old) == 1, f"{old!r} is not in {path} exactly once"
    path.write_text(text.replace(old, new))


def test_a_renamed_route_or_field_is_caught(tmp_path):
    extract_source(cached_wheel("0.5.23"), tmp_path)
    srt = tmp_path / "sglang" / "srt"
    mutate(srt / "entrypoints/http_server.py", '"/begin_weight_update"', '"/start_weight_update"')
    mutate(srt / "managers/io_struct.py", "class DestroyWeightsUpdateGroupReqInput(BaseReq, kw_only=True):\n    group_name:",
           "class DestroyWeightsUpdateGroupReqInput(BaseReq, kw_only=True):\n    group:")
    mutate(srt / "arg_groups/fields/serving.py", "    skip_tokenizer_init: A[", "    skip_tokenizer: A[")
    served = conformance.load_served(STAND_IN)  # the stand-in's own, once it declares one
    stand_in = STAND_IN if served is not None else write_stand_in(
        tmp_path / "stand_in.py", tuple((r.method, r.path) for r in protocol.ROUTES))
    served = conformance.load_served(stand_in)

    out = tmp_path / "x.json"
    done = run_script("--source", str(tmp_path), "--stand-in", str(stand_in), "--out", str(out))
    assert done.returncode == 1, done.stdout + done.stderr
    mismatches = json.loads(out.read_text())["mismatches"]
    expected = [("route", "POST /begin_weight_update", "/start_weight_update"),
                ("field", "DestroyWeightsUpdateGroupReqInput.group_name", "closest: group"),
                ("flag", "--skip-tokenizer-init", "closest: --skip-tokenizer")]
    if ("POST", "/begin_weight_update") in served:
        expected.append(("stand_in_route", "POST /begin_weight_update", "/start_weight_update"))
    assert [(m["what"], m["streamrl"]) for m in mismatches] == [(what, used) for what, used, _ in expected]
    for mismatch, (_, _, named) in zip(mismatches, expected):
        assert named in mismatch["sglang"]  # the renamed thing is named as the closest


def test_the_gpu_extra_pins_the_versions_the_protocol_was_read_against():
    import tomllib

    from streamrl.sglang import protocol

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert protocol.REQUIREMENT in extras["gpu"]
    lowest, refused = protocol.SUPPORTED
    assert protocol.REQUIREMENT == f"sglang>={'.'.join(map(str, lowest))},<{'.'.join(map(str, refused[:2]))}"
