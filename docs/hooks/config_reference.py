"""mkdocs hook: the configuration reference, generated from the config models at build time.

`docs/configuration.md` holds the marker below; every field of `streamrl.config.RunConfig` (nested
sections included) becomes a row with its type, default and the docstring written under it, so the
page cannot drift from the code. `streamrl` must be importable where `mkdocs build` runs.
"""

from __future__ import annotations

import enum
import json
import typing
from collections.abc import Iterator

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

MARKER = "<!-- config-reference -->"


def _type_name(annotation: object) -> str:
    if isinstance(annotation, type):
        return annotation.__name__
    text = str(annotation).replace("typing.", "").replace("NoneType", "None")
    # no "|" inside a table cell: Markdown tables split on it even in code spans
    return text.replace("Literal", "one of ").replace(" | ", " or ")


def _default(field) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return "(section)"
    if isinstance(value, enum.Enum):
        value = value.value
    try:
        return json.dumps(value)
    except TypeError:
        return str(value)


def _section_model(annotation: object) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def fields(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, str, str, str]]:
    """(dotted name, type, default, description) for every leaf field, sections depth first."""
    for name, field in model.model_fields.items():
        dotted = f"{prefix}{name}"
        section = _section_model(field.annotation)
        if section is not None and field.annotation is section:
            yield from fields(section, dotted + ".")
            continue
        description = " ".join((field.description or "").split())
        yield dotted, _type_name(field.annotation), _default(field), description


def _flat(tree: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def reference() -> str:
    from streamrl.config import RunConfig

    out: list[str] = []
    section = None
    run_defaults = _flat(RunConfig().model_dump(mode="json"))  # a run's section defaults may differ from its class's
    for dotted, kind, default, description in fields(RunConfig):
        default = json.dumps(run_defaults[dotted]) if dotted in run_defaults else default
        head = dotted.split(".")[0]
        if head != section:
            section = head
            out += ["", f"### `[{head}]`", "", "| field | type | default | what it does |", "|---|---|---|---|"]
        cell = description.replace("|", "\\|") or "—"
        out.append(f"| `{dotted}` | `{kind}` | `{default}` | {cell} |")
    return "\n".join(out).strip() + "\n"


def on_page_markdown(markdown: str, page, config, files) -> str:  # mkdocs' hook signature
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, reference())
