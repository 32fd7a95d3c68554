"""The redacting log filter on the shapes the SDKs print (the storage tests run it against real servers)."""

from __future__ import annotations

import io
import logging

import pytest

from spotguard.redact import MASK, RedactingFilter, install, redact, secret_values

TOKEN = "ya29.a0AfH6SMBexampleTOKEN0123456789"
SIG = "RlDkzNXP%2B7zHX8LrhZaNgquNnZ1u8E0Het6FcBsZygQ%3D"


@pytest.mark.parametrize(
    "text",
    [
        f"headers={{'Authorization': b'Bearer {TOKEN}', 'X-Amz-Date': b'20260101T000000Z'}}",
        f"Authorization: Bearer {TOKEN}",
        f"x-amz-security-token:{TOKEN}\nhost:127.0.0.1",
        f"'X-Amz-Security-Token': b'{TOKEN}'",
        f'{{"access_token": "{TOKEN}", "expires_in": 3599}}',
        f"grant_type=urn%3Aietf&assertion={TOKEN}",
        f"x-goog-iam-authorization-token: {TOKEN}",
        f"GET /b/o?X-Goog-Signature={TOKEN}&X-Goog-Date=1 HTTP/1.1",
        f"<Credentials><SessionToken>{TOKEN}</SessionToken><SecretAccessKey>{TOKEN}</SecretAccessKey>",
        f"BlobEndpoint=http://h/a;AccountKey={TOKEN};",
        f"SharedKey devstoreaccount1:{TOKEN}",
        f"headers: {{'X-aws-ec2-metadata-token': '{TOKEN}'}}",
        f"x-ms-encryption-key: {TOKEN}",
    ],
)
def test_secret_shapes_are_masked(text):
    assert TOKEN not in redact(text)
    assert MASK in redact(text)


def test_sas_signature_masked_and_the_rest_of_the_url_kept():
    line = f'"GET /acct/c?restype=container&comp=list&sv=2026-10-06&sig={SIG} HTTP/1.1" 200 None'
    assert redact(line) == f'"GET /acct/c?restype=container&comp=list&sv=2026-10-06&sig={MASK} HTTP/1.1" 200 None'


def test_values_from_the_environment_are_masked_anywhere():
    env = {
        "AWS_SESSION_TOKEN": "IQoJb3JpZ2luX2VjEXAMPLE/session+token=",
        "AZURE_STORAGE_CONNECTION_STRING": f"BlobEndpoint=http://h/a;SharedAccessSignature=sv=1&sig={SIG}",
    }
    values = secret_values(env)
    text = "body b'IQoJb3JpZ2luX2VjEXAMPLE%2Fsession%2Btoken%3D' then RlDkzNXP+7zHX8LrhZaNgquNnZ1u8E0Het6FcBsZygQ="
    assert redact(text, values) == f"body b'{MASK}' then {MASK}"


def test_filter_on_a_handler_cleans_third_party_records_and_tracebacks():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    owner = logging.getLogger("test_redact_owner")
    owner.addHandler(handler)
    owner.setLevel(logging.DEBUG)
    owner.propagate = False
    try:
        assert isinstance(install(owner), RedactingFilter)
        install(owner)  # idempotent: one filter per handler
        assert len(handler.filters) == 1
        child = logging.getLogger("test_redact_owner.botocore.endpoint")  # a library's logger, no filter of its own
        child.debug("Sending http request: %s", {"Authorization": f"Bearer {TOKEN}"})
        try:
            raise RuntimeError(f"refused: Authorization: Bearer {TOKEN}")
        except RuntimeError:
            child.exception("request failed")
    finally:
        owner.removeHandler(handler)
    out = stream.getvalue()
    assert TOKEN not in out
    assert "Sending http request" in out and "RuntimeError: refused" in out


def test_cli_error_lines_are_masked_too(capsys):
    from argparse import Namespace

    from spotguard.ops.cli._output import fail

    assert fail(Namespace(json=True), f"cannot read http://h/a/c/b?sv=1&sig={SIG}: 403") == 1
    out, err = capsys.readouterr()
    assert SIG not in out + err and f"sig={MASK}" in err and f"sig={MASK}" in out
