"""The heartbeat (mtp_jax/progress.py): lines while the block runs, none on a terminal,
none after it."""

from __future__ import annotations

import io
import time

from mtp_jax.progress import Heartbeat


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_heartbeat_lines_while_running_and_live_status():
    out, done = io.StringIO(), [0]
    with Heartbeat(out, every=0.05) as beat:
        beat.set("compiling")
        time.sleep(0.2)
        beat.set(lambda: f"{done[0]} requests done")
        done[0] = 3
        time.sleep(0.2)
    lines = out.getvalue().splitlines()
    assert any(x.endswith("] compiling") for x in lines)
    assert lines[-1].endswith("] 3 requests done") and lines[0].startswith("[0 s]")
    n = len(lines)
    time.sleep(0.15)
    assert len(out.getvalue().splitlines()) == n  # stopped with the block


def test_heartbeat_off_on_a_terminal():
    out = _Tty()
    with Heartbeat(out, every=0.02) as beat:
        beat.set("compiling")
        time.sleep(0.1)
    assert out.getvalue() == "" and not beat.enabled
