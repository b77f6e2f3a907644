"""What a task's environment takes from the agent's (pure functions): the allow-list, the
agent's ``--task-env`` additions, the names an experiment passes, the recipe's ``env`` over
them; which of them a container gets; and the recipe's ``pass_env`` field."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from hypermesh.agent.tasks.containers import task_env_names
from hypermesh.agent.tasks.task_env import allowed, host_env, task_environment
from hypermesh.cli.main import main
from hypermesh.config import AgentConfig
from hypermesh.errors import RecipeError, UsageError
from hypermesh.recipe.recipe import Recipe, load_recipe
from hypermesh.recipe.redact import REDACTED, shown_env, shown_task_env

AGENT_ENV = {
    "PATH": "/usr/local/bin:/usr/bin",
    "HOME": "/home/agent",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "TZ": "UTC",
    "AWS_ACCESS_KEY_ID": "AKIAAGENT",
    "AWS_SECRET_ACCESS_KEY": "agent-aws-secret",
    "HYPERMESH_ETCD_PASSWORD": "agent-etcd-password",
    "HYPERMESH_TLS_KEY": "/etc/hypermesh/agent.key",
    "HYPERMESH_STORE": "s3://bucket/prefix",
    "NCCL_DEBUG": "INFO",
    "NCCL_SOCKET_IFNAME": "eth0",
    "HF_HOME": "/scratch/hf",
    "LCX": "not a locale",
}


def test_only_the_allow_list_of_the_agents_environment_reaches_a_task() -> None:
    assert host_env(AGENT_ENV) == {
        "PATH": "/usr/local/bin:/usr/bin", "HOME": "/home/agent", "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8", "TZ": "UTC",
    }


def test_task_env_names_and_prefixes_widen_the_allow_list() -> None:
    host = host_env(AGENT_ENV, ("NCCL_*", "HF_HOME", "NOT_SET_ON_THE_AGENT"))
    assert {k: host[k] for k in ("NCCL_DEBUG", "NCCL_SOCKET_IFNAME", "HF_HOME")} == {
        "NCCL_DEBUG": "INFO", "NCCL_SOCKET_IFNAME": "eth0", "HF_HOME": "/scratch/hf"}
    assert "NOT_SET_ON_THE_AGENT" not in host
    assert not {"AWS_SECRET_ACCESS_KEY", "HYPERMESH_ETCD_PASSWORD", "HYPERMESH_TLS_KEY",
                "AWS_ACCESS_KEY_ID", "HYPERMESH_STORE"} & set(host)


@pytest.mark.parametrize(("name", "patterns", "expected"), [
    ("PATH", ("PATH",), True),
    ("PATHX", ("PATH",), False),
    ("LC_TIME", ("LC_*",), True),
    ("LC_", ("LC_*",), True),
    ("LCX", ("LC_*",), False),
    ("NCCL_DEBUG", ("PATH", "NCCL_*"), True),
    ("anything", (), False),
])
def test_a_pattern_is_a_name_or_a_prefix(name: str, patterns: tuple[str, ...],
                                         expected: bool) -> None:
    assert allowed(name, patterns) is expected


def test_pass_env_takes_named_variables_and_the_recipe_env_wins() -> None:
    host = host_env(AGENT_ENV)
    env = task_environment(
        host, AGENT_ENV, ("AWS_SECRET_ACCESS_KEY", "NOT_ON_THE_AGENT", "HOME"),
        {"GREETING": "hi", "HOME": "/home/recipe"},
    )
    assert env["AWS_SECRET_ACCESS_KEY"] == "agent-aws-secret"
    assert "NOT_ON_THE_AGENT" not in env  # absent, not empty
    assert "AWS_ACCESS_KEY_ID" not in env and "HYPERMESH_ETCD_PASSWORD" not in env
    assert (env["GREETING"], env["HOME"], env["PATH"]) == (
        "hi", "/home/recipe", "/usr/local/bin:/usr/bin")
    assert host == host_env(AGENT_ENV)  # the shared allow-listed part is not changed


def test_a_container_gets_the_tasks_variables_but_not_the_hosts() -> None:
    host = host_env(AGENT_ENV)
    env = task_environment(host, AGENT_ENV, ("AWS_SECRET_ACCESS_KEY",), {"GREETING": "hi"})
    env.update(HM_TASK_ID="wf.e.0", LANG="en_US.UTF-8")
    # PATH, HOME... describe the host; a variable the task set over one goes in.
    assert task_env_names(env, host) == [
        "AWS_SECRET_ACCESS_KEY", "GREETING", "HM_TASK_ID", "LANG"]


def test_agent_config_checks_task_env_names() -> None:
    assert AgentConfig.local(task_env=["NCCL_*", "HF_HOME"]).task_env == ("NCCL_*", "HF_HOME")
    for bad in ("*", "A-B", "1X", "NCCL_**", "X*Y", ""):
        with pytest.raises(UsageError, match="--task-env"):
            AgentConfig.local(task_env=(bad,))


def test_agent_start_rejects_a_bad_task_env() -> None:
    result = CliRunner().invoke(main, ["agent", "start", "--task-env", "A-B"])
    assert result.exit_code == 2 and "--task-env 'A-B'" in result.output


def test_a_recipe_names_what_it_passes(tmp_path: Path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text(
        "experiments:\n"
        "  many:\n    pass_env: [AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY]\n"
        "    command: [env]\n"
        "  one:\n    pass_env: HF_TOKEN\n    command: [env]\n"
        "  none:\n    command: [env]\n"
    )
    recipe = load_recipe(path, ())
    assert [e.pass_env for e in recipe.experiments] == [
        ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"), ("HF_TOKEN",), ()]
    assert Recipe.from_json(recipe.to_json()) == recipe


def test_pass_env_takes_only_variable_names(tmp_path: Path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text(
        "experiments:\n  e:\n    pass_env: [OK, 1BAD, 'A B', OK, [X]]\n    command: [env]\n")
    with pytest.raises(RecipeError) as caught:
        load_recipe(path, ())
    found = {(p.line, p.path) for p in caught.value.problems}
    assert found == {(3, "experiments.e.pass_env[1]"), (3, "experiments.e.pass_env[2]"),
                     (3, "experiments.e.pass_env[3]"), (3, "experiments.e.pass_env[4]")}
    assert "variable 'OK' is listed twice" in str(caught.value)


def test_env_values_are_never_shown(tmp_path: Path) -> None:
    assert shown_env({"API_TOKEN": "s3cr3t", "MODE": "fast"}) == {
        "API_TOKEN": REDACTED, "MODE": REDACTED}
    path = tmp_path / "r.yaml"
    path.write_text("env: {API_TOKEN: s3cr3t}\nexperiments:\n  e:\n    env: {MODE: fast}\n"
                    "    pass_env: [AWS_PROFILE]\n    command: [env]\n")
    (exp,) = load_recipe(path, ()).experiments
    assert shown_task_env(exp) == {
        "env": {"API_TOKEN": "***", "MODE": "***"}, "pass_env": ["AWS_PROFILE"]}
