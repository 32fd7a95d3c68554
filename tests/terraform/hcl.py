"""Reading the Terraform modules as data (python-hcl2 >= 8) for the checks in this folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hcl2
from hcl2 import SerializationOptions

from ..helpers import REPO

TERRAFORM = REPO / "terraform"
TEMPLATE = TERRAFORM / "bootstrap" / "spotguard-bootstrap.sh.tftpl"
_OPTIONS = SerializationOptions(strip_string_quotes=True, explicit_blocks=False, with_comments=False)


def _unwrap(value: Any) -> Any:
    """python-hcl2 gives every nested block as a list; a block that occurs once becomes its body."""
    if isinstance(value, dict):
        return {k: _unwrap(v) for k, v in value.items()}
    if isinstance(value, list):
        items = [_unwrap(v) for v in value]
        return items[0] if len(items) == 1 and isinstance(items[0], dict) else items
    return value


def load_module(path: Path) -> dict[str, list[Any]]:
    """All top-level blocks of a module's .tf files, merged by kind (resource, data, locals ...)."""
    merged: dict[str, list[Any]] = {}
    for tf in sorted(path.glob("*.tf")):
        with open(tf) as f:
            for kind, top in hcl2.load(f, serialization_options=_OPTIONS).items():
                merged.setdefault(kind, []).extend(
                    {name: _unwrap(body) for name, body in block.items()} for block in top
                )
    return merged


def blocks(module: dict[str, list[Any]], kind: str, type_: str) -> dict[str, dict[str, Any]]:
    """``{name: body}`` of every ``resource``/``data`` block of one type."""
    out: dict[str, dict[str, Any]] = {}
    for block in module.get(kind, []):
        for name, body in block.get(type_, {}).items():
            out[name] = body
    return out


def one(module: dict[str, list[Any]], type_: str, kind: str = "resource") -> dict[str, Any]:
    found = blocks(module, kind, type_)
    assert len(found) == 1, f"expected exactly one {type_}, found {sorted(found)}"
    return next(iter(found.values()))


def local(module: dict[str, list[Any]], name: str) -> Any:
    for block in module.get("locals", []):
        if name in block:
            return block[name]
    raise KeyError(name)


def variables(module: dict[str, list[Any]]) -> dict[str, dict[str, Any]]:
    return {name: body for block in module.get("variable", []) for name, body in block.items()}
