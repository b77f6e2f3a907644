"""AttemptProcess: real subprocesses, real signals, bounded by deadlines rather than sleeps."""

from __future__ import annotations

import asyncio
import os
import shlex
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import pytest

from hypermesh.agent.tasks.runner import AttemptProcess, Outcome, direct_argv

DEADLINE = 5.0  # seconds any single step below may take before the test fails


def attempt(
    tmp_path: Path,
    commands: Sequence[str],
    *,
    timeout: float | None = None,
    grace: float = 10.0,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> AttemptProcess:
    return AttemptProcess(
        commands,
        env=dict(os.environ) if env is None else env,
        cwd=tmp_path if cwd is None else cwd,
        log_path=tmp_path / "logs" / "attempt.log",
        timeout=timeout,
        grace=grace,
    )


def run(process: AttemptProcess) -> Outcome:
    async def main() -> Outcome:
        return await asyncio.wait_for(process.run(), DEADLINE)

    return asyncio.run(main())


def log_of(tmp_path: Path) -> str:
    return (tmp_path / "logs" / "attempt.log").read_text()


async def wait_until(condition: Callable[[], bool], timeout: float = DEADLINE) -> None:
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(0.01)


def gone(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie waiting for its reaper counts as exited)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def stop_after_start(
    process: AttemptProcess, marker: Path, reason: str, grace: float | None = None
) -> tuple[Outcome, float]:
    """Run ``process``, stop it once ``marker`` exists; the outcome and seconds the stop took."""

    async def main() -> tuple[Outcome, float]:
        task = asyncio.create_task(process.run())
        await wait_until(marker.exists)
        started = time.monotonic()
        process.stop(reason, grace)
        outcome = await asyncio.wait_for(task, DEADLINE)
        return outcome, time.monotonic() - started

    return asyncio.run(main())


def q(path: Path) -> str:
    return shlex.quote(str(path))


# ------------------------------------------------------------------ commands and logs


def test_commands_run_in_order_and_succeed(tmp_path: Path) -> None:
    before = time.time()
    outcome = run(attempt(tmp_path, ["echo step-$((1))", "true", "echo step-$((2))"]))
    assert (outcome.state, outcome.exit_code, outcome.reason) == ("succeeded", 0, "exit")
    assert before <= outcome.ended_at <= time.time()
    log = log_of(tmp_path)
    assert log.index("step-1") < log.index("step-2")


def test_the_first_failing_command_ends_the_attempt(tmp_path: Path) -> None:
    outcome = run(attempt(tmp_path, ["echo step-$((1))", "exit 3", "echo never-$((2))"]))
    assert (outcome.state, outcome.exit_code, outcome.reason) == ("failed", 3, "exit")
    log = log_of(tmp_path)
    assert "step-1" in log
    assert "never" not in log  # neither run nor even announced
    assert "exit code 3" in log


def test_stdout_and_stderr_both_land_in_the_log(tmp_path: Path) -> None:
    run(attempt(tmp_path, ["echo out-$((6*7)); echo err-$((6*8)) >&2", "echo late-$((1)) >&2"]))
    log = log_of(tmp_path)
    for text in ("out-42", "err-48", "late-1"):
        assert text in log


def test_the_log_is_appended_across_attempts(tmp_path: Path) -> None:
    run(attempt(tmp_path, ["echo first-$((1))"]))
    run(attempt(tmp_path, ["echo second-$((2))"]))
    log = log_of(tmp_path)
    assert log.index("first-1") < log.index("second-2")


def test_the_log_keeps_each_command_line_before_its_output(tmp_path: Path) -> None:
    run(attempt(tmp_path, ["true", "echo a", "true", "echo b >&2"]))
    # nothing is written before the first output; from then on every line is
    assert log_of(tmp_path) == (
        "[hypermesh] $ echo a\na\n[hypermesh] $ true\n[hypermesh] $ echo b >&2\nb\n"
    )


def test_a_silent_success_leaves_no_log_file(tmp_path: Path) -> None:
    outcome = run(attempt(tmp_path, ["true", ": nothing to say"]))
    assert outcome.state == "succeeded"
    assert not (tmp_path / "logs" / "attempt.log").exists()


def test_a_silent_failure_is_logged_with_its_command(tmp_path: Path) -> None:
    outcome = run(attempt(tmp_path, ["true", "exit 4"]))
    assert (outcome.state, outcome.exit_code) == ("failed", 4)
    assert log_of(tmp_path) == "[hypermesh] $ exit 4\n[hypermesh] exit code 4\n"


def test_output_larger_than_the_pipe_arrives_whole_and_in_order(tmp_path: Path) -> None:
    lines = 200_000  # about 1.3 MB: many times a pipe's buffer, so the task waits on it
    outcome = run(attempt(tmp_path, [f"seq {lines}", "echo done"]))
    assert outcome.state == "succeeded"
    text = log_of(tmp_path).splitlines()
    assert text[1 : lines + 1] == [str(i) for i in range(1, lines + 1)]
    assert text[-2:] == ["[hypermesh] $ echo done", "done"]


def test_a_straggler_writing_after_the_attempt_ended_does_not_hold_it(tmp_path: Path) -> None:
    pid_file = tmp_path / "straggler.pid"
    command = f"(echo $BASHPID > {q(pid_file)}; exec sleep 30) & echo main"
    try:
        # bounded by DEADLINE: the attempt ends with its command, not with the straggler
        outcome = run(attempt(tmp_path, [command]))
        assert outcome.state == "succeeded"
        assert log_of(tmp_path) == f"[hypermesh] $ {command}\nmain\n"
    finally:
        asyncio.run(wait_until(lambda: pid_file.exists() and pid_file.read_text().strip() != ""))
        os.kill(int(pid_file.read_text()), 9)


def test_commands_read_no_stdin(tmp_path: Path) -> None:
    outcome = run(attempt(tmp_path, ["read line; echo read-status-$?", "cat"]))
    assert outcome.state == "succeeded"
    assert "read-status-1" in log_of(tmp_path)


def test_commands_run_in_the_workdir(tmp_path: Path) -> None:
    workdir = tmp_path / "work dir"
    workdir.mkdir()
    run(attempt(tmp_path, ["pwd > where.txt"], cwd=workdir))
    assert (workdir / "where.txt").read_text().strip() == str(workdir)


def test_env_is_passed_exactly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HM_LEAK", "from-the-agent")
    env = {"PATH": os.environ["PATH"], "HM_VALUE": "a b $HOME;`x`"}
    outcome = run(attempt(tmp_path, ["printf '<%s|%s>\\n' \"$HM_VALUE\" \"${HM_LEAK-absent}\""],
                          env=env))
    assert outcome.state == "succeeded"
    assert "<a b $HOME;`x`|absent>" in log_of(tmp_path)


def test_a_missing_workdir_fails_with_127(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-dir"
    outcome = run(attempt(tmp_path, [f"touch {q(tmp_path / 'ran')}"], cwd=missing))
    assert (outcome.state, outcome.exit_code, outcome.reason) == ("failed", 127, "exit")
    assert not (tmp_path / "ran").exists()
    assert str(missing) in log_of(tmp_path)


# ------------------------------------------------------------------ timeouts


def test_a_timeout_kills_the_command(tmp_path: Path) -> None:
    started = time.monotonic()
    outcome = run(attempt(tmp_path, ["sleep 30"], timeout=0.3))
    elapsed = time.monotonic() - started
    assert (outcome.state, outcome.reason) == ("failed", "timeout")
    assert outcome.exit_code != 0
    assert 0.3 <= elapsed < DEADLINE - 1
    assert "timed out" in log_of(tmp_path)


def test_the_timeout_covers_all_commands_together(tmp_path: Path) -> None:
    outcome = run(attempt(tmp_path, ["sleep 0.4", "echo second-$((2)); sleep 30"], timeout=0.8))
    assert (outcome.state, outcome.reason) == ("failed", "timeout")
    assert "second-2" in log_of(tmp_path)


def test_a_command_within_its_timeout_succeeds(tmp_path: Path) -> None:
    outcome = run(attempt(tmp_path, ["true"], timeout=30))
    assert (outcome.state, outcome.reason) == ("succeeded", "exit")


# ------------------------------------------------------------------ stopping


def test_cancel_stops_a_sleep_promptly_with_its_children(tmp_path: Path) -> None:
    marker, pidfile = tmp_path / "started", tmp_path / "child.pid"
    process = attempt(
        tmp_path,
        [f"sleep 60 & echo $! > {q(pidfile)}; touch {q(marker)}; wait", "touch never"],
        grace=10.0,
    )
    outcome, took = stop_after_start(process, marker, "cancelled")
    assert (outcome.state, outcome.reason) == ("cancelled", "cancelled")
    assert took < 3.0  # SIGTERM was enough: no wait for the 10 s grace
    assert not (tmp_path / "never").exists()
    child = int(pidfile.read_text())

    async def child_gone() -> None:
        await wait_until(lambda: gone(child))

    asyncio.run(child_gone())


def test_a_child_ignoring_sigterm_is_killed_after_the_grace_period(tmp_path: Path) -> None:
    marker, pidfile = tmp_path / "started", tmp_path / "child.pid"
    process = attempt(
        tmp_path,
        [f"trap '' TERM; sleep 60 & echo $! > {q(pidfile)}; touch {q(marker)}; wait"],
        grace=0.4,
    )
    outcome, took = stop_after_start(process, marker, "cancelled")
    assert (outcome.state, outcome.reason) == ("cancelled", "cancelled")
    assert 0.4 <= took < 0.4 + 3.0
    child = int(pidfile.read_text())

    async def child_gone() -> None:
        await wait_until(lambda: gone(child))

    asyncio.run(child_gone())


def test_stop_can_shorten_the_grace_period(tmp_path: Path) -> None:
    marker = tmp_path / "started"
    process = attempt(tmp_path, [f"trap '' TERM; touch {q(marker)}; sleep 60"], grace=60.0)
    outcome, took = stop_after_start(process, marker, "cancelled", grace=0.2)
    assert outcome.state == "cancelled"
    assert took < 3.0


def test_a_grandchild_that_outlives_its_parent_still_dies(tmp_path: Path) -> None:
    # bash dies on SIGTERM at once; the subshell ignoring it must still be killed.
    marker, pidfile = tmp_path / "started", tmp_path / "child.pid"
    process = attempt(
        tmp_path,
        [f"(trap '' TERM; exec sleep 60) & echo $! > {q(pidfile)}; touch {q(marker)}; wait"],
        grace=30.0,
    )
    outcome, took = stop_after_start(process, marker, "cancelled")
    assert outcome.state == "cancelled"
    assert took < 3.0
    child = int(pidfile.read_text())

    async def child_gone() -> None:
        await wait_until(lambda: gone(child))

    asyncio.run(child_gone())


@pytest.mark.parametrize("reason", ["preempted", "node-lost"])
def test_other_stop_reasons_fail_the_attempt(tmp_path: Path, reason: str) -> None:
    marker = tmp_path / "started"
    process = attempt(tmp_path, [f"touch {q(marker)}; sleep 60"], grace=10.0)
    outcome, took = stop_after_start(process, marker, reason)
    assert (outcome.state, outcome.reason) == ("failed", reason)
    assert took < 3.0


def test_the_first_stop_reason_wins(tmp_path: Path) -> None:
    marker = tmp_path / "started"
    process = attempt(tmp_path, [f"touch {q(marker)}; sleep 60"])

    async def main() -> Outcome:
        task = asyncio.create_task(process.run())
        await wait_until(marker.exists)
        process.stop("preempted")
        process.stop("cancelled")
        return await asyncio.wait_for(task, DEADLINE)

    outcome = asyncio.run(main())
    assert (outcome.state, outcome.reason) == ("failed", "preempted")


def test_a_stop_before_the_run_runs_nothing(tmp_path: Path) -> None:
    process = attempt(tmp_path, [f"touch {q(tmp_path / 'ran')}"])
    process.stop("cancelled")
    outcome = run(process)
    assert (outcome.state, outcome.exit_code, outcome.reason) == ("cancelled", None, "cancelled")
    assert not (tmp_path / "ran").exists()


# ------------------------------------------------------------------ without a shell


@pytest.mark.parametrize(
    ("command", "argv"),
    [
        ("true", ["true"]),
        ("python3 train.py --lr=0.1 --out /tmp/a,b:c@d%e+f", ["python3", "train.py", "--lr=0.1",
                                                              "--out", "/tmp/a,b:c@d%e+f"]),
        ("  sleep   1 ", ["sleep", "1"]),
        ("./run.sh", ["./run.sh"]),
        ("true --help", None),  # /bin/true answers --help; the builtin does not
        ("echo hi", None),  # builtins that differ from their programs
        ("cd /tmp", None),
        ("exit 3", None),
        (". env.sh", None),
        ("X=1 env", None),  # an assignment
        ("echo $HOME", None),
        ("ls *.txt", None),
        ("a 'b c'", None),
        ("a > out", None),
        ("a; b", None),
        ("a && b", None),
        ("a\tb", None),
        ("a\nb", None),
        ("~/bin/x", None),
        ("x # comment", None),
        ("", None),
        ("   ", None),
    ],
)
def test_which_commands_run_without_a_shell(command: str, argv: list[str] | None) -> None:
    assert direct_argv(command) == argv


def env_lines(tmp_path: Path, command: str, workdir: Path) -> dict[str, str]:
    env = {"PATH": os.environ["PATH"], "PWD": "/the/agents/folder", "HM_X": "1"}
    outcome = run(attempt(tmp_path, [command], env=env, cwd=workdir))
    assert outcome.state == "succeeded"
    lines = [line for line in log_of(tmp_path).splitlines() if "=" in line and "$" not in line]
    (tmp_path / "logs" / "attempt.log").unlink()
    return dict(line.split("=", 1) for line in lines)


def test_a_plain_command_runs_without_bash_and_sees_what_bash_would_give(
    tmp_path: Path,
) -> None:
    workdir = tmp_path / "work"
    workdir.mkdir()
    direct = env_lines(tmp_path, "env", workdir)
    shell = env_lines(tmp_path, "env;", workdir)  # the same program, through bash
    assert "SHLVL" in shell and "SHLVL" not in direct  # bash ran only the second
    # Both see the folder they run in, not the agent's, and the same variables.
    assert direct["PWD"] == shell["PWD"] == str(workdir)
    assert direct["HM_X"] == shell["HM_X"] == "1"


def test_an_environment_that_sets_bash_up_keeps_commands_in_bash(tmp_path: Path) -> None:
    setup = tmp_path / "setup.sh"
    setup.write_text("export FROM_BASH_ENV=yes\n")
    env = {"PATH": os.environ["PATH"], "BASH_ENV": str(setup)}
    outcome = run(attempt(tmp_path, ["env"], env=env))
    assert outcome.state == "succeeded"
    assert "FROM_BASH_ENV=yes" in log_of(tmp_path)  # bash read it, as without the shortcut
    # A function exported under a program's name is what bash would call.
    env = {"PATH": os.environ["PATH"], "BASH_FUNC_env%%": "() {  echo the-function; }"}
    run(attempt(tmp_path, ["env"], env=env))
    assert "the-function" in log_of(tmp_path)


def test_a_plain_command_that_cannot_start_gets_what_bash_says(tmp_path: Path) -> None:
    missing = run(attempt(tmp_path, ["no-such-program-hm arg"]))
    assert (missing.state, missing.exit_code) == ("failed", 127)
    assert "no-such-program-hm: command not found" in log_of(tmp_path)
    data = tmp_path / "data.txt"
    data.write_text("not a program\n")
    denied = run(attempt(tmp_path, ["./data.txt"]))
    assert denied.exit_code == 126
    assert "Permission denied" in log_of(tmp_path)
    # A script without #! is no program to exec: bash runs it, as before.
    script = tmp_path / "script"
    script.write_text("echo from-the-script $((40 + 2))\n")
    script.chmod(0o755)
    ran = run(attempt(tmp_path, ["./script"]))
    assert ran.state == "succeeded"
    assert "from-the-script 42" in log_of(tmp_path)
