"""The subcommands' options dataclasses filled from their parsed arguments (``_args.options_from``): every
option given reaches its field, under its own name or a renamed one."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from spotguard.ops.cli import build_parser, rehearse, run
from spotguard.ops.cli._args import options_from
from spotguard.ops.supervisor import SupervisorOptions


def test_spotguard_run_fills_every_option_it_parses():
    args = build_parser().parse_args(
        [
            *("run", "-v", "--storage", "s3://b/p", "--local-dir", "/l", "--max-restarts", "7", "--hang-timeout", "9"),
            *("--startup-timeout", "11", "--backoff", "0.5", "--backoff-max", "4", "--grace", "3", "--json"),
            *("--takeover", "--", "python", "train.py", "--steps", "5"),
        ]
    )
    o = run.options(args)
    assert o.command == ["python", "train.py", "--steps", "5"]
    assert (o.storage, o.local_dir, o.max_restarts, o.hang_timeout) == ("s3://b/p", "/l", 7, 9.0)
    assert (o.startup_timeout, o.backoff, o.backoff_max, o.grace) == (11.0, 0.5, 4.0, 3.0)
    assert o.stdout_to_stderr is True and o.takeover is True
    assert o.backoff_factor == SupervisorOptions(["x"]).backoff_factor  # not a CLI option: its default


def test_spotguard_rehearse_fills_its_renamed_options():
    args = build_parser().parse_args(
        [
            *("rehearse", "-vv", "-n", "3", "--mtbf", "2.5", "--seed", "4", "--notices", "azure", "--lead", "40"),
            *("--replacement-delay", "0.3", "--timeout", "99", "--storage", "/s", "--fresh-local", "--json"),
            *("--", "python", "train.py"),
        ]
    )
    o = rehearse.options(args)
    assert o.command == ["python", "train.py"] and (o.preemptions, o.seed, o.storage) == (3, 4, "/s")
    assert (o.mtbf_s, o.source, o.lead_s, o.replacement_s, o.timeout_s) == (2.5, "azure", 40.0, 0.3, 99.0)
    assert o.fresh_local is True and o.stdout_to_stderr is True


def test_a_rename_naming_no_field_or_no_argument_is_a_programming_error():
    @dataclass
    class Options:
        command: list[str]
        lead_s: float = 1.0

    args = argparse.Namespace(cmd=["--", "x"], lead=2.0)
    assert options_from(Options, args, lead_s="lead") == Options(["x"], 2.0)
    with pytest.raises(TypeError, match="used nowhere: {'lead'}"):  # a field renamed, its option not
        options_from(Options, args)
    with pytest.raises(TypeError, match="lead_ss"):
        options_from(Options, args, lead_ss="lead")
    with pytest.raises(TypeError, match="leed"):
        options_from(Options, args, lead_s="leed")
