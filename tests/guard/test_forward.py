"""``Forward``: the Guard's public names for its parts' attributes read them live, cannot be assigned,
and keep their documentation where ``help(Guard)`` shows it."""

from __future__ import annotations

import pydoc

import pytest

import spotguard
from spotguard.guard.forward import Forward


def test_a_forwarded_attribute_reads_the_part_live_and_refuses_assignment(tmp_path):
    guard = spotguard.Guard(str(tmp_path), providers=[], lease_ttl=None)
    assert guard.stopped_at is None and guard.last_saved is None
    guard.stops.stopped_at = 12  # what a stop records
    assert guard.stopped_at == 12
    with pytest.raises(AttributeError, match=r"stopped_at is read-only \(it is stops.stopped_at\)"):
        guard.stopped_at = 3
    assert guard.stops.stopped_at == 12


def test_the_guards_forwarded_names_are_documented_in_help():
    text = " ".join(w for w in pydoc.render_doc(spotguard.Guard, renderer=pydoc.plaintext).split() if w != "|")
    for name in ("window", "stopped_at", "notice", "emergency_error", "window_error", "last_saved"):
        assert isinstance(vars(spotguard.Guard)[name], Forward)
        doc = vars(spotguard.Guard)[name].__doc__
        assert doc and f"{name} {' '.join(doc.split()[:8])}" in text, name
