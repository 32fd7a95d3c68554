"""The control API, faults on request, and the three subcommands: mock-metadata, simulate-preemption, watch."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from spotguard.notices._http import MetadataClient, MetadataHTTPError
from spotguard.notices.file import FileProvider
from spotguard.ops.cli import main
from spotguard.ops.mockmeta import MockControlError, control, endpoint_env
from tests.helpers import free_port, subprocess_env


def spotguard_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "spotguard", *args]


@pytest.fixture
def run_cli(capsys, monkeypatch):
    """The CLI in this process (its start-up is torch's import: seconds per child process)."""

    def run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
        with monkeypatch.context() as m:
            for name, value in env.items():
                m.setenv(name, value)
            code = main(list(args))
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out, err)

    return run


def test_control_api_triggers_later_and_clears(mock_metadata):
    server = mock_metadata("azure")
    assert control(server.url, "trigger", {"kind": "preempt", "in": 0.3}) == {
        "cloud": "azure",
        "kind": "preempt",
        "in": 0.3,
    }
    assert control(server.url, "state")["events"] == []
    time.sleep(0.5)
    assert [e["EventType"] for e in control(server.url, "state")["events"]] == ["Preempt"]
    control(server.url, "clear")
    assert control(server.url, "state")["events"] == []
    with pytest.raises(MockControlError, match="unknown kind"):
        control(server.url, "trigger", {"kind": "meteor"})


def test_faults_only_when_asked(mock_metadata):
    server = mock_metadata("gcp")
    from spotguard.notices._http import MetadataClient

    client = MetadataClient.from_url(server.url)
    statuses = [client.request("GET", "/").status for _ in range(20)]
    assert statuses == [200] * 20
    control(server.url, "faults", {"status": 503, "count": 2})
    assert [client.request("GET", "/").status for _ in range(3)] == [503, 503, 200]
    flaky = mock_metadata("gcp", error_rate=0.5)
    client = MetadataClient.from_url(flaky.url)
    statuses = [client.request("GET", "/").status for _ in range(40)]
    assert 5 < statuses.count(503) < 35 and set(statuses) == {200, 503}


def test_faults_can_drip_or_pad_the_real_answer(mock_metadata):
    """Hostile answers for the clients' tests: the real body a byte at a time, or followed by filler."""
    server = mock_metadata("gcp")
    client = MetadataClient.from_url(server.url, timeout=10, max_body=10**6)
    preempted = ("GET", "/computeMetadata/v1/instance/preempted", {"Metadata-Flavor": "Google"})
    control(server.url, "faults", {"status": 0, "count": 1, "drip": 0.1})
    t0 = time.monotonic()
    assert client.request(*preempted).body == b"FALSE"  # 5 bytes, 0.1 s apart
    assert 0.35 < time.monotonic() - t0 < 5  # the last byte 0.4 s after the first
    control(server.url, "faults", {"status": 0, "count": 1, "pad": 300_000})
    resp = client.request(*preempted)
    assert resp.status == 200 and resp.body == b"FALSE" + b" " * 300_000 and "etag" in resp.headers
    assert client.request(*preempted).body == b"FALSE"
    with pytest.raises(MockControlError, match="must not be negative"):
        control(server.url, "faults", {"status": 0, "pad": -1})


def test_nothing_listening_gives_a_clear_message(run_cli):
    port = free_port()
    with pytest.raises(MockControlError, match="no mock metadata server"):
        control(f"http://127.0.0.1:{port}", "state")
    out = run_cli("simulate-preemption", "--endpoint", f"http://127.0.0.1:{port}")
    assert out.returncode == 2 and "no mock metadata server" in out.stderr and "Traceback" not in out.stderr


