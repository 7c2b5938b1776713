"""Loading a config: the YAML file, the user's selector modules, and validation into one
ConfigError that names the file and the dotted key of each problem."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from .base import ConfigError, FieldError, RefError, digest
from .schema import Config


def import_selector_modules(names: list, source: str) -> None:
    """Import the config's selector_modules (dotted names or .py files) so their selectors register."""
    import importlib
    import importlib.util
    import sys

    for i, name in enumerate(names):
        key = f"{source}: selector_modules.{i}"
        if not isinstance(name, str):
            raise ConfigError(f"invalid config\n  {key}: a module name or .py path, got {name!r}")
        try:
            if name.endswith(".py"):
                path = Path(name).resolve()
                mod_name = "ict_rlvr_selectors_" + digest(str(path))
                if mod_name in sys.modules:
                    continue
                spec = importlib.util.spec_from_file_location(mod_name, path)
                if spec is None or not path.exists():
                    raise FileNotFoundError(f"no file {path}")
                module = importlib.util.module_from_spec(spec)
                sys.modules[mod_name] = module
                try:
                    spec.loader.exec_module(module)
                except BaseException:
                    del sys.modules[mod_name]
                    raise
            else:
                importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 - any import failure is a config error here
            raise ConfigError(f"invalid config\n  {key}: cannot import {name!r}: "
                              f"{type(err).__name__}: {err}") from None


def validate(raw: Any, source: str) -> Config:
    """Validate a raw mapping; ConfigError names `source` and the dotted key of each problem."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the config must be a mapping, got {type(raw).__name__}")
    modules = raw.get("selector_modules") or []
    import_selector_modules(modules if isinstance(modules, list) else [modules], source)
    try:
        return Config.model_validate(raw)
    except ValidationError as err:
        lines = []
        for e in err.errors():
            key = ".".join(str(p) for p in e["loc"] if not _is_union_tag(p)) or "(top level)"
            ctx = e.get("ctx", {}).get("error")
            if isinstance(ctx, RefError):
                key, msg = ctx.key, ctx.message
            elif isinstance(ctx, FieldError):
                key, msg = f"{key}.{ctx.field}" if key != "(top level)" else ctx.field, ctx.message
            else:
                msg = e["msg"].removeprefix("Value error, ")
                if e["type"] == "extra_forbidden":
                    msg = "unknown key"
            lines.append(f"{source}: {key}: {msg}")
        raise ConfigError("invalid config\n  " + "\n  ".join(lines)) from None


def _is_union_tag(part: Any) -> bool:
    # pydantic puts the discriminator value in the location of tagged-union errors
    return part in ("generated", "hub", "local")


def load_yaml(path: str | Path) -> Any:
    path = Path(path)
    try:
        return yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None


def load_config(path: str | Path) -> Config:
    """Read and validate a config file."""
    return validate(load_yaml(path), str(path))


def merge(base: dict, over: dict) -> dict:
    """`over` laid on `base` as Snakemake lays a later --configfile on an earlier one
    (snakemake.utils.update_config): mappings merge key by key, anything else is replaced."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def load_configs(paths: list[str | Path]) -> Config:
    """Read config files, each laid on the ones before it (Snakemake's `--configfile A B`), and
    validate the result; errors name the files."""
    raw: dict = {}
    for path in paths:
        layer = load_yaml(path)
        if layer is None:
            continue
        if not isinstance(layer, dict):
            raise ConfigError(f"{path}: the config must be a mapping, got {type(layer).__name__}")
        raw = merge(raw, layer)
    return validate(raw, source_of(paths))


def source_of(paths: list[str | Path]) -> str:
    """How errors name a config made of several files: 'A + B'."""
    return " + ".join(map(str, paths))
