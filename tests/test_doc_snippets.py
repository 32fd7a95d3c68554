"""Every Python snippet of README.md and docs/ runs as written, or is listed below with the test that runs
its code in full; a training loop's snippet exits 75 (``EXIT_PREEMPTED``) after a stop notice with its
emergency checkpoint committed, as `spotguard run`, SkyPilot's ``recover_on_exit_codes: [75]`` and the
systemd units expect.

A snippet is the text of a fenced ``python`` block; the harness gives it only what its prose says it has
(a tiny model, optimizer, scheduler, scaler and ``StatefulDataLoader``, endless ``total_steps``/``epochs``,
and for the fragments the ``guard`` and loop around them), runs it in a process of its own in a fresh
folder, and sends SIGTERM once spotguard's handler is in place. ``s3://`` snippets write to moto's S3.
Each snippet's process is forked from one server that imported torch, torchdata and spotguard once
(tests/forked.py): what is checked is what the snippet does, not the interpreter's start.
"""

from __future__ import annotations

import importlib.util
import re
import sys
import textwrap

import pytest

from spotguard import EXIT_PREEMPTED
from spotguard.checkpoint import scan
from spotguard.storage import open_storage

from .forked import PRELOAD, Served
from .helpers import REPO, block_cloud_metadata, run, subprocess_env

pytestmark = pytest.mark.slow

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
AWS_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}

#: What the prose gives a loop snippet, and a SIGTERM once the guard's watcher handles it.
CONTEXT = """
import os, signal, sys, threading, time
import torch
from torch.utils.data import TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader
import spotguard

torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
sched = torch.optim.lr_scheduler.StepLR(opt, 10)
scaler = torch.amp.GradScaler("cpu", enabled=False)
loader = StatefulDataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=8)
total_steps = epochs = 10**9

def _notice():
    while signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        time.sleep(0.01)
    time.sleep(0.3)
    os.kill(os.getpid(), signal.SIGTERM)

threading.Thread(target=_notice, daemon=True).start()
"""
#: The epoch loops' context: an RNN whose hidden state runs across batches, and the guard of the first snippet.
EPOCHS = """
model = torch.nn.LSTM(4, 8, batch_first=True)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
sched = torch.optim.lr_scheduler.StepLR(opt, 10)
loader = StatefulDataLoader(TensorDataset(torch.randn(64, 3, 4), torch.randn(64, 1)), batch_size=8)
val_loader = [None] * 4
guard = spotguard.Guard("checkpoints/run-1", providers="auto")
"""
#: The fragment of an evaluation between epochs sits in the epoch loop above it.
IN_EPOCH_LOOP = """
guard.track(model=model, optimizer=opt, scheduler=sched, loader=loader)
step = guard.resume()
epoch = guard.extra.get("epoch", 0)
with guard:
    while epoch < epochs:
{snippet}
"""

#: How each snippet is run: (page, its first line) -> (kind, storage it writes).
LOOPS = {
    ("README.md", "import sys"): ("loop", "s3://my-bucket/runs/run-1"),
    ("training-loop.md", "import sys"): ("loop", "checkpoints/run-1"),
    ("training-loop.md", "hidden = spotguard.Value(None)"): ("epochs", "checkpoints/run-1"),
    ("training-loop.md", "for x, y in loader:"): ("evaluation", "checkpoints/run-1"),
    ("training-loop.md", "EVAL_EVERY = 40"): ("loop", "checkpoints/run-1"),
}
PLAIN = {("training-loop.md", "import logging")}  # runs as it is, and exits 0
#: Not run here, and why (each one's code runs in full in the test named).
ELSEWHERE = {
    (
        "distributed.md",
        "hvd.init()",
    ): "needs horovod: examples/horovod/train_horovod.py, tests/integrations/test_horovod.py",
    (
        "integrations.md",
        "cb = SpotguardCallback(",
    ): "keyword fragment; deadline_policy: tests/integrations/test_window.py",
    ("integrations.md", "from spotguard.integrations.hf import"): "examples/hf_trainer.py: test_documented_commands",
    (
        "integrations.md",
        "from spotguard.integrations.accelerate import",
    ): "examples/accelerate_train.py: test_documented_commands",
    (
        "integrations.md",
        "from spotguard.integrations.lightning import",
    ): "examples/lightning_train.py: test_documented_commands",
    (
        "integrations.md",
        "from spotguard.integrations.deepspeed import",
    ): "examples/deepspeed_train.py: test_documented_commands",
    (
        "integrations.md",
        "guard = spotguard.Guard(storage, every_steps=500)",
    ): "a Ray Train worker's loop: examples/ray/train_ray.py, tests/integrations/test_ray_drain.py",
    ("metrics.md", "guard = spotguard.Guard("): "a fixed port (9400) and S3: tests/metrics",
    ("rehearse.md", "guard.extra.setdefault("): "one line of a loop: tests/ops/test_rehearse.py",
    ("storage.md", "# S3: credentials"): "a Guard per cloud (S3, GCS, Azure emulators): tests/storage",
    (
        "training-loop.md",
        "start = guard.resume()",
    ): "needs wandb: examples/tracker_run_id.py, tests/test_tracker_example.py",
}


