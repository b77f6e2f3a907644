"""An idle connection to an agent whose host vanished without a word (its link cut: no
FIN, no RST, as when a NAT forgets the mapping or a spot machine is gone) is noticed by
the keep-alive pings of ``hypermesh/keepalive.py``, where a channel without them stays
"connected" into the void.

The agents' own values (a ping after 30 s idle, given up after 10 s more) would make
this test wait 40 s; it uses 6 s / 2 s (the agent's server accepts pings 5 s apart), so
the dead connection must be noticed within 8 s of the cut and some slack. That the
agents' channels carry the 30 s / 10 s options, and that 40 s is below the NAT idle
timeouts met in practice, is ``tests/ops/test_keepalive.py``'s.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from hypermesh.local.netns import AGENT_PORT, NetMesh
from hypermesh.local.processes import wait_for

PROBE = str(Path(__file__).with_name("probe.py"))
PING_S, PING_TIMEOUT_S = 6.0, 2.0
SLACK_S = 4.0  # timers of a loaded 2-core machine, and the probe's own reporting


def test_a_dead_path_is_noticed_by_the_keepalive_only(net_mesh: NetMesh) -> None:
    mesh = net_mesh
    mesh.add_agent("far", slots=1)
    address = f"{mesh.lab.address('far')}:{AGENT_PORT}"
    wait_for(lambda: {r["name"] for r in mesh.hm_json("nodes")} == {"far"}, 30,
             "the agent to register")
    watch = mesh.lab.popen("client", [sys.executable, PROBE, "idle-channels", address,
                                      str(PING_S), str(PING_TIMEOUT_S)],
                           stdout=subprocess.PIPE, env=mesh.env)
    lines: list[dict[str, Any]] = []

    def read() -> None:
        assert watch.stdout is not None
        for raw in watch.stdout:
            lines.append(json.loads(raw))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        wait_for(lambda: any("ready" in line for line in lines), 30,
                 "the probe's channels to connect")

        def state(channel: str, before: float | None = None) -> str | None:
            seen = [line for line in lines if line.get("channel") == channel
                    and (before is None or line["t"] <= before)]
            return seen[-1]["state"] if seen else None

        # Both channels settle READY and stay idle; then the far host is cut off.
        wait_for(lambda: state("keepalive") == "READY" and state("plain") == "READY", 10,
                 "both channels to report READY")
        cut_at = time.time()
        mesh.lab.cut_off("far")

        def left_ready() -> dict[str, Any] | None:
            return next((line for line in lines if line.get("channel") == "keepalive"
                         and line["t"] > cut_at and line["state"] != "READY"), None)

        noticed = wait_for(left_ready, PING_S + PING_TIMEOUT_S + SLACK_S + 10,
                           "the keep-alive channel to notice the dead connection")
        assert isinstance(noticed, dict)
        after = noticed["t"] - cut_at
        print(f"\nkeep-alive channel {noticed['state']} {after:.2f}s after the cut; "
              f"plain channel still {state('plain')}")
        assert after <= PING_S + PING_TIMEOUT_S + SLACK_S, lines
        # The control: without pings, nothing tells the other channel (its next call
        # would be written into the dead connection and wait out TCP's retransmissions).
        assert state("plain", before=noticed["t"]) == "READY", lines
    finally:
        watch.kill()
        watch.wait()
        mesh.lab.heal_off("far")
