"""The program a notebook task runs (``hypermesh notebook``): JupyterLab on its node's
loopback, reported to the mesh once it answers.

Run as ``PYTHON -m hypermesh.agent.ops.notebook_task [JUPYTER ARGS...]`` by the task's
command, with the interpreter that has ``jupyterlab`` installed. It starts ``jupyter lab``

- on ``127.0.0.1`` at a port the kernel picks (``--port=0``): nothing listens beyond the
  node; the agent's dashboard proxies ``/notebook/TASK_ID/`` to it
  (``agent/ops/notebook_proxy.py``), or a user on the node opens the loopback URL;
- under the base URL ``/notebook/TASK_ID/``, so that the same URL path works directly and
  through the proxy;
- with the token in ``JUPYTER_TOKEN`` (set by the recipe's ``env``, whose values
  ``status``, ``tasks`` and the dashboard never show, and which Jupyter prints as ``...``),
  never on a command line;
- with its runtime files (``jpserver-PID.json``: the port) under ``$HM_ATTEMPT_DIR``.

Once ``GET /notebook/TASK_ID/api`` answers on that port it appends
``{"notebook_port": PORT}`` to ``$HM_METRICS_FILE``: the agent stores it in etcd with the
attempt's metrics (fenced by the claim), where ``hypermesh notebook`` and the proxy read it.
SIGTERM and SIGINT (``cancel``, a drain) go to Jupyter, which shuts its kernels down; the
task ends with Jupyter's exit status.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

METRIC = "notebook_port"
"""The metric a notebook task reports its loopback port as."""
POLL_S = 0.1  # how often the launcher looks for Jupyter's port and first answer
ANSWER_WAIT_S = 2.0  # how long one probe of Jupyter's API waits


def base_url(task_id: str) -> str:
    """The URL path Jupyter serves under, directly and through the agent's proxy."""
    return f"/notebook/{task_id}/"


def jupyter_command(python: str, task_id: str, extra: list[str]) -> list[str]:
    return [
        python, "-m", "jupyter", "lab", "--no-browser", "--ip=127.0.0.1", "--port=0",
        f"--ServerApp.base_url={base_url(task_id)}",
        # The agent's dashboard checks Host (DNS rebinding) and the login before it proxies;
        # Jupyter's own check would refuse the dashboard's host name.
        "--ServerApp.allow_remote_access=True",
        # An agent that runs as root (a container's) runs its tasks as root: so be it.
        *(["--allow-root"] if os.geteuid() == 0 else []),
        *extra,
    ]


def find_port(runtime: Path, pid: int) -> int | None:
    """The port in Jupyter's ``jpserver-PID.json``, once it has written the file."""
    try:
        info = json.loads((runtime / f"jpserver-{pid}.json").read_text())
    except (OSError, ValueError):
        return None
    port = info.get("port")
    return port if isinstance(port, int) and port > 0 else None


def answers(port: int, task_id: str) -> bool:
    """Whether Jupyter answers ``GET BASE/api`` (its version; no token needed)."""
    url = f"http://127.0.0.1:{port}{base_url(task_id)}api"
    try:
        with urllib.request.urlopen(url, timeout=ANSWER_WAIT_S) as response:
            return bool(response.status == 200)
    except (OSError, urllib.error.URLError):
        return False


def main(argv: list[str]) -> int:
    task_id = os.environ["HM_TASK_ID"]
    runtime = Path(os.environ["HM_ATTEMPT_DIR"]) / "jupyter"
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(runtime))
    proc = subprocess.Popen(jupyter_command(sys.executable, task_id, argv), env=env)

    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    port = None
    while proc.poll() is None:
        port = port or find_port(runtime, proc.pid)
        if port is not None and answers(port, task_id):
            metrics = os.environ.get("HM_METRICS_FILE")
            line = json.dumps({METRIC: port})
            if metrics:
                with open(metrics, "a") as f:
                    f.write(line + "\n")
            else:
                print(f"HM_METRIC {line}", flush=True)
            print(f"notebook: Jupyter answers on 127.0.0.1:{port}{base_url(task_id)}",
                  file=sys.stderr, flush=True)
            break
        time.sleep(POLL_S)
    return proc.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
