"""examples/ray/train_ray.py on a local multi-node Ray cluster, with one node reclaimed the way Ray sees it.

``python ray_cluster.py RUN_DIR [--drain-after N --deadline S | --sigterm-after N] -- EXAMPLE_ARGS``:
a ``ray.cluster_utils.Cluster`` of two nodes of one CPU each (the head and a second node: one worker
each), the example joined to it (``--address``). With ``--drain-after``, once rank 1 logged step N the
second node is drained through the GCS with ``DRAIN_NODE_REASON_PREEMPTION`` and a deadline S seconds
ahead (as the autoscaler or KubeRay do on a cloud's notice; ``--slow-emergency S`` makes the emergency
save outlast it); with ``--sigterm-after`` the second node is
a ``ray start --block`` process, sent SIGTERM (it drains itself for
``RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S``). Either way a replacement node joins at once (the autoscaler's
part), so that Ray can restart the group. ``RUN_DIR/drain.json`` records the drain's deadline.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import ray
from ray.cluster_utils import Cluster

HERE = str(Path(__file__).resolve().parent)
EXAMPLE_DIR = str(Path(__file__).resolve().parents[2] / "examples" / "ray")
sys.path[:0] = [EXAMPLE_DIR, HERE]
# Ray's workers unpickle the training function by its module: they import it from here too.
os.environ["PYTHONPATH"] = os.pathsep.join([EXAMPLE_DIR, HERE, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
import train_ray  # noqa: E402


def _step(path: Path) -> int:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return 0
    return max((json.loads(line)["step"] for line in lines if line.strip()), default=0)


def _drain(gcs_address: str, node_id: str, deadline_s: float) -> float:
    from ray._raylet import GcsClient
    from ray.core.generated import autoscaler_pb2

    deadline_ms = int(time.time() * 1000 + deadline_s * 1000)
    accepted, why = GcsClient(address=gcs_address).drain_node(
        node_id,
        autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
        "spot reclaim (test)",
        deadline_ms,
    )
    assert accepted, why
    return deadline_ms / 1000


#: `ray start` itself, in a Python that keeps the head's 127.0.0.1 as given: the tests keep Ray on the
#: loopback (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, which `ray start` takes for "no multi-node"), and with
#: the variable at 1 `ray start` would swap 127.0.0.1 for the NIC's address, where the GCS is not.
RAY_START = (
    "import sys, ray._private.services as s; s.resolve_ip_for_localhost = lambda host: host; "
    "from ray.scripts.scripts import main; sys.argv[0] = 'ray'; main()"
)


def _ray_start(address: str, drain_timeout: float) -> subprocess.Popen[bytes]:
    """A node of one CPU as a `ray start --block` process (what a Kubernetes pod runs), joined to ``address``."""
    env = dict(
        os.environ, RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=str(drain_timeout), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="1"
    )
    cmd = [sys.executable, "-c", RAY_START, "start", "--address", address, "--node-ip-address", "127.0.0.1"]
    cmd += ["--num-cpus", "1", "--block", "--disable-usage-stats"]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("run_dir", type=Path)
    p.add_argument("--drain-after", type=int)
    p.add_argument("--deadline", type=float, default=10.0)
    p.add_argument("--sigterm-after", type=int)
    p.add_argument("--slow-emergency", type=float, help="seconds the emergency save takes first (ray_slow_save.py)")
    cut = sys.argv.index("--")
    a, example = p.parse_args(sys.argv[1:cut]), sys.argv[cut + 1 :]
    if a.slow_emergency is not None:  # before the cluster starts: its workers inherit the environment
        import ray_slow_save

        os.environ[ray_slow_save.ENV] = str(a.slow_emergency)
        train_ray.train_loop_per_worker = ray_slow_save.train_loop_per_worker
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    block: subprocess.Popen[bytes] | None = None
    started: list[subprocess.Popen[bytes]] = []
    try:
        if a.sigterm_after is not None:
            block = _ray_start(cluster.address, a.deadline)
            started.append(block)
        else:
            second = cluster.add_node(num_cpus=1)
            cluster.wait_for_nodes(timeout=120)
        if block is not None:  # not one of the cluster's own: count the live nodes instead
            wait_until = time.monotonic() + 120
            while len(cluster.global_state._live_node_ids()) < 2 and time.monotonic() < wait_until:
                time.sleep(0.2)

        def reclaim() -> None:
            after = a.drain_after if a.drain_after is not None else a.sigterm_after
            while _step(a.run_dir / "losses-1.jsonl") < after:
                time.sleep(0.02)
            if block is not None:
                block.send_signal(signal.SIGTERM)
                record = {"deadline": time.time() + a.deadline, "how": "sigterm"}
            else:
                record = {"deadline": _drain(cluster.gcs_address, second.node_id, a.deadline), "how": "drain"}
            (a.run_dir / "drain.json").write_text(json.dumps(record))
            # The replacement machine (the autoscaler's part); a process of its own: a Node made here, off
            # the main thread, could not install its signal handlers.
            started.append(_ray_start(cluster.address, 0))

        if a.drain_after is not None or a.sigterm_after is not None:
            threading.Thread(target=reclaim, daemon=True).start()
        train_ray.main([*example, "--address", cluster.address])
    finally:
        ray.shutdown()
        for proc in started:  # SIGTERM: `ray start --block` stops its node's processes, then exits
            proc.terminate()
        for proc in started:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        cluster.shutdown()


if __name__ == "__main__":
    main()
