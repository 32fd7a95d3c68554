"""Which cloud is this? Three metadata probes in parallel, short timeouts, one cached answer.

Each probe asks something only that cloud's metadata service answers the right way: the IMDSv2
token (AWS; with ``$SPOTGUARD_AWS_ALLOW_IMDSV1`` an IMDSv1 read where the token is refused; where
the token request times out but an IMDSv1 read is answered, as in a container behind a hop limit
of 1, AWS is found all the same, with a warning, so the problem is never silent), the
``Metadata-Flavor: Google`` response header (GCP), the VM name with the ``Metadata: true`` header
(Azure). Off-cloud, 169.254.169.254 usually does not answer at all, so
the probes run in daemon threads and the caller waits for them no longer than the deadline.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from .. import _env
from . import aws, azure, gcp
from ._http import MetadataClient, MetadataHTTPError

logger = logging.getLogger(__name__)

_cache: dict[tuple[tuple[tuple[str, str], ...], bool], list[str]] = {}
_lock = threading.Lock()


V1_PROBE = "/latest/meta-data/instance-id"
#: Time left for the IMDSv1 read after a token request timed out (the service answers in ~1 ms).
V1_TIMEOUT = 0.25


def _aws(client: MetadataClient) -> bool:
    try:
        resp = client.request("PUT", "/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": "60"})
    except MetadataHTTPError as e:
        if not e.read_timeout:
            raise
        # Connected, but the token's answer never came back: a container behind a hop limit of 1
        # drops it, while IMDSv1 GETs still get through. Off AWS nothing answers either request.
        v1 = client.request("GET", V1_PROBE, {}, timeout=V1_TIMEOUT)
        if v1.status not in (200, 401):  # 401: IMDSv2 is required, still an AWS metadata service
            return False
        if v1.status == 200 and _env.flag(_env.AWS_ALLOW_IMDSV1, default=False):
            logger.warning(
                "AWS metadata service at %s: IMDSv2 token request timed out; using IMDSv1 as allowed by $%s",
                client.base_url,
                _env.AWS_ALLOW_IMDSV1,
            )
        else:
            logger.warning("AWS metadata service at %s: %s", client.base_url, aws.HOP_LIMIT_HINT)
        return True
    if resp.status in (403, 404, 405) and _env.flag(_env.AWS_ALLOW_IMDSV1, default=False):
        resp = client.request("GET", V1_PROBE, {})  # as AwsProvider falls back
    return resp.status == 200 and bool(resp.body)


def _gcp(client: MetadataClient) -> bool:
    resp = client.request("GET", "/computeMetadata/v1/instance/preempted", gcp.HEADERS)
    return resp.status == 200 and resp.headers.get("metadata-flavor") == "Google"


def _azure(client: MetadataClient) -> bool:
    resp = client.request("GET", azure.VM_NAME, azure.HEADERS)
    return resp.status == 200 and bool(resp.body.strip())


PROBES: dict[str, tuple[Callable[[], str], Callable[[MetadataClient], bool]]] = {
    "aws": (aws.endpoint, _aws),
    "gcp": (gcp.endpoint, _gcp),
    "azure": (azure.endpoint, _azure),
}


def detect(timeout: float = 0.5, *, refresh: bool = False) -> list[str]:
    endpoints = {name: get_url() for name, (get_url, _) in PROBES.items()}
    key = (tuple(sorted(endpoints.items())), _env.flag(_env.AWS_ALLOW_IMDSV1, default=False))
    with _lock:
        if not refresh and key in _cache:
            return list(_cache[key])
    found: dict[str, bool] = {}

    def run(name: str) -> None:
        try:
            client = MetadataClient.from_url(endpoints[name], timeout)
            try:
                found[name] = PROBES[name][1](client)
            finally:
                client.close()
        except Exception as e:  # off-cloud this is the normal outcome
            logger.debug("no %s metadata service at %s (%s)", name, endpoints[name], e)
            found[name] = False

    t0 = time.monotonic()
    threads = [
        threading.Thread(target=run, args=(name,), daemon=True, name=f"spotguard-detect-{name}") for name in PROBES
    ]
    for t in threads:
        t.start()
    deadline = t0 + timeout + 0.3
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    clouds = [name for name in PROBES if found.get(name)]
    logger.info("cloud detection: %s in %.2fs", clouds or "no cloud", time.monotonic() - t0)
    with _lock:
        _cache[key] = clouds
    return list(clouds)
