"""A Guard, its watcher and its engine hold no cycle: dropped, it goes with what it tracks at once.

Why it matters: the cyclic collector closes a tracked DataLoader's worker queues before the loader's
iterator shuts its workers down, and PyTorch then waits out a 5 s join timeout for each live worker
(10 s for two, inside whatever step triggers the collection). With the collector off, a cycle keeps
everything alive: what these tests see is what the refcount alone frees.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

import spotguard
from spotguard.integrations._common import NoticeWatch
from spotguard.notices.base import Notice
from spotguard.weakcall import weakly
from tests.checkpoint.state.test_data import WORKER_START

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def no_collector():
    # A process's first optimizer construction leaves a cycle through its caller's frame (torch's own):
    # made here, and collected, it holds no frame of a test's.
    torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
    gc.collect()
    gc.disable()
    yield
    gc.enable()


def test_weakly_calls_the_method_while_its_object_lives_and_does_nothing_after():
    class Owner:
        seen: list = []

        def on(self, *args):
            self.seen.append(args)

    owner = Owner()
    call = weakly(owner.on)
    call(1, 2)
    assert Owner.seen == [(1, 2)]
    del owner  # nothing else holds it: the callback did not
    call(3)
    assert Owner.seen == [(1, 2)]


def train_one_step(tmp_path, persistent: bool) -> tuple[list[weakref.ref], list]:
    """A Guard over a 2-worker loader, closed with the loader mid-epoch (its workers live): weak
    references to both, and the worker processes."""
    loader = StatefulDataLoader(
        list(range(16)), batch_size=2, num_workers=2, persistent_workers=persistent, **WORKER_START
    )
    model = torch.nn.Linear(2, 2)
    guard = spotguard.Guard(str(tmp_path), providers="signal", lease_ttl=None, every_steps=1, async_save=True)
    guard.track(loader=loader, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with guard:
        step = guard.resume()  # from the first run's checkpoint: the loader's next iterator is patched
        it = iter(loader)
        next(it)
        workers = list(it._workers)
        assert workers and all(w.is_alive() for w in workers)
        guard.step(step + 1)
    return [weakref.ref(guard), weakref.ref(loader)], workers


@pytest.mark.parametrize("persistent", [False, True], ids=["workers", "persistent-workers"])
@pytest.mark.parametrize("runs", [1, 2])
def test_a_closed_guard_and_its_loader_go_with_their_last_reference_and_the_workers_end(
    tmp_path, no_collector, runs, persistent
):
    for _ in range(runs):
        refs, workers = train_one_step(tmp_path, persistent)
        assert [r() for r in refs] == [None, None], "a cycle holds them: only the cyclic collector would free them"
        assert not any(w.is_alive() for w in workers), "the iterator's __del__ shut its workers down"


def test_a_trainer_integration_s_watch_goes_with_its_last_reference(no_collector):
    watch = NoticeWatch(providers=[])
    ref = weakref.ref(watch)
    watch.watcher.report(Notice("test", "terminate"))
    assert watch.due  # set by its own on_notice: the weak callback reaches it while it lives
    del watch
    assert ref() is None
