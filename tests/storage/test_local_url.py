"""``file://`` URLs as RFC 8089 reads them: ``file:///x`` and ``file://localhost/x`` are ``/x``, escapes are
decoded, another host is refused; a plain path (no scheme) is taken as it is."""

from __future__ import annotations

import pytest

from spotguard.errors import ConfigError
from spotguard.ops.cli import main
from spotguard.storage import open_storage


@pytest.mark.parametrize("prefix", ["file://", "file://localhost", "FILE://LOCALHOST"])
def test_file_urls_with_no_host_or_localhost_name_the_absolute_path(tmp_path, prefix):
    assert open_storage(f"{prefix}{tmp_path}/run").root == tmp_path / "run"  # was: ./localhost/...


def test_percent_escapes_in_a_file_url_are_decoded(tmp_path, capsys):
    folder = tmp_path / "sp ace é"
    folder.mkdir()
    url = f"file://{tmp_path}/sp%20ace%20%C3%A9"
    assert open_storage(url).root == folder
    assert main(["ls", url]) == 0  # was: "does not exist"
    assert "no checkpoints in" in capsys.readouterr().out


@pytest.mark.parametrize(
    "url, word",
    [
        ("file://otherhost/x", "an absolute path on this machine"),
        ("file://localhost", "an absolute path on this machine"),
        ("file:///tmp/a#b", "'#' as %23"),
    ],
)
def test_a_file_url_naming_another_host_or_with_a_fragment_is_a_config_error(url, word):
    with pytest.raises(ConfigError, match=word):
        open_storage(url)


@pytest.mark.parametrize("path", ["run/sp%20ace", "a#b", "localhost/x"])
def test_plain_paths_are_taken_as_they_are(tmp_path, monkeypatch, path):
    monkeypatch.chdir(tmp_path)
    assert open_storage(path).root == tmp_path / path
    assert open_storage("file://").root == tmp_path  # as before: nothing after file://
