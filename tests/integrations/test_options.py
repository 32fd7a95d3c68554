"""One validated options family: what ``Guard`` and every trainer integration take alike is
``CommonOptions``, resolved from the job's environment in one place and checked on creation, so a
misspelt or invalid option is the same clear ``ConfigError`` whichever of them it is given to."""

from __future__ import annotations

import dataclasses

import pytest

from spotguard import Guard
from spotguard.coordination.options import CommonOptions
from spotguard.errors import ConfigError
from spotguard.guard.options import GuardOptions
from spotguard.integrations._common import WatchOptions

from .test_window import FolderLoop


def hf(storage, **options):
    pytest.importorskip("transformers")
    from spotguard.integrations.hf import SpotguardCallback

    return SpotguardCallback(storage, **options)


def lightning(storage, **options):
    pytest.importorskip("lightning")
    from spotguard.integrations.lightning import SpotguardCallback

    return SpotguardCallback(storage, **options)


MAKERS = {"guard": Guard, "loop": FolderLoop, "hf": hf, "lightning": lightning}


@pytest.mark.parametrize("make", MAKERS.values(), ids=MAKERS.keys())
def test_a_misspelt_option_names_the_close_one(tmp_path, make):
    with pytest.raises(ConfigError, match=r"has no option 'stop_on_advisry' \(did you mean stop_on_advisory[ ?)]"):
        make(str(tmp_path), stop_on_advisry=True)


BAD = [
    ({"keep": 0}, "keep must be an int >= 1"),
    ({"interval": 0}, "interval must be a positive number of seconds"),
    ({"interval": "1"}, "interval must be a positive number of seconds"),
    ({"on_unloadable": "never"}, r"on_unloadable='never' is not one of \['raise', 'fresh'\]"),
    ({"untracked": "ignore"}, r"untracked='ignore' is not one of \['refuse', 'accept'\]"),
    ({"deadline_policy": "wait"}, "deadline_policy must be one of"),
    ({"window_margin": -1}, "window_margin must be a number of seconds >= 0"),
    ({"lease_ttl": 0}, "lease_ttl must be a positive number of seconds or None"),
]


@pytest.mark.parametrize("make", MAKERS.values(), ids=MAKERS.keys())
def test_invalid_common_options_are_the_same_config_error_everywhere(tmp_path, make):
    for bad, message in BAD:
        with pytest.raises(ConfigError, match=message):
            make(str(tmp_path), **{"providers": [], "lease_ttl": None, **bad})


@pytest.mark.parametrize("make", MAKERS.values(), ids=MAKERS.keys())
def test_an_unreadable_environment_variable_is_a_config_error_naming_it(tmp_path, make, monkeypatch):
    monkeypatch.setenv("SPOTGUARD_STOP_ON_ADVISORY", "maybe")
    with pytest.raises(ConfigError, match=r"\$SPOTGUARD_STOP_ON_ADVISORY must be 1 or 0"):
        make(str(tmp_path), providers=[], lease_ttl=None)


def test_the_guard_and_the_integrations_resolve_the_common_options_alike(monkeypatch):
    monkeypatch.setenv("SPOTGUARD_STOP_ON_ADVISORY", "1")
    monkeypatch.setenv("SPOTGUARD_TAKEOVER", "yes")
    monkeypatch.setenv("SPOTGUARD_DEADLINE_POLICY", "use-window")
    common = [f.name for f in dataclasses.fields(CommonOptions)]
    guard, watch = GuardOptions(), WatchOptions()
    assert {n: getattr(guard, n) for n in common} == {n: getattr(watch, n) for n in common}
    assert watch.stop_on_advisory is True and watch.takeover is True and watch.deadline_policy == "use-window"
    assert not WatchOptions(stop_on_advisory=False, takeover=False).stop_on_advisory  # given: the environment yields
    assert {f.name for f in dataclasses.fields(WatchOptions)} - set(common) == {"work_dir"}


def loop_every(storage, every_steps):
    from spotguard.integrations._loop import LoopGuard

    return LoopGuard(storage, {"every_steps": every_steps, "providers": [], "lease_ttl": None})


EVERY = {
    "guard": lambda storage, every_steps: Guard(storage, providers=[], every_steps=every_steps),
    "loop": loop_every,
    "lightning": lambda storage, every_steps: lightning(storage, providers=[], lease_ttl=None, every_steps=every_steps),
}


@pytest.mark.parametrize("make", EVERY.values(), ids=EVERY.keys())
@pytest.mark.parametrize("every_steps", [0, -5, True, "10", 2.5])
def test_every_steps_is_checked_alike_by_the_guard_and_the_loop_integrations(tmp_path, make, every_steps):
    """One check: Lightning checked none (0 silently meant never, "10" failed at the first step), the
    loop integrations took True for 1."""
    with pytest.raises(ConfigError, match="every_steps must be a positive int or None"):
        make(str(tmp_path), every_steps)


def test_a_loop_integrations_schedule_is_an_option_like_the_others(tmp_path):
    """``every_steps`` and ``save_on_exit`` are ``LoopOptions`` fields: a misspelt one is named, a bad one refused."""
    with pytest.raises(ConfigError, match=r"has no option 'every_step' \(did you mean every_steps"):
        FolderLoop(str(tmp_path), every_step=5)
    for make in (FolderLoop, Guard):  # the same rule for the Guard's save_on_exit
        with pytest.raises(ConfigError, match="save_on_exit must be True or False, got 'no'"):
            make(str(tmp_path), save_on_exit="no")
    loop = loop_every(str(tmp_path), 5)
    assert (loop.every_steps, loop.save_on_exit) == (5, True)