def test_mock_metadata_command_serves_and_fires_notice_after(tmp_path, run_cli):
    proc = subprocess.Popen(
        spotguard_cmd("mock-metadata", "--cloud", "gcp", "--port", "0", "--notice-after", "1"),
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        first = proc.stdout.readline()
        assert "spotguard mock gcp metadata server on http://127.0.0.1:" in first, proc.stderr.read()
        url = first.split(" on ")[1].strip()
        assert "GCE_METADATA_HOST=127.0.0.1:" in proc.stdout.readline()
        assert control(url, "state")["notices"]["instance/preempted"] == "FALSE"
        deadline = time.monotonic() + 10
        while control(url, "state")["notices"]["instance/preempted"] == "FALSE":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        wrong = run_cli("simulate-preemption", "--cloud", "aws", "--endpoint", url)
        assert wrong.returncode == 1 and "imitates gcp, not aws" in wrong.stderr
        cleared = run_cli("simulate-preemption", "--cloud", "gcp", "--clear", **endpoint_env("gcp", url))
        assert cleared.returncode == 0, cleared.stderr
        assert control(url, "state")["notices"]["instance/preempted"] == "FALSE"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
    assert proc.returncode == 0


def test_simulate_preemption_file_and_pid(tmp_path, run_cli):
    flag = tmp_path / "notice.json"
    out = run_cli("simulate-preemption", "--file", str(flag), "--kind", "preempt", "--deadline-in", "30")
    assert out.returncode == 0, out.stderr
    notice = FileProvider(flag).poll()
    assert notice.kind == "preempt" and 25 < notice.seconds_left() <= 30
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert run_cli("simulate-preemption", "--pid", str(victim.pid)).returncode == 0
        assert victim.wait(10) == -signal.SIGTERM
    finally:
        victim.kill()


def test_watch_prints_json_and_exits_0_on_a_notice(mock_metadata, run_cli):
    server = mock_metadata("aws")
    proc = subprocess.Popen(
        spotguard_cmd("watch", "--providers", "aws", "--json", "--interval", "0.2", "--timeout", "60"),
        env=subprocess_env(**endpoint_env("aws", server.url)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not server.mock.tokens:  # the watcher is polling
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
            time.sleep(0.05)
        sim = run_cli("simulate-preemption", "--cloud", "aws", "--action", "stop", **endpoint_env("aws", server.url))
        assert sim.returncode == 0 and "aws spot notice now" in sim.stdout, sim.stderr
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    record = json.loads(out.splitlines()[0])
    assert record["provider"] == "aws" and record["kind"] == "stop" and record["deadline"]


@pytest.mark.parametrize("cloud, kind", [("aws", "rebalance"), ("gcp", "migrate")])
def test_watch_ends_on_an_advisory_notice_only_with_advisory(mock_metadata, run_cli, cloud, kind):
    server = mock_metadata(cloud)
    server.mock.trigger(kind)
    env = endpoint_env(cloud, server.url)
    watch = ("watch", "--providers", cloud, "--json", "--interval", "0.1")
    plain = run_cli(*watch, "--timeout", "1.5", **env)
    assert plain.returncode == 1, plain.stderr  # printed, but only a stop notice ends it
    record = json.loads(plain.stdout.splitlines()[0])
    assert record["kind"] == kind and record["advisory"] is True
    ended = run_cli(*watch, "--timeout", "30", "--advisory", **env)
    assert ended.returncode == 0, ended.stderr
    assert json.loads(ended.stdout.splitlines()[0])["kind"] == kind


def test_watch_times_out_with_exit_1(mock_metadata, run_cli):
    server = mock_metadata("azure")
    out = run_cli("watch", "--providers", "azure", "--timeout", "0.5", **endpoint_env("azure", server.url))
    assert out.returncode == 1 and out.stdout == "" and "watching azure" in out.stderr


def test_a_storm_answers_with_every_kind_of_failure_in_turn_then_ends(mock_metadata):
    from spotguard.ops.mockmeta.server import STORM

    server = mock_metadata("gcp")
    client = MetadataClient.from_url(server.url, timeout=1.0)
    server.set_storm(True)
    outcomes = []
    for _ in STORM:
        client.close()  # a fresh connection each time: no silent retry of a reset one
        try:
            resp = client.request("GET", "/computeMetadata/v1/instance/preempted", {"Metadata-Flavor": "Google"})
            outcomes.append(resp.status if resp.body != b"FALSE" else "ok")
        except MetadataHTTPError:
            outcomes.append("broken")
    assert outcomes == [503, 500, 429, 401, 200, "broken", 502, "broken"]
    assert server.storm_answers == len(STORM)
    server.set_storm(False)
    assert (
        client.request("GET", "/computeMetadata/v1/instance/preempted", {"Metadata-Flavor": "Google"}).text == "FALSE"
    )
