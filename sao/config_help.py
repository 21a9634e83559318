"""`sao config`: every configuration key with its type, default and description, the registered
algorithms and environments, and each environment's `env.options`.

Generated from the pydantic models and the registries, so it cannot drift from what `load_config`
accepts.
"""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined, to_jsonable_python

from sao.config import Config, _flow


def type_name(annotation: Any) -> str:
    """`int`, `str | None`, `llama|qwen2` (a Literal), `dict[str, Any]`."""
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return "|".join(str(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return "None"
    if origin is not None:
        return str(annotation).replace("typing.", "")
    return getattr(annotation, "__name__", str(annotation))


def _default(field) -> str:
    if field.default is not PydanticUndefined:
        value = field.default
    elif field.default_factory is not None:
        value = field.default_factory()
    else:
        return "(required)"
    return _flow(to_jsonable_python(value, fallback=str))


def _rows(model: type[BaseModel], prefix: str) -> list[tuple[str, str, str, str]]:
    rows = []
    for name, f in model.model_fields.items():
        if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel):  # a nested section
            rows += _rows(f.annotation, f"{prefix}{name}.")
        else:
            rows.append((f"{prefix}{name}", type_name(f.annotation), _default(f), f.description or ""))
    return rows


def field_lines(model: type[BaseModel], prefix: str) -> list[str]:
    rows = _rows(model, prefix)
    if not rows:
        return []
    w_key = max(len(r[0]) for r in rows)
    w_type = max(len(r[1]) for r in rows)
    return [f"  {k:<{w_key}}  {t:<{w_type}}  = {d:<8}  {desc}" for k, t, d, desc in rows]


def describe(prefix: str = "") -> str:
    """The whole reference as text; `prefix` (e.g. `algo` or `env.options`) keeps only matching keys."""
    from sao.algo.registry import ALGORITHMS
    from sao.envs.base import _REGISTRY as ENVIRONMENTS

    out: list[str] = []
    for name, field in Config.model_fields.items():
        lines = field_lines(field.annotation, f"{name}.")
        if f"{name}.".startswith(prefix) or name.startswith(prefix):
            out += [f"{name}:  {field.annotation.__doc__ or ''}".rstrip(), *lines, ""]
    if not prefix or "algo.name".startswith(prefix) or prefix == "algo":
        out.append("algorithms (algo.name):")
        out += [f"  {a.name:<16} {a.doc}" for a in ALGORITHMS.values()] + [""]
    if not prefix or prefix.startswith("env"):
        out.append("environments (env.name; or module:Class), with their env.options:")
        for env_name, cls in ENVIRONMENTS.items():
            doc = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
            out.append(f"  {env_name}: {doc}")
            options = getattr(cls, "Options", None)
            if options is not None:
                out += ["  " + line for line in field_lines(options, "env.options.")]
        out.append("")
    if not out:
        return f"no configuration key starts with {prefix!r}\n"
    out.append("Set keys in a YAML file (sections as above; examples/configs/) and/or as key=value overrides, "
               "e.g. sao train examples/configs/code.yaml train.steps=100")
    return "\n".join(out) + "\n"
