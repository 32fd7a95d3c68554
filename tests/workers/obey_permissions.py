"""Run a script with file permissions enforced, also as root: ``python obey_permissions.py SCRIPT ARGS...``
(or ``-m MODULE ARGS...``).

Root ignores ``chmod 000`` through two capabilities (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH); this
drops them from this process (uid 0 stays, so the interpreter's files stay readable), then runs
SCRIPT as ``__main__``. Exits 77 where they cannot be dropped (the caller skips).
"""

from __future__ import annotations

import ctypes
import os
import runpy
import sys

_VERSION_3 = 0x20080522  # _LINUX_CAPABILITY_VERSION_3: two 32-bit words per set
_DAC = (1 << 1) | (1 << 2)  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH


def drop_dac() -> bool:
    if os.geteuid() != 0:
        return True  # permissions apply already
    libc = ctypes.CDLL(None, use_errno=True)
    header = (ctypes.c_uint32 * 2)(_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable; low word then high word
    if libc.capget(header, data) != 0:
        return False
    for i in (0, 1, 2):
        data[i] &= ~_DAC & 0xFFFFFFFF
    return libc.capset(header, data) == 0


if __name__ == "__main__":
    if not drop_dac():
        sys.exit(77)
    if sys.argv[1] == "-m":
        sys.argv = sys.argv[2:]
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.argv = sys.argv[1:]
        runpy.run_path(sys.argv[0], run_name="__main__")
