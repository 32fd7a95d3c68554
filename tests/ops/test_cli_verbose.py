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


SDK_LOGS = """
import logging, sys
from spotguard.ops.cli import configure_logging
configure_logging(int(sys.argv[1]))
for name in ("botocore.credentials", "google.auth", "azure.identity"):
    logging.getLogger(name).info("INFO from %s", name)
    logging.getLogger(name).debug("DEBUG from %s", name)
"""


@pytest.mark.parametrize("verbose, shown", [(0, ()), (1, ("INFO",)), (2, ("INFO",)), (3, ("INFO", "DEBUG"))])
def test_cloud_sdks_log_info_only_with_v_and_their_debug_only_with_vvv(verbose, shown):
    proc = run([sys.executable, "-c", SDK_LOGS, str(verbose)], env=subprocess_env())
    assert proc.returncode == 0, proc.stderr
    for name in ("botocore.credentials", "google.auth", "azure.identity"):
        for level in ("INFO", "DEBUG"):  # was: INFO shown without -v ("Found credentials in ...")
            assert (f"{level} from {name}" in proc.stderr) == (level in shown), proc.stderr
