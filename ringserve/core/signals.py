"""A stop signal that arrives twice, in the one-file executable.

``ringserve serve`` drains on a first SIGINT or SIGTERM and stops at once on a second; ``ringserve
chat`` cancels its generation on a first Ctrl-C. The one-file executable (``packaging/ringserve.spec``)
runs as two processes: PyInstaller's bootloader, which unpacks the program, and the Python process it
starts, and the bootloader passes every signal it receives on to that process (PyInstaller's
``--bootloader-ignore-signals`` would stop that, and with it a ``docker stop`` or ``kill PID``, which
reach the bootloader alone). A signal sent to both, as Ctrl-C in a terminal (the foreground process
group), ``kill -- -PGID`` or systemd's default ``KillMode=control-group`` do, therefore reaches the
Python process twice, a few milliseconds apart: as a drain cut short and a cancel interrupted.

:class:`EchoFilter` tells such an echo from a second signal by time: a signal within
:data:`ECHO_SECONDS` of the last one it let through is the same request. Outside the one-file
executable nothing echoes and the window is 0.
"""

from __future__ import annotations

import attrs

from ringserve.core.frozen import FROZEN

#: Seconds after a signal in which another is its echo: 1 s in the one-file executable (the echo
#: comes within milliseconds, a person's second Ctrl-C later), 0 (no echo) elsewhere.
ECHO_SECONDS = 1.0 if FROZEN else 0.0


@attrs.define
class EchoFilter:
    """Which signals are echoes of the one before.

    Args:
        window: seconds after a signal let through in which the next ones are its echo (0: none is).
    """

    window: float
    _last: float | None = None

    def is_echo(self, now: float) -> bool:
        """Whether a signal received at ``now`` (seconds, any monotonic clock) is an echo; a signal
        that is not starts a new window."""
        if self._last is not None and now - self._last < self.window:
            return True
        self._last = now
        return False