def snippets() -> list[tuple[str, str, str]]:
    """(page name, first line, text) of every fenced python block."""
    found = []
    for page in PAGES:
        for text in re.findall(r"^```python\n(.*?)^```", page.read_text(), flags=re.S | re.M):
            found.append((page.name, text.strip().splitlines()[0].strip(), text))
    return found


def _key(page: str, first: str, table: dict) -> tuple[str, str] | None:
    return next((k for k in table if k[0] == page and first.startswith(k[1])), None)


def test_every_snippet_is_run_here_or_names_the_test_that_runs_its_code():
    for page, first, _ in snippets():
        assert any(_key(page, first, t) for t in (LOOPS, ELSEWHERE, dict.fromkeys(PLAIN))), (page, first)
    assert len(snippets()) == len(LOOPS) + len(PLAIN) + len(ELSEWHERE)


@pytest.fixture(scope="module")
def s3_env():
    """moto's S3 with the README's bucket, as the environment of a snippet's process."""
    boto3 = pytest.importorskip("boto3")
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    url = f"http://127.0.0.1:{server.get_host_and_port()[1]}"
    boto3.client("s3", endpoint_url=url, **_boto(AWS_ENV)).create_bucket(Bucket="my-bucket")
    yield {**AWS_ENV, "AWS_ENDPOINT_URL": url}
    server.stop()


@pytest.fixture(scope="module")
def forks():
    """The server the snippets' runs fork from (boto3 imported there too: the README's S3 snippet)."""
    served = Served((*PRELOAD, *(["boto3"] if importlib.util.find_spec("boto3") else [])))
    yield served
    served.close()


def _boto(env: dict[str, str]) -> dict[str, str]:
    return {
        "aws_access_key_id": env["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": env["AWS_SECRET_ACCESS_KEY"],
        "region_name": env["AWS_DEFAULT_REGION"],
    }


def script(kind: str, text: str) -> str:
    if kind == "loop":
        return CONTEXT + text
    if kind == "epochs":
        return CONTEXT + EPOCHS + text
    return CONTEXT + EPOCHS + IN_EPOCH_LOOP.format(snippet=textwrap.indent(text.rstrip("\n"), "    "))


@pytest.mark.parametrize("key", list(LOOPS), ids=[f"{p}:{f}" for p, f in LOOPS])
def test_a_loop_snippet_exits_75_after_a_notice_with_its_checkpoint_committed(
    tmp_path, key, s3_env, monkeypatch, forks
):
    (text,) = [t for p, f, t in snippets() if _key(p, f, LOOPS) == key]
    kind, storage = LOOPS[key]
    (tmp_path / "snippet.py").write_text(script(kind, text))
    block_cloud_metadata()  # providers="auto" on a machine of no cloud: refused at once
    env = subprocess_env(**s3_env)
    with forks.scripts(tmp_path / "snippet.py"):
        done = run([sys.executable, str(tmp_path / "snippet.py")], env=env, cwd=tmp_path)
    assert done.returncode == EXIT_PREEMPTED, done.stderr[-3000:]
    if storage.startswith("s3://"):
        monkeypatch.setenv("AWS_ENDPOINT_URL", s3_env["AWS_ENDPOINT_URL"])
        for k, v in AWS_ENV.items():
            monkeypatch.setenv(k, v)
    infos = scan(open_storage(storage if "://" in storage else str(tmp_path / storage)))
    reasons = [i.manifest.reason for i in infos if i.complete and i.manifest]
    stopped_at_a_checkpoint = "already checkpointed" in done.stderr  # the periodic one of the stop's step
    assert reasons and (reasons[-1] == "emergency" or stopped_at_a_checkpoint), (reasons, done.stderr[-3000:])


@pytest.mark.parametrize("key", sorted(PLAIN))
def test_a_plain_snippet_runs(tmp_path, key, forks):
    (text,) = [t for p, f, t in snippets() if _key(p, f, dict.fromkeys(PLAIN)) == key]
    (tmp_path / "snippet.py").write_text(text)
    with forks.scripts(tmp_path / "snippet.py"):
        done = run([sys.executable, str(tmp_path / "snippet.py")], env=subprocess_env(), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
