"""S3 settings that can never work fail at once as a ConfigError naming what to fix, before any request
(so no server is needed): an endpoint without its scheme, a bucket name botocore refuses."""

from __future__ import annotations

import time

import pytest

from spotguard.errors import ConfigError
from spotguard.ops.cli import main
from spotguard.storage import open_storage
from spotguard.storage.s3 import S3Storage
from tests.storage.conftest import AWS_ENV


@pytest.fixture(autouse=True)
def _aws(monkeypatch):
    for k, v in AWS_ENV.items():
        monkeypatch.setenv(k, v)
    for k in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(k, raising=False)


@pytest.mark.parametrize("var", ["AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"])
def test_an_endpoint_without_a_scheme_is_a_config_error_naming_the_variable(monkeypatch, var):
    monkeypatch.setenv(var, "127.0.0.1:9000")
    with pytest.raises(ConfigError) as err:  # was: ValueError: Invalid endpoint: 127.0.0.1:9000
        S3Storage("s3://bucket/run")
    assert str(err.value) == (
        f"{var}='127.0.0.1:9000' is not a valid endpoint URL: a scheme is needed, like http://127.0.0.1:9000"
    )


def test_ls_with_an_endpoint_without_a_scheme_exits_2_in_one_line(monkeypatch, capsys):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "127.0.0.1:9000")
    assert main(["ls", "s3://bucket/run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("spotguard: error: AWS_ENDPOINT_URL='127.0.0.1:9000'") and "http://" in err, err


def test_a_bucket_name_botocore_refuses_is_a_config_error_at_once():
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"invalid S3 bucket name 'Bad_Bucket!' in 's3://Bad_Bucket!/run'"):
        open_storage("s3://Bad_Bucket!/run").list()  # was: a StorageError "(gave up after retries)"
    assert time.monotonic() - t0 < 5
    assert S3Storage("s3://legacy_Bucket.1/run").bucket == "legacy_Bucket.1"  # what botocore accepts still goes


def test_an_error_never_retried_does_not_say_it_gave_up_after_retries():
    import botocore.exceptions as bex

    from spotguard.storage import s3_errors

    err = s3_errors.explain(bex.ParamValidationError(report="bad key"), "cannot list s3://b/run", "b", "s3://b/run")
    assert "gave up after retries" not in str(err) and "ParamValidationError" in str(err)
    err = s3_errors.explain(bex.ReadTimeoutError(endpoint_url="http://x"), "cannot list s3://b/run", "b", "s3://b/run")
    assert "gave up after retries" in str(err)  # a network error is retried first
