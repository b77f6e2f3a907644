"""A task's environment end to end: real etcd, real agents whose environment holds
credentials. Tasks print their environment (``env``); their logs show the recipe's
variables, hypermesh's, the allow-listed ones and what ``pass_env`` names, never the
agent's credentials. ``status``, ``tasks`` and the dashboard never show an env value."""

from __future__ import annotations

import json
import os
import re
import stat
import urllib.request
from typing import Any

from hypermesh.local.agents import AgentProcess
from tests.conftest import Mesh

AWS_SECRET = "agent-aws-secret-9f3c"
ETCD_PASSWORD = "agent-etcd-password-71ab"
AWS_KEY_ID = "AKIAAGENTKEYID"
API_TOKEN = "s3cr3t"
HM_SET = ("HM_WORKFLOW_ID", "HM_EXPERIMENT", "HM_TASK_ID", "HM_TASK_INDEX", "HM_ATTEMPT",
          "HM_NODE", "HM_PYTHON", "HM_ATTEMPT_DIR", "HM_METRICS_FILE", "HM_CHECKPOINT_DIR",
          "HM_TENSORBOARD_DIR", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "HYPERMESH_LIFELINE")


def agent_with_credentials(mesh: Mesh, name: str = "node1", path: str | None = None,
                           slots: int = 2, extra: tuple[str, ...] = (),
                           aws: tuple[str, str] = (AWS_KEY_ID, AWS_SECRET)) -> AgentProcess:
    """An agent whose own environment holds credentials, as a real host's would, and
    a site's settings (``SITE_*``). ``aws``: its key id and secret (the made-up ones,
    or the test S3 server's where the agent uses a store)."""
    env = dict(os.environ, AWS_ACCESS_KEY_ID=aws[0], AWS_SECRET_ACCESS_KEY=aws[1],
               HYPERMESH_ETCD_PASSWORD=ETCD_PASSWORD, PATH=path or os.environ["PATH"],
               SITE_SCRATCH="/scratch")
    proc = AgentProcess(name, mesh.etcd.url, mesh.namespace, mesh.root / name, slots=slots,
                        extra=extra, env=env)
    mesh.agents[name] = proc
    return proc.start()


def printed_env(text: str) -> dict[str, str]:
    """The ``NAME=value`` lines of an ``env`` printout."""
    return dict(
        line.split("=", 1) for line in text.splitlines()
        if re.match(r"[A-Za-z_][A-Za-z0-9_]*=", line)
    )


def test_a_task_gets_its_recipes_environment_and_never_the_agents_credentials(
    mesh: Mesh,
) -> None:
    agent_with_credentials(mesh, extra=("--task-env", "SITE_*"))
    recipe = mesh.write_recipe("""
env: {SHARED: top}
experiments:
  plain:
    env: {OWN: mine}
    command: [env]
  passing:
    pass_env: [AWS_SECRET_ACCESS_KEY, NOT_ON_THE_AGENT]
    command: [env]
""")
    wid = mesh.submit(recipe, "--wait")
    plain_log = mesh.hm("logs", f"{wid}.plain.0", check=True).stdout
    passing_log = mesh.hm("logs", f"{wid}.passing.0", check=True).stdout
    for log in (plain_log, passing_log):
        assert ETCD_PASSWORD not in log and AWS_KEY_ID not in log
    assert AWS_SECRET not in plain_log
    plain, passing = printed_env(plain_log), printed_env(passing_log)
    assert plain["PATH"] == os.environ["PATH"] and plain["HOME"] == os.environ["HOME"]
    assert (plain["SHARED"], plain["OWN"]) == ("top", "mine")
    assert plain["SITE_SCRATCH"] == "/scratch"  # the agent's --task-env SITE_*
    assert set(HM_SET) <= set(plain), set(HM_SET) - set(plain)
    assert (plain["HM_TASK_ID"], plain["HM_NODE"]) == (f"{wid}.plain.0", "node1")
    assert passing["AWS_SECRET_ACCESS_KEY"] == AWS_SECRET
    assert "NOT_ON_THE_AGENT" not in passing and "OWN" not in passing
    assert set(passing) - set(plain) == {"AWS_SECRET_ACCESS_KEY"}


