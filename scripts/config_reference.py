"""Write docs/config-reference.md from the config models (stages/config/): every key with its
type, default and description, and every registered selector's parameters. tests/test_docs.py
checks that the page is current; run `python scripts/config_reference.py` after changing a field."""

from __future__ import annotations

import json
import sys
import types
import typing
from pathlib import Path

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "config-reference.md"

HEADER = """# Configuration reference

Generated from the config models in `stages/config/` (`python scripts/config_reference.py`; a test
checks that this page is current). Every key with its type, its default ("required" where it has
none) and its description; `<name>` stands for a key you choose (a dataset, a size, a method). Which
values are ours rather than a paper's is marked at the value, in the config files: `grep -n '# ours:'
config/paper.yaml` ([configurations.md](configurations.md) lists them).
"""


def type_name(annotation) -> str:
    """A readable type: `int | None`, `list[str]`, `"hf" | "vllm"` (constraints left out)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is type(None):
        return "None"
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(type_name(a) for a in args)}]"
    return annotation.__name__ if isinstance(annotation, type) else str(annotation)


def default_text(field) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "required"
    value = field.default_factory() if field.default_factory is not None else field.default
    if isinstance(value, BaseModel):
        return "(section)"
    try:
        return json.dumps(value, ensure_ascii=False)
    except TypeError:
        return str(value)


def models_in(annotation) -> list[tuple[str, type[BaseModel]]]:
    """(path suffix, model) for the models a field holds: itself, a dict's values, a union's arms."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [("", annotation)]
    if origin is dict:
        return [(".<name>" + s, m) for s, m in models_in(args[1])]
    if origin in (typing.Union, types.UnionType) or origin is typing.Annotated:
        return [pair for arg in args for pair in models_in(arg)]
    return []


def cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def collect(model: type[BaseModel], path: str, found: dict) -> None:
    """{model: [paths]} in the order a reader meets them; a model used in several places once."""
    if model in found:
        found[model].append(path)
        return
    found[model] = [path]
    for name, field in model.model_fields.items():
        full = f"{path}.{name}" if path else name
        for suffix, sub in models_in(field.annotation):
            collect(sub, full + suffix, found)


def own_first(model: type[BaseModel]) -> list:
    """(name, field) of a model's keys: its own first, then those a base section gives it (a
    source's `kind` and dataset before the adapter settings every source shares)."""
    own = model.__dict__.get("__annotations__", {})
    fields = list(model.model_fields.items())
    return [f for f in fields if f[0] in own] + [f for f in fields if f[0] not in own]


def section(model: type[BaseModel], paths: list[str]) -> list[str]:
    title = ", ".join(f"`{p}`" for p in paths) if paths != [""] else "Top level"
    doc = (model.__doc__ or "").strip().split("\n\n")[0]
    rows = [f"## {title}", "", f"{cell(doc)} (`{model.__name__}`)", "",
            "| key | type | default | description |", "| --- | --- | --- | --- |"]
    for name, field in own_first(model):
        rows.append(f"| `{name}` | `{cell(type_name(field.annotation))}` | `{cell(default_text(field))}` "
                    f"| {cell(field.description or '')} |")
    return [*rows, ""]


def render() -> str:
    from stages.config import Config
    from stages.core.training.selectors import SELECTORS

    out = [HEADER]
    found: dict = {}
    collect(Config, "", found)
    titles = [tuple(paths) for paths in found.values()]
    for model, paths in found.items():
        rows = section(model, paths)
        if titles.count(tuple(paths)) > 1:  # a union's arms: one heading each
            rows[0] += f" ({model.__name__})"
        out += rows
    out += ["## Selector parameters (`methods.<name>`, beside `selector`)", "",
            "Each registered selector's own keys (`stages/core/training/selectors.py`), validated against its "
            "parameter model.", "", "| selector | key | type | default | description |",
            "| --- | --- | --- | --- | --- |"]
    built_in = [n for n in sorted(SELECTORS) if SELECTORS[n].fn.__module__.startswith("stages.")]
    for name in built_in:  # not a user's (selector_modules), which another test may have registered
        fields = SELECTORS[name].params.model_fields
        if not fields:
            out.append(f"| `{name}` | — | | | |")
        for key, field in fields.items():
            out.append(f"| `{name}` | `{key}` | `{cell(type_name(field.annotation))}` | "
                       f"`{cell(default_text(field))}` | {cell(field.description or '')} |")
    return "\n".join(out).rstrip("\n") + "\n"


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    PAGE.write_text(render())
    print(f"wrote {PAGE.relative_to(ROOT)}")
