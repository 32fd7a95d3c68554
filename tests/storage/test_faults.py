"""Checkpoints through a flaky network: the fault proxy sits between spotguard and the real server.

With 30% of requests failing (dropped connections, 500/503, resets after the server acted,
stalls past the client timeout, truncated replies) a checkpoint still commits and a resume
continues bit-identically. With 100% failing, periodic saves fail with a clear message and the
training loop goes on. GCS runs on fake-gcs-server: it enforces ``if_generation_match``, so a
manifest whose reply was lost exercises the write-once path for real; Azure runs on Azurite, which
enforces the manifest's ``If-None-Match: *`` likewise.
"""

from __future__ import annotations

import logging
import random
import time

import pytest
import torch

from spotguard import Guard
from spotguard.errors import StorageError
from spotguard.storage.azure import AzureOptions, AzureStorage
from spotguard.storage.gcs import GCSOptions, GCSStorage
from spotguard.storage.retry import RetryOptions
from spotguard.storage.s3 import S3Options, S3Storage
from tests.faultproxy import FaultProxy
from tests.storage.conftest import azurite_connection

STEPS = 20
RETRY = RetryOptions(attempts=8, initial=0.01, maximum=0.1)


def make_storage(kind: str, url: str, proxy: FaultProxy, retry: RetryOptions = RETRY):
    if kind == "s3":
        bucket = url.split("/")[2]
        return S3Storage(
            f"s3://{bucket}/run",
            S3Options(endpoint_url=proxy.url, retry=retry, request_attempts=3, connect_timeout=1, read_timeout=1),
        )
    if kind == "azure":
        return AzureStorage(url, AzureOptions(retry=retry, request_attempts=3, connect_timeout=1, read_timeout=1))
    return GCSStorage(url, GCSOptions(retry=retry, timeout=1))


def fresh(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1))
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def train(model, opt, start: int, stop: int, guard: Guard | None = None) -> dict[int, float]:
    """Steps draw from torch's and Python's global streams, as real training does."""
    losses = {}
    for step in range(start, stop):
        x = torch.randn(8, 16) * random.random()
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses[step] = loss.item()
        if guard is not None:
            guard.step(step + 1)
    return losses


@pytest.fixture(params=["s3", "gcs", "azure"])
def backend(request, monkeypatch):
    kind = request.param
    if kind == "s3":
        url, server = request.getfixturevalue("s3_url"), request.getfixturevalue("moto")
    elif kind == "azure":
        url, server = request.getfixturevalue("az_url"), request.getfixturevalue("azurite")
    else:  # a server of its own that names its proxy in media links: downloads go through the faults too
        url, server = request.getfixturevalue("fake_gcs_proxied")
    return kind, url, server, monkeypatch


def proxied(kind: str, server, monkeypatch, **kw) -> FaultProxy:
    if kind == "gcs":  # ``server`` is the proxy already in front of it: the same faults, from now on
        server.set_faults(**kw)
        return server
    proxy = FaultProxy(server.port, **kw).start()
    if kind == "azure":
        monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite_connection(proxy.port))
    return proxy


def test_checkpoint_commits_and_resumes_identically_with_30_percent_failures(backend):
    kind, url, server, monkeypatch = backend
    random.seed(5)
    model, opt = fresh(0)
    reference = train(model, opt, 0, STEPS)
    ref_params = [p.detach().clone() for p in model.parameters()]

    proxy = proxied(kind, server, monkeypatch, rate=0.3, stall=1.5, seed=11)
    try:
        random.seed(5)
        model, opt = fresh(0)
        # Asynchronous saves (the default) upload in the background while training draws from
        # the global streams; busy="wait" makes the schedule exact whatever the faults cost.
        guard = Guard(make_storage(kind, url, proxy), every_steps=5, keep=2, providers=None, busy="wait")
        guard.track(model=model, optimizer=opt)
        first = train(model, opt, 0, 13, guard)  # saves at 5 and 10, then "the machine is gone"
        guard.wait()
        assert guard.last_saved is not None and guard.last_saved.step == 10
        saved_faults = sum(proxy.injected.values())

        random.seed(999)  # the new machine starts from different streams and weights
        model, opt = fresh(1)
        guard = Guard(make_storage(kind, url, proxy), every_steps=5, keep=2, providers=None)
        guard.track(model=model, optimizer=opt)
        assert guard.resume() == 10
        second = train(model, opt, 10, STEPS, guard)
        guard.wait()  # the background saves of the second machine go through the faults too
    finally:
        proxy.stop()
    assert saved_faults > 0 and sum(proxy.injected.values()) > saved_faults, proxy.injected
    assert {**first, **second} == reference  # bit-identical losses, replayed steps included
    for a, b in zip(model.parameters(), ref_params, strict=True):
        assert torch.equal(a, b)


def test_periodic_saves_fail_clearly_and_training_goes_on_with_100_percent_failures(backend, caplog):
    kind, url, server, monkeypatch = backend
    proxy = proxied(kind, server, monkeypatch, rate=1.0, faults=("503", "drop"), seed=3)
    try:
        model, opt = fresh(0)
        storage = make_storage(kind, url, proxy, RetryOptions(attempts=2, initial=0.01, maximum=0.02))
        guard = Guard(storage, every_steps=4, providers=None, busy="wait")
        guard.track(model=model, optimizer=opt)
        with caplog.at_level(logging.ERROR, logger="spotguard"):
            losses = train(model, opt, 0, 10, guard)
            with pytest.raises(StorageError):
                guard.wait()  # background errors are kept and surface here, never lost
        with pytest.raises(StorageError) as err:
            guard.resume()
    finally:
        proxy.stop()
    assert len(losses) == 10 and guard.last_saved is None
    failures = [r.getMessage() for r in caplog.records if "checkpoint of step" in r.getMessage()]
    assert len(failures) == 2 and all("training goes on" in m for m in failures)
    bucket = url.split("/")[2]
    assert f"{bucket}/run/step-00000004" in failures[0] and "gave up after retries" in failures[0]
    assert bucket in str(err.value)


@pytest.mark.parametrize("urgent_timeout", [0.5, 20.0], ids=["short-request-timeout", "long-request-timeout"])
def test_a_hung_request_does_not_hold_an_emergency_save_past_its_deadline(backend, urgent_timeout):
    """Every request stalls (the server never answers) and the normal per-request timeout is 60 s:
    a save with 2 s left gives up in about 2 s. With short request timeouts the retries stop at the
    deadline; with ones far longer than the time left (a large part on a slow server), the caller
    stops waiting at the deadline all the same."""
    kind, url, server, monkeypatch = backend
    proxy = proxied(kind, server, monkeypatch, rate=1.0, faults=("stall",), stall=30)
    try:
        if kind == "s3":
            st = S3Storage(
                f"s3://{url.split('/')[2]}/run",
                S3Options(endpoint_url=proxy.url, read_timeout=60, urgent_timeout=urgent_timeout),
            )
        elif kind == "azure":
            st = AzureStorage(url, AzureOptions(read_timeout=60, urgent_timeout=urgent_timeout))
        else:
            st = GCSStorage(url, GCSOptions(timeout=60))
        t0 = time.monotonic()
        with pytest.raises(StorageError):
            st.put_bytes("step-00000001/manifest.json", b"{}", exclusive=True, deadline=t0 + 2)
        took = time.monotonic() - t0
    finally:
        proxy.stop()
    assert took < 6, took  # the 2 s deadline, not the 60 s timeouts (slack for a busy 2-core box)