def test_a_container_client_runs_with_the_task_environment(mesh: Mesh) -> None:
    # A stand-in docker: `info` answers; `run` prints its own environment and arguments.
    bin_dir = mesh.root / "bin"
    bin_dir.mkdir()
    docker = bin_dir / "docker"
    docker.write_text('#!/bin/sh\n[ "$1" = info ] && exit 0\necho "ARGV $*"\nenv\n')
    docker.chmod(docker.stat().st_mode | stat.S_IXUSR)
    agent_with_credentials(mesh, path=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    recipe = mesh.write_recipe(f"""
experiments:
  boxed:
    image: python:3.12-slim
    env: {{API_TOKEN: {API_TOKEN}}}
    pass_env: [AWS_SECRET_ACCESS_KEY]
    command: ["python train.py"]
""")
    wid = mesh.submit(recipe, "--wait")
    log = mesh.hm("logs", f"{wid}.boxed.0", check=True).stdout
    client = printed_env(log)
    assert client["AWS_SECRET_ACCESS_KEY"] == AWS_SECRET and client["API_TOKEN"] == API_TOKEN
    assert ETCD_PASSWORD not in log and AWS_KEY_ID not in log
    (argv,) = [line for line in log.splitlines() if line.startswith("ARGV ")]
    names = re.findall(r"-e (\S+)", argv)
    assert {"AWS_SECRET_ACCESS_KEY", "API_TOKEN", "HM_TASK_ID"} <= set(names)
    assert not {"PATH", "HOME", "HYPERMESH_ETCD_PASSWORD", "AWS_ACCESS_KEY_ID"} & set(names)
    assert AWS_SECRET not in argv and API_TOKEN not in argv  # values stay off the line


def test_a_gang_member_gets_the_same_environment(mesh: Mesh) -> None:
    agent_with_credentials(mesh, "node1", slots=1)
    agent_with_credentials(mesh, "node2", slots=1)
    recipe = mesh.write_recipe("""
experiments:
  pair:
    nodes: 2
    env: {OWN: mine}
    pass_env: [AWS_SECRET_ACCESS_KEY]
    command: ["env > env-$RANK.txt"]
""")
    wid = mesh.submit(recipe, "--wait")
    for rank in ("0", "1"):
        text = (mesh.root / f"env-{rank}.txt").read_text()
        assert ETCD_PASSWORD not in text and AWS_KEY_ID not in text
        env = printed_env(text)
        assert (env["OWN"], env["AWS_SECRET_ACCESS_KEY"], env["RANK"]) == (
            "mine", AWS_SECRET, rank)
        assert env["HM_TASK_ID"] == f"{wid}.pair.0" and env["HM_GANG_SIZE"] == "2"
        # every rank the same folder: the workflow's workdir (no data)
        assert env["HM_TENSORBOARD_DIR"] == f"{mesh.root}/.hm-tensorboard/{wid}.pair.0"
        assert env["PATH"] == os.environ["PATH"]


def test_status_tasks_and_the_dashboard_never_show_an_env_value(mesh: Mesh) -> None:
    node = mesh.agent()
    recipe = mesh.write_recipe(f"""
env: {{API_TOKEN: {API_TOKEN}}}
experiments:
  e:
    parameters: {{lr: {{values: [0.1]}}}}
    command: ["true"]
""")
    wid = mesh.submit(recipe, "--wait")
    shown = [mesh.hm(*args, check=True).stdout for args in (
        ("status",), ("status", wid), ("status", wid, "--json"), ("tasks", wid),
        ("tasks", wid, "--json"))]

    def get(path: str) -> Any:
        with urllib.request.urlopen(f"http://{node.http_address}{path}", timeout=10) as r:
            return json.loads(r.read())

    workflow = get(f"/api/workflows/{wid}")
    shown += [json.dumps(get("/api/workflows")), json.dumps(workflow)]
    assert all(API_TOKEN not in text for text in shown)
    (exp,) = workflow["dag"]
    assert (exp["env"], exp["pass_env"]) == ({"API_TOKEN": "***"}, [])
