"""Every command an example's docstring tells a user to run starts as written and stops right: run in a
fresh folder (relative ``--storage`` paths land there, ``examples/`` is this checkout's), it trains to its
first periodic checkpoint, then a SIGTERM stops it with exit 75 and an emergency checkpoint committed.
(examples/tracker_run_id.py crashed as documented: ``--providers auto`` was split into ``["auto"]``.)

``python examples/demo.py`` (``make demo``) runs to its end: it checks its own resumed run, bit for bit.
A command not run here is listed in ``ELSEWHERE`` with the test that runs it; a new one must be added
to one of the two tables. Each run costs the example's imports and ~50 tiny steps (seconds).
"""

from __future__ import annotations

import ast
import shlex
import signal
import sys
from pathlib import Path

import pytest

from spotguard import EXIT_PREEMPTED
from spotguard.checkpoint import scan
from spotguard.storage import open_storage

from .helpers import REPO, block_cloud_metadata, run, signal_to, stop_when, stopped_for_notice, subprocess_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

WORDS = ("python ", "torchrun ", "horovodrun ", "DS_ACCELERATOR=", "SPOTGUARD_")

#: Run here: (example, the command's first words), and what it needs installed.
RUN = {
    ("train.py", "python examples/train.py"): (),
    ("tracker_run_id.py", "python examples/tracker_run_id.py"): (),
    ("accelerate_train.py", "python examples/accelerate_train.py"): ("accelerate", "torchdata"),
    ("hf_trainer.py", "python examples/hf_trainer.py"): ("transformers",),
    ("lightning_train.py", "python examples/lightning_train.py"): ("lightning", "torchdata"),
    ("train_ddp.py", "torchrun --nproc-per-node 2"): (),
    ("deepspeed_train.py", "DS_ACCELERATOR=cpu torchrun"): ("deepspeed", "torchdata"),
}
#: Not run here, and where it is.
ELSEWHERE = {
    ("train_ddp.py", "SPOTGUARD_NOTICE_FILE="): "an elided variant (...): tests/guard/test_distributed.py",
    ("deepspeed_train.py", "SPOTGUARD_NOTICE_FILE="): "an elided variant (...): tests/integrations/test_deepspeed.py",
    ("train_horovod.py", "horovodrun -np 2"): "needs horovod: tests/integrations/test_horovod.py",
    ("train_horovod.py", "SPOTGUARD_NOTICE_FILE="): "an elided variant (...): tests/integrations/test_horovod.py",
    ("train_ray.py", "SPOTGUARD_STORAGE=s3://"): "S3 and GPUs: tests/integrations/test_ray.py runs it on local CPUs",
    ("train_ray.py", "python examples/ray/train_ray.py"): "a Ray cluster: tests/integrations/test_ray.py",
}


def commands() -> list[tuple[str, str]]:
    """(example file name, command) for every command line of every example's docstring."""
    found = []
    for path in sorted((REPO / "examples").rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        lines = iter(doc.splitlines())
        for line in lines:
            text = line.strip()
            if not text.startswith(WORDS):
                continue
            while text.endswith("\\"):
                text = text[:-1] + next(lines).strip()
            found.append((path.name, text.split("  #")[0].strip()))
    return found


def _key(name: str, command: str, table: dict) -> tuple[str, str] | None:
    return next((k for k in table if k[0] == name and command.startswith(k[1])), None)


def test_every_documented_command_is_run_here_or_names_the_test_that_runs_it():
    found = commands()
    for name, command in found:
        assert name == "demo.py" or _key(name, command, RUN) or _key(name, command, ELSEWHERE), (name, command)
    assert len(found) == 1 + len(RUN) + len(ELSEWHERE), found


def argv(command: str) -> tuple[list[str], dict[str, str]]:
    """The command's argv (``python``: this interpreter; ``torchrun``: torch's) and its variables."""
    words, env = shlex.split(command), {}
    while "=" in words[0]:
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    if words[0] == "python":
        words[0:1] = [sys.executable]
    elif words[0] == "torchrun":
        words[0:1] = [sys.executable, "-m", "torch.distributed.run"]
    return words, env


@pytest.mark.parametrize("key", list(RUN), ids=[k[0] for k in RUN])
def test_a_documented_command_trains_and_stops_with_75_on_a_notice(tmp_path, key):
    for module in RUN[key]:
        pytest.importorskip(module)
    (command,) = [c for n, c in commands() if _key(n, c, RUN) == key]
    words, variables = argv(command)
    (tmp_path / "examples").symlink_to(REPO / "examples")
    storage = tmp_path / words[words.index("--storage") + 1]
    block_cloud_metadata()  # providers "auto" on a machine of no cloud: refused at once
    env = subprocess_env(**variables)
    act = signal_to(signal.SIGTERM)
    if "torch.distributed.run" in words:  # as its docstring says: a notice file for rank 1 stops all ranks
        env["SPOTGUARD_NOTICE_FILE"] = str(tmp_path / "notice-{rank}")
        act = lambda _: (tmp_path / "notice-1").touch()  # noqa: E731
        # The file is polled once a second; DeepSpeed's 200 steps can end 0.75 s after the first checkpoint
        # (seen once in CI: exit 0, the notice unseen). The run lasts until the notice stops it.
        words += ["--steps", "100000"]

    def checkpointed() -> bool:
        return storage.is_dir() and any(i.complete for i in scan(open_storage(str(storage))))

    done = stop_when(words, checkpointed, act, env=env, cwd=tmp_path)
    assert done.returncode == EXIT_PREEMPTED or stopped_for_notice(done), done.stderr[-4000:]
    infos = [i for i in scan(open_storage(str(storage))) if i.complete and i.manifest]
    # the emergency checkpoint, or the periodic one of the very step the notice stopped at
    stopped_at_a_checkpoint = "already checkpointed" in done.stderr + done.stdout
    assert infos and (infos[-1].manifest.reason == "emergency" or stopped_at_a_checkpoint), done.stderr[-4000:]


def test_the_demo_runs_as_documented_and_finds_the_resumed_run_exact(tmp_path):
    """``make demo``, the first command a newcomer runs: the whole story, checked by the demo itself."""
    (command,) = [c for n, c in commands() if n == "demo.py"]
    words, _ = argv(command.split(" [")[0])  # without its optional arguments, as `make demo` runs it
    (tmp_path / "examples").symlink_to(REPO / "examples")
    done = run(words, env=subprocess_env(), cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "MISMATCH" not in done.stdout and (tmp_path / "demo-run").is_dir()


def test_the_commands_use_paths_a_user_can_run_from_the_checkout():
    for _, command in commands():
        words = shlex.split(command)
        storage = words[words.index("--storage") + 1] if "--storage" in words else ""
        assert not storage.startswith("/tmp/"), command  # a shared folder: a second run resumes the first one's
        assert all(Path(REPO, w).exists() for w in shlex.split(command) if w.startswith("examples/")), command
