"""The supervisor's stop-signal handlers, in this process (the storm itself: test_stop_storm.py)."""

from __future__ import annotations

import signal

from spotguard.ops.supervisor.signals import FORWARDED, Forwarder


def test_after_a_stop_the_stop_signals_stay_ignored_until_exit():
    """A storm outlasting the run: a SIGTERM while `spotguard run` exits must not kill it (-15) before it
    exits with the stop's code (75). Without a stop, or for a library caller, the handlers are given
    back as they were."""
    handlers = {sig: signal.getsignal(sig) for sig in FORWARDED}
    before = handlers[signal.SIGTERM], handlers[signal.SIGINT]
    try:
        calm = Forwarder(grace=1.0)
        calm.hold_after_stop = True
        calm.install()
        assert signal.getsignal(signal.SIGTERM) == calm.on_signal
        calm.restore()
        assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before

        library = Forwarder(grace=1.0)
        library.install()
        library.on_signal(signal.SIGTERM)
        library.restore()
        assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before

        stopped = Forwarder(grace=1.0)
        stopped.hold_after_stop = True  # as `spotguard run` sets it
        stopped.install()
        stopped.on_signal(signal.SIGTERM)  # no job attached: kept for the next one
        stopped.restore()
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN
    finally:  # SIGUSR1 too: left ignored, every later child of this worker ignored it (a batch shell's trap too)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
