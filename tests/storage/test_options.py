"""Every cloud backend's options check their fields when made (``storage.options.TransferOptions``):
a value out of range is a ``ConfigError`` naming the field, before any transfer starts."""

from __future__ import annotations

import pytest

from spotguard.errors import ConfigError
from spotguard.storage.azure import AzureOptions
from spotguard.storage.gcs import GCSOptions
from spotguard.storage.s3 import S3Options

BACKENDS = [S3Options, GCSOptions, AzureOptions]


@pytest.mark.parametrize("options", BACKENDS)
def test_the_defaults_pass_and_fields_are_keywords_only(options):
    made = options()
    assert made.retry.attempts >= 1 and made.concurrency >= 1
    with pytest.raises(TypeError):
        options(16 << 20)  # a positional value would land in whichever field comes first


@pytest.mark.parametrize("options", BACKENDS)
@pytest.mark.parametrize(
    "field, value",
    [("concurrency", 0), ("concurrency", True), ("page_size", 0), ("page_size", 5001), ("retry", 3)],
)
def test_a_shared_field_out_of_range_names_itself(options, field, value):
    with pytest.raises(ConfigError, match=rf"{options.__name__}\.{field} must be"):
        options(**{field: value})


@pytest.mark.parametrize(
    "options, field, value",
    [
        (S3Options, "request_attempts", 0),
        (S3Options, "read_timeout", 0.0),
        (S3Options, "urgent_timeout", float("inf")),
        (S3Options, "part_size", 1 << 20),  # S3's least part is 5 MiB
        (S3Options, "page_size", 1001),  # S3 lists at most 1000 keys a request
        (S3Options, "endpoint_url", "localhost:9000"),
        (AzureOptions, "connect_timeout", -1),
        (AzureOptions, "block_size", 4001 << 20),
        (AzureOptions, "account_url", "ftp://x"),
        (GCSOptions, "timeout", 0),
        (GCSOptions, "composite_threshold", -1),
        (GCSOptions, "project", " "),
    ],
)
def test_a_backends_own_bound_names_the_field(options, field, value):
    with pytest.raises(ConfigError, match=rf"{options.__name__}\.{field}"):
        options(**{field: value})


def test_the_checks_beyond_bounds_stay():
    with pytest.raises(ConfigError, match="256 KiB"):
        GCSOptions(chunk_size=300_000)
    with pytest.raises(ConfigError, match="block_checksum"):
        AzureOptions(block_checksum="sha1")
