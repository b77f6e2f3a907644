"""What a task's environment takes from the agent's: an allow-list, and the names its
recipe asks for.

A task never inherits the agent's environment, which holds the agent's own credentials
(``HYPERMESH_ETCD_PASSWORD``, ``HYPERMESH_TLS_*``, the object store's ``AWS_*``). It gets

1. the agent's variables on the allow-list: ``TASK_ENV_ALLOWED`` (what a program expects
   of a login session, and nothing that holds a secret) plus the agent's ``--task-env``
   names or ``PREFIX*`` patterns for a site's own;
2. the agent's variables the experiment names in ``pass_env`` (a name the agent lacks is
   absent): the way a recipe asks for a credential;
3. the recipe's ``env`` (top level, then the experiment's), over both;

and then, set by the agent over all of these, its parameters (``HM_PARAM_*``), the
``HM_*`` variables of the attempt, ``CUDA_VISIBLE_DEVICES`` and the lifeline's marker
(``agent/tasks/attempts.py``, ``agent/gang/duty.py``, ``agent/tasks/runner.py``).

A container gets the task's variables except those of step 1, which describe the host
(``task_env_names`` in ``containers.py``): the runtime's client (``docker run``) is itself
the task's process, so it sees the task's environment and nothing of the agent's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

TASK_ENV_ALLOWED: tuple[str, ...] = (
    # Who and where: what a login shell sets.
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "HOSTNAME",
    # Locale, time zone, terminal, temporary files.
    "LANG", "LANGUAGE", "LC_*", "TZ", "TERM", "TMPDIR",
    # Shared libraries: where a site keeps CUDA and its other libraries.
    "LD_LIBRARY_PATH",
    # How a container runtime's client reaches its daemon (rootless podman needs
    # XDG_RUNTIME_DIR); the folder of registry logins, not the logins themselves.
    "XDG_RUNTIME_DIR", "DOCKER_HOST", "DOCKER_CONTEXT", "DOCKER_CONFIG", "CONTAINER_HOST",
)
"""The agent's variables every task gets when the agent has them. A name ending in ``*``
stands for every name with that prefix. None of them holds a secret; an agent's
``--task-env`` adds a site's own (``NCCL_*``, ``HF_HOME``)."""


def allowed(name: str, patterns: Iterable[str]) -> bool:
    """Whether ``name`` is one of ``patterns``: a name, or a prefix ending in ``*``."""
    for pattern in patterns:
        if name == pattern or (pattern.endswith("*") and name.startswith(pattern[:-1])):
            return True
    return False


def host_env(agent_env: Mapping[str, str], extra: Iterable[str] = ()) -> dict[str, str]:
    """The agent's variables on the allow-list (``TASK_ENV_ALLOWED`` and ``extra``),
    which every task on this node gets: computed once, when the agent starts."""
    patterns = (*TASK_ENV_ALLOWED, *extra)
    return {k: v for k, v in agent_env.items() if allowed(k, patterns)}


def task_environment(
    host: Mapping[str, str],
    agent_env: Mapping[str, str],
    pass_env: Iterable[str],
    recipe_env: Mapping[str, str],
) -> dict[str, str]:
    """The environment an experiment's tasks share, before the agent's own ``HM_*``
    variables: ``host`` (the allow-listed part of the agent's environment), the agent's
    variables named in ``pass_env`` that it has, and ``recipe_env`` over both."""
    env = dict(host)
    for name in pass_env:
        value = agent_env.get(name)
        if value is not None:
            env[name] = value
    env.update(recipe_env)
    return env
