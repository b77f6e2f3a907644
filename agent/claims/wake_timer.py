"""A one-shot timer that wakes a claim loop at the earliest deadline it was given.

Deferred claims (locality in ``locality.py``, pool preference in ``pool_wait.py``) end
at a known time; the claim loop only runs when something changes, so each keeps one of
these to run a round again when its first deferral ends. Owned by the agent's event
loop; ``at`` must be called from it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


class WakeTimer:
    """Calls ``wake`` once at (just after) the earliest monotonic time passed to ``at``
    since it last fired."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self.wake = wake
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = float("inf")

    def at(self, when: float) -> None:
        """Wake at ``when`` (``time.monotonic`` seconds) unless set to wake sooner."""
        if self._timer is not None and self._timer_at <= when:
            return
        if self._timer is not None:
            self._timer.cancel()
        loop = asyncio.get_running_loop()
        self._timer_at = when
        self._timer = loop.call_later(max(0.0, when - time.monotonic()) + 0.01, self._fire)

    def _fire(self) -> None:
        self._timer, self._timer_at = None, float("inf")
        self.wake()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer, self._timer_at = None, float("inf")
