"""Mistakes on the command line end in one line (``spotguard: error: ...``, exit 2; ``spotguard: ...``, exit 1
for a result that is an error), never a traceback; storage commands give up after ``--timeout``."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import spotguard
from spotguard.errors import ConfigError
from spotguard.ops import mockmeta
from spotguard.ops.cli import build_parser, main
from spotguard.storage import open_storage
from spotguard.storage.timeouts import DEFAULT_TIMEOUT
from tests.helpers import WORKERS, subprocess_env


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


# -- files and folders the command cannot use: one line, no traceback, nothing left behind ---------


def a_checkpoint(root: Path, step: int = 7) -> None:
    guard = spotguard.Guard(str(root), every_steps=None, providers=[], save_on_exit=False)
    guard.track(x=torch.arange(4.0)).save(step)


def obeying_permissions(*args: str) -> subprocess.CompletedProcess[str]:
    """`python -m spotguard ARGS` with file permissions enforced even as root (see the worker)."""
    proc = subprocess.run(
        [sys.executable, str(WORKERS / "obey_permissions.py"), "-m", "spotguard", *args],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    if proc.returncode == 77:
        pytest.skip("cannot drop CAP_DAC_OVERRIDE here: root would read and write anyway")
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def test_pull_into_a_folder_below_a_file_fails_in_one_line_and_leaves_nothing(tmp_path, capsys):
    a_checkpoint(tmp_path / "ckpt")
    (tmp_path / "file").write_text("not a folder")
    assert main(["pull", str(tmp_path / "ckpt"), str(tmp_path / "file" / "dest")]) == 1
    err = capsys.readouterr().err
    assert "spotguard: cannot pull" in err and "Not a directory" in err, err
    assert (tmp_path / "file").read_text() == "not a folder"


@pytest.mark.slow
def test_pull_into_a_folder_that_cannot_be_written_fails_in_one_line_and_leaves_nothing(tmp_path):
    a_checkpoint(tmp_path / "ckpt")
    dest = tmp_path / "dest"
    dest.mkdir()
    dest.chmod(0o555)
    try:
        proc = obeying_permissions("pull", str(tmp_path / "ckpt"), str(dest))
    finally:
        dest.chmod(0o755)
    assert proc.returncode == 1 and "spotguard: cannot pull" in proc.stderr, proc
    assert "Permission denied" in proc.stderr and list(dest.iterdir()) == [], proc


@pytest.mark.slow
def test_verify_and_pull_of_an_unreadable_file_say_so_in_one_line(tmp_path):
    root = tmp_path / "ckpt"
    a_checkpoint(root)
    data = next(p for p in (root / "step-00000007").iterdir() if p.name != "manifest.json")
    data.chmod(0)
    try:
        verify = obeying_permissions("verify", str(root))
        pull = obeying_permissions("pull", str(root), str(tmp_path / "dest"))
    finally:
        data.chmod(0o644)
    assert verify.returncode == 1, verify
    assert "step-00000007: UNREADABLE: " in verify.stdout and "Permission denied" in verify.stdout, verify
    assert pull.returncode == 1 and "spotguard: cannot pull" in pull.stderr, pull
    assert "Permission denied" in pull.stderr and not (tmp_path / "dest" / "step-00000007").exists(), pull


def test_verify_of_only_incomplete_checkpoints_exits_1(tmp_path, capsys):
    (tmp_path / "step-00000003").mkdir()
    (tmp_path / "step-00000003" / "part").write_bytes(b"x")
    assert main(["verify", str(tmp_path)]) == 1
    out, err = capsys.readouterr()
    assert "step-00000003: incomplete" in out and "no complete checkpoint" in err and "nothing verified" in err


@pytest.mark.parametrize("command", [["ls"], ["rm", "--incomplete"], ["rm", "--step", "3"]])
def test_a_path_that_does_not_exist_exits_1(tmp_path, capsys, command):
    assert main([*command, str(tmp_path / "typo")]) == 1  # rm --incomplete said "nothing incomplete", exit 0
    assert f"spotguard: {tmp_path / 'typo'} does not exist" in capsys.readouterr().err
    assert not (tmp_path / "typo").exists()


@pytest.mark.parametrize(
    "port, message", [("99999", "port must be within 0..65535"), ("busy", "Address already in use")]
)
def test_mock_metadata_on_a_bad_or_busy_port_exits_2_in_one_line(capsys, port, message):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        number = str(busy.getsockname()[1]) if port == "busy" else port
        assert main(["mock-metadata", "--port", number]) == 2
    err = capsys.readouterr().err
    assert err.startswith("spotguard: error: ") and message in err, err


def test_simulate_preemption_into_a_folder_exits_2_and_leaves_no_tmp(tmp_path, capsys):
    folder = tmp_path / "notices"
    folder.mkdir()
    assert main(["simulate-preemption", "--file", str(folder)]) == 2
    assert "is a folder" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notices"] and list(folder.iterdir()) == []


# -- --timeout: a storage service that accepts connections and never answers ------------------------

AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A real loopback socket whose backlog accepts connections (the kernel completes them) and never answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("scheme, command", [("s3", "ls"), ("gs", "verify"), ("az", "pull")])
def test_a_storage_command_against_a_silent_service_gives_up_after_its_timeout(silent_port, scheme, command, tmp_path):
    env = {
        "s3": dict(AWS_ENDPOINT_URL=f"http://127.0.0.1:{silent_port}", AWS_ACCESS_KEY_ID="testing")
        | dict(AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1"),
        "gs": dict(STORAGE_EMULATOR_HOST=f"http://127.0.0.1:{silent_port}"),
        "az": dict(
            AZURE_STORAGE_CONNECTION_STRING=f"DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;"
            f"AccountKey={AZURITE_KEY};BlobEndpoint=http://127.0.0.1:{silent_port}/devstoreaccount1;"
        ),
    }[scheme]
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "spotguard", command, f"{scheme}://bucket/run", "--timeout", "2"]
        + ([str(tmp_path / "dest")] if command == "pull" else []),
        env=subprocess_env(**env),
        capture_output=True,
        text=True,
        timeout=120,
    )
    took = time.monotonic() - t0
    assert proc.returncode == 2 and "gave up" in proc.stderr and "time" in proc.stderr.lower(), proc.stderr
    assert took < 20, (took, proc.stderr)  # 2 s per request, no retry after 2 s: not 8 minutes
    assert "Traceback" not in proc.stderr


def test_storage_commands_have_a_bounded_default_timeout():
    parser = build_parser()
    for command in (["ls", "u"], ["verify", "u"], ["pull", "u", "d"], ["rm", "u", "--incomplete"]):
        assert parser.parse_args(command).timeout == DEFAULT_TIMEOUT == 60
    with pytest.raises(ConfigError, match="timeout must be a positive"):
        open_storage("s3://bucket/run", timeout=0)


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (
            ["run", "--hang-timout", "3", "--", "true"],
            "unrecognized arguments: --hang-timout (did you mean --hang-timeout?)",
        ),
        (["ls", "a", "b"], "unrecognized arguments: b"),
        (["--json", "ls", "a"], "--json: an option of `spotguard ls`: give it after the command"),
    ],
)
def test_an_unknown_argument_is_the_subcommands_error_with_its_usage(capsys, argv, said):
    """Not the top-level parser's `usage: spotguard [-h] [--version] [-v] COMMAND ...`, which names no option."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    command = next(a for a in argv if not a.startswith("-"))
    assert e.value.code == 2 and f"usage: spotguard {command} " in err, err
    assert f"spotguard {command}: error: {said}" in err, err
