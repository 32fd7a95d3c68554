"""Config mistakes on the command line end with ``spotguard: error: ...`` and exit 2, never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from spotguard.errors import ConfigError
from spotguard.ops import mockmeta
from spotguard.ops.cli import main
from tests.helpers import subprocess_env


def test_simulate_preemption_with_an_unknown_signal_is_a_config_error(capsys):
    assert main(["simulate-preemption", "--pid", str(os.getpid()), "--signal", "NOPE"]) == 2
    assert "spotguard: error: not a signal: 'NOPE'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--kind", "bogus", "--notice-after", "1"], "unknown kind 'bogus'"),
        (["--action", "explode", "--notice-after", "1"], "spot action must be terminate, stop or hibernate"),
        (["--error-rate", "2"], "error_rate must be within 0..1"),
    ],
)
def test_mock_metadata_with_bad_options_exits_2_with_the_reason(args, message):
    proc = subprocess.run(
        [sys.executable, "-m", "spotguard", "mock-metadata", "--port", "0", *args],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "spotguard: error: " in proc.stderr and message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_mock_library_raises_config_error_for_bad_input():
    with pytest.raises(ConfigError, match="unknown cloud"):
        mockmeta.make_mock("ibm")
    with pytest.raises(ConfigError, match="unknown kind"):
        mockmeta.make_mock("gcp").trigger("meteor")
