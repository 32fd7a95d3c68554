"""How every command answers: a line of text, or with ``--json`` one JSON document per result."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from spotguard import redact


def report(args: argparse.Namespace, text: str, doc: dict[str, Any]) -> None:
    """One result: ``doc`` as a JSON line with ``--json``, else ``text``."""
    print(json.dumps(doc) if getattr(args, "json", False) else text)


def fail(args: argparse.Namespace, message: str, code: int = 1, **fields: object) -> int:
    """An error result: the message (credentials masked) on stderr and, with ``--json``, as a document on stdout."""
    message = redact.redact(message, redact.secret_values())
    print(f"spotguard: {message}", file=sys.stderr)
    if getattr(args, "json", False):
        print(json.dumps({"error": message, "exit_code": code, **fields}))
    return code
