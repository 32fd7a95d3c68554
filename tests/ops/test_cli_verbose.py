"""The global options as users type them: ``-v`` before or after the command (the counts add up), and
``spotguard run`` at warnings only without it, as docs/training-loop.md says of the CLI."""

from __future__ import annotations

import sys

import pytest

from spotguard.ops.cli import build_parser
from tests.helpers import run, subprocess_env


@pytest.mark.parametrize(
    "argv, level",
    [
        (["ls", "DIR"], 0),
        (["-v", "ls", "DIR"], 1),
        (["ls", "-v", "DIR"], 1),
        (["ls", "DIR", "-vv"], 2),
        (["-v", "verify", "--verbose", "DIR"], 2),
        (["run", "-v", "--", "python", "job.py", "-v"], 1),  # the job's own -v stays the job's
    ],
)
def test_verbose_is_accepted_before_and_after_the_command(argv, level):
    parser = build_parser()
    args = parser.parse_args(argv)
    assert args.verbose + getattr(args, "verbose_after", 0) == level
    if argv[0] == "run":
        assert args.cmd == ["--", "python", "job.py", "-v"]


def test_ls_with_verbose_after_the_command_lists_as_before(tmp_path):
    cmd = [sys.executable, "-m", "spotguard"]
    before = run([*cmd, "-v", "ls", str(tmp_path)], env=subprocess_env())
    after = run([*cmd, "ls", "-v", str(tmp_path)], env=subprocess_env())
    assert after.returncode == before.returncode == 0, after.stderr  # was: "unrecognized arguments: -v"
    assert after.stdout == before.stdout


def test_run_logs_warnings_only_by_default_and_its_story_with_v(tmp_path):
    job = [sys.executable, "-c", "pass"]
    quiet = run([sys.executable, "-m", "spotguard", "run", "--storage", str(tmp_path), "--", *job])
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stderr == "", quiet.stderr  # was: "INFO ... starting: ..." and "the job finished"
    told = run([sys.executable, "-m", "spotguard", "run", "-v", "--storage", str(tmp_path), "--", *job])
    assert told.returncode == 0 and "INFO" in told.stderr and "the job finished" in told.stderr, told.stderr
