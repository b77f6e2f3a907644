"""Watching for the cloud's spot interruption notice.

EC2 announces a spot interruption about two minutes ahead at the instance
metadata path ``spot/instance-action``: 404 while there is none, then a JSON
document such as ``{"action": "terminate", "time": "2026-11-22T03:40:00Z"}``.
Instance metadata v2 wants a session token first (a PUT to
``/latest/api/token``); we ask for one and fall back to v1 when that fails.

``parse_notice`` and ``drain_grace`` are pure; ``watch`` does the polling.
"""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from urllib.parse import urlsplit, urlunsplit

log = logging.getLogger(__name__)

TOKEN_TTL_S = 21600
HTTP_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class Notice:
    """An interruption notice: what will happen, and when (Unix seconds; None if unknown)."""

    action: str
    at: float | None


def parse_notice(body: bytes) -> Notice:
    """Parse the metadata document; a body that is not the expected JSON still
    counts as a notice (better to drain early than to be killed mid-task)."""
    try:
        data = json.loads(body)
        action = str(data.get("action", "terminate"))
        when = data.get("time")
        at = datetime.fromisoformat(str(when).replace("Z", "+00:00")).timestamp() if when else None
    except (ValueError, AttributeError, TypeError):
        return Notice("terminate", None)
    return Notice(action, at)


def drain_grace(notice: Notice, now: float, kill_grace: float) -> float:
    """Seconds running tasks get between SIGTERM and SIGKILL after a notice:
    the configured grace, but never more than half the time left before the
    machine goes, so the claims are released while the node can still talk."""
    if notice.at is None:
        return kill_grace
    return max(0.0, min(kill_grace, (notice.at - now) / 2))


def _token_url(url: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, "/latest/api/token", "", ""))


def fetch_notice(url: str) -> Notice | None:
    """One poll: the notice, or None while there is none. Raises OSError when the
    metadata service cannot be reached."""
    headers = {}
    try:
        request = urllib.request.Request(
            _token_url(url), method="PUT",
            headers={"X-aws-ec2-metadata-token-ttl-seconds": str(TOKEN_TTL_S)},
        )
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as resp:
            headers["X-aws-ec2-metadata-token"] = resp.read().decode()
    except OSError:
        pass  # no IMDSv2 token: try v1
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url, headers=headers), timeout=HTTP_TIMEOUT_S
        ) as resp:
            return parse_notice(resp.read())
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        raise


async def watch(url: str, interval: float, on_notice: Callable[[Notice], None]) -> None:
    """Poll ``url`` every ``interval`` s until a notice arrives; call ``on_notice`` once."""
    warned = False
    while True:
        try:
            notice = await asyncio.to_thread(fetch_notice, url)
        except OSError as exc:
            if not warned:
                log.warning("spot notice endpoint %s unreachable: %s", url, exc)
                warned = True
            notice = None
        if notice is not None:
            on_notice(notice)
            return
        await asyncio.sleep(interval)
