"""Static security scan of terraform/ with checkov, from its own venv (.venv-checkov).

Checkov's bc-python-hcl2 installs a module named ``hcl2`` that clashes with python-hcl2, so it
lives in a venv of its own, made by ``make .venv-checkov`` (CI does it). Only checks skipped in the
code with a written reason (``# checkov:skip=ID: reason``) may fail.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from ..helpers import REPO
from .hcl import TERRAFORM

CHECKOV = REPO / ".venv-checkov" / "bin" / "checkov"


def test_checkov_finds_no_failed_checks():
    if not CHECKOV.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{CHECKOV} is missing in CI: run `make .venv-checkov` first")
        pytest.skip(f"{CHECKOV} not found: run `make .venv-checkov` to create checkov's own venv")
    # --skip-download: no call to the Prisma Cloud API (no network here); SKIP_PACKAGE_UPDATE_CHECK:
    # no registry call at import.
    env = {**os.environ, "SKIP_PACKAGE_UPDATE_CHECK": "true"}
    proc = subprocess.run(
        [str(CHECKOV), "-d", str(TERRAFORM), "--framework", "terraform", "--quiet", "--compact", "--skip-download"],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    counts = re.search(r"Passed checks: (\d+), Failed checks: (\d+), Skipped checks: (\d+)", proc.stdout)
    assert counts, proc.stdout
    passed, failed, skipped = map(int, counts.groups())
    assert failed == 0 and passed > 50, proc.stdout


def test_every_checkov_skip_has_a_written_reason():
    skips = [
        (p.name, m.group(0))
        for p in TERRAFORM.rglob("*.tf")
        for m in re.finditer(r"checkov:skip=[^\n]*", p.read_text())
    ]
    assert skips
    for where, skip in skips:
        assert re.fullmatch(r"checkov:skip=CKV2?_[A-Z]+_\d+: \S.{20,}", skip), (where, skip)
