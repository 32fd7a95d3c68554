"""Keep credentials out of logs: a ``logging.Filter`` that blanks secrets in every record it sees.

Why: at DEBUG the cloud SDKs log their requests on the wire. botocore prints every header
(``X-Amz-Security-Token``, ``Authorization``) and the canonical request it signs; urllib3 prints
request lines whose query holds an Azure SAS signature (``sig=``); a token endpoint's JSON or an STS
answer may be printed as a response body. The filter sits on handlers (not loggers), so the records
of every library that reach the handler are cleaned, whichever logger made them.

Two passes over the formatted message, the exception text and the stack text:

1. Patterns: the value after a known secret name, in the forms SDKs print (header lines, dict
   reprs, query strings, connection strings, JSON, XML), bearer tokens and SigV4 signatures.
2. Values: the secrets found in the environment when the filter is made (``AWS_SECRET_ACCESS_KEY``,
   ``AWS_SESSION_TOKEN``, an Azure connection string's key or SAS...), raw and URL-encoded,
   wherever they appear.

The ``spotguard`` CLI installs it on its handlers (``install``); a program that uses the library
and logs at DEBUG can do the same after its own logging setup: ``spotguard.redact.install()``.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Mapping
from urllib.parse import quote, unquote

__all__ = ["MASK", "RedactingFilter", "install", "redact", "secret_values"]

MASK = "<redacted>"

# Names whose value is a secret wherever they appear (header, query parameter, JSON key, setting).
_NAMES = (
    r"authorization|proxy-authorization|x-amz-security-token|x-amz-signature|x-amz-credential"
    r"|x-goog-signature|x-goog-credential|x-goog-api-key|x-goog-iam-authorization-token"
    r"|x-ms-copy-source-authorization|sig|signature|access_token|refresh_token|id_token|client_secret"
    r"|assertion|subject_token|private_key|secretaccesskey|sessiontoken|secret_access_key|session_token"
    r"|aws_secret_access_key|aws_session_token|aws_security_token|accountkey|account_key"
    r"|sharedaccesssignature|sas_token|password|token|x-aws-ec2-metadata-token"
    r"|x-amz-server-side-encryption-customer-key|x-goog-encryption-key|x-ms-encryption-key"
)
_PATTERNS = [
    # Header line or canonical request line: "Authorization: AWS4-HMAC..." / "x-amz-security-token:VALUE".
    re.compile(rf"(?im)^(\s*(?:{_NAMES})\s*:[ \t]*)(\S.*)$"),
    # Python reprs and JSON: 'Authorization': b'...', "access_token": "...".
    re.compile(rf"""(?i)(['"](?:{_NAMES})['"]\s*:\s*b?)(['"])(?:\\.|(?!\2).)*\2"""),
    # Query strings, connection strings, form bodies: sig=...&, AccountKey=...;
    re.compile(rf"""(?i)((?<![\w-])(?:{_NAMES})=)([^&;\s'"<>,)]+)"""),
    # XML answers (STS, IMDS): <SecretAccessKey>...</SecretAccessKey>.
    re.compile(r"(?i)(<(SecretAccessKey|SessionToken|Token)>)[^<]*(?=</\2>)"),
    # Bearer and SharedKey credentials wherever they are printed.
    re.compile(r"(?i)(\b(?:Bearer|SharedKey(?:Lite)?)\s+)([A-Za-z0-9._~+/:=-]+)"),
    # botocore.auth prints "Signature:\n<64 hex digits>".
    re.compile(r"(?i)(\bSignature:\s*)([0-9a-f]{64})"),
]

# Environment variables that hold a secret (values of at least _MIN_LEN characters are masked).
SECRET_ENV = (
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AZURE_STORAGE_KEY",
    "AZURE_STORAGE_ACCESS_KEY",
    "AZURE_STORAGE_SAS_TOKEN",
    "AZURE_CLIENT_SECRET",
    "GOOGLE_OAUTH_ACCESS_TOKEN",
    "CLOUDSDK_AUTH_ACCESS_TOKEN",
)
_CONNECTION = "AZURE_STORAGE_CONNECTION_STRING"
_MIN_LEN = 8


def _mask_pattern(m: re.Match[str]) -> str:
    if m.re.groups >= 2 and m.group(2) in ("'", '"'):  # a quoted value: keep the quotes
        return f"{m.group(1)}{m.group(2)}{MASK}{m.group(2)}"
    return m.group(1) + MASK


def secret_values(env: Mapping[str, str] | None = None) -> list[str]:
    """The secrets in ``env`` (default: ``os.environ``): known variables and an Azure connection string's parts."""
    env = os.environ if env is None else env
    found = [env.get(name, "").strip() for name in SECRET_ENV]
    for part in env.get(_CONNECTION, "").split(";"):
        key, _, value = part.partition("=")
        if key.strip().lower() in ("accountkey", "sharedaccesssignature"):
            found.append(value.strip())
            found += [p.partition("=")[2] for p in value.split("&") if p.lower().startswith("sig=")]
    out: set[str] = set()
    for value in found:
        for form in (value, unquote(value), quote(value, safe=""), quote(value, safe="/")):
            if len(form) >= _MIN_LEN:
                out.add(form)
    return sorted(out, key=len, reverse=True)  # longest first: a value never leaves its tail behind


def redact(text: str, values: Iterable[str] = ()) -> str:
    """``text`` with every secret it shows replaced by ``MASK``."""
    for pattern in _PATTERNS:
        text = pattern.sub(_mask_pattern, text)
    for value in values:
        if value in text:
            text = text.replace(value, MASK)
    return text


class RedactingFilter(logging.Filter):
    """Rewrites each record's message, exception and stack text with the secrets masked; drops nothing."""

    def __init__(self, values: Iterable[str] | None = None) -> None:
        super().__init__()
        self.values = list(secret_values() if values is None else values)
        self._formatter = logging.Formatter()

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a broken record: let the handler report it as it would
            return True
        clean = redact(message, self.values)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            record.exc_text = self._formatter.formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text, self.values)
        if record.stack_info:
            record.stack_info = redact(record.stack_info, self.values)
        return True


def install(logger: logging.Logger | None = None) -> RedactingFilter:
    """Add one ``RedactingFilter`` to every handler of ``logger`` (default: the root logger) that has none."""
    target = logger or logging.getLogger()
    flt = RedactingFilter()
    for handler in target.handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(flt)
    return flt
