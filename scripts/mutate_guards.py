#!/usr/bin/env python3
"""Mutation testing of the coordination guards (issue 27).

    .venv/bin/python scripts/mutate_guards.py [--list] [--module live.py] [--only TEXT]
                                              [--timeout S] [--no-baseline] [--json]

Every guard of the coordination code is removed or weakened in turn, in a copy of the
tree, and the tests mapped to its module (``TARGETS``) run against that copy with
``pytest -x``: a mutant is killed when a test fails, and survives when they all pass.
Exits 1 if any mutant survives (or could not be judged), 0 when every one is killed.

The guards, found in the source of each target module:

- **compares**: every call of an etcd compare helper (``etcd.absent``, ``created_at``,
  ``mod_revision_is``, ``none_created_since``, ``value_is``; ``hypermesh.state.etcd``).
  Each is removed from its compare list (an element of a list literal, an appended
  compare, a comprehension of compares; elsewhere it is made to always hold). A compare on
  a revision or a value (``mod_revision_is``, ``created_at``, ``value_is``) is also
  weakened to "the key exists", which a test passes only if it makes the key change under
  the guard rather than disappear.
- **compare lists built elsewhere**: each call of ``state_guard`` or ``claimable`` becomes
  ``[]``, and each call of ``claim_ops`` or ``finish_ops`` loses its compares (keeps its
  operations), so every transaction that borrows a guard must have a test of its own.
- **if guards**: the few ``if`` statements that decide whether a write is made at all
  (``IF_GUARDS``, named by function and condition; the script stops if one is not found).

Mutants run one at a time. The copy holds the repository's files as they are now (tracked
and untracked, not ignored, as ``git ls-files`` lists them), with ``hypermesh/agent`` and
``hypermesh/chunkfs`` linked in as installed (pyproject's package-dir); ``PYTHONPATH`` points
at it, so pytest and every agent process it starts import the mutant. The repository
itself is never written. Test files in ``TARGETS`` that do not exist are skipped.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import fnmatch
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# The tests that should catch a broken guard of each module, the direct ones first (pytest
# -x stops at the first failure, so a killed mutant costs little; a survivor runs them all).
# A file (or ``file::test``) that does not exist is skipped.
TARGETS: dict[str, tuple[str, ...]] = {
    "hypermesh/state/txns.py": (
        "tests/state/test_fences_tasks.py",
        "tests/state/test_fences_leader.py",
        "tests/state/test_fences_blocks.py",
        "tests/state/test_fences_live.py",
        "tests/state/test_fences_forged.py",
        "tests/state/test_claim_protocol.py",
        "tests/claims/test_unsure_claims.py",
        "tests/tasks/test_blocks.py",
        "tests/cli/test_live_ops.py",
        "tests/mesh/test_workflows.py",
        "tests/mesh/test_mesh.py::test_paused_agent_loses_its_claim_and_its_processes",
    ),
    "hypermesh/state/block_txns.py": (
        "tests/state/test_fences_blocks.py",
        "tests/state/test_fences_live.py",
        "tests/state/test_fences_unsure.py",
        "tests/tasks/test_blocks.py",
        "tests/claims/test_unsure_claims.py",
        "tests/tasks/test_blocks_mesh.py",
    ),
    "hypermesh/state/gang_txns.py": (
        "tests/state/test_fences_gangs.py",
        "tests/state/test_fences_forged.py",
        "tests/gang/test_gang_mesh.py",
    ),
    "hypermesh/state/live.py": (
        "tests/state/test_fences_live.py",
        "tests/state/test_fences_leader.py",
        "tests/state/test_fences_forged.py",
        "tests/state/test_claim_protocol.py",
        "tests/cli/test_live_ops.py",
    ),
    "agent/claims/unsure.py": (
        "tests/state/test_fences_unsure.py",
        "tests/state/test_fences_forged.py",
        "tests/claims/test_unsure_claims.py",
    ),
}

COMPARES = ("absent", "created_at", "mod_revision_is", "none_created_since", "value_is")
"""The compare helpers of ``hypermesh.state.etcd.Etcd``."""
ON_REVISION = ("created_at", "mod_revision_is", "value_is")
"""Compares that a weaker one ("the key exists") can stand in for."""
COMPARE_LISTS = ("state_guard", "claimable")
"""Functions that return a list of compares."""
COMPARES_AND_OPS = ("claim_ops", "finish_ops")
"""Functions that return (compares, operations)."""

ALWAYS = "{owner}.none_created_since({key}, 1 << 62)"
"""A compare that always holds: no key under ``key`` was created after revision 2**62."""
EXISTS = (
    "(lambda C: C(result=C.GREATER, target=C.CREATE, key=({key}).encode(), create_revision=0))"
    "(__import__('etcd3aio._protobuf', fromlist=['Compare']).Compare)"
)
"""A compare that holds while ``key`` exists, whatever its revision or value."""


@dataclass(frozen=True)
class IfGuard:
    """A condition that decides whether a write is made: in ``function`` (a qualified
    name), the one expression ``test`` (an ``if``'s condition, or one operand of an
    ``and``/``or`` of it) becomes ``becomes``."""

    path: str
    function: str
    test: str
    becomes: str
    why: str


IF_GUARDS: tuple[IfGuard, ...] = (
    IfGuard("hypermesh/state/txns.py", "cancel_workflow",
            "await etcd.get(ks.workflow(wid)) is None", "False",
            "a cancel of a workflow that does not exist writes its state key"),
    IfGuard("hypermesh/state/txns.py", "cancel_workflow", "state in TERMINAL", "False",
            "a workflow that ended is cancelled: its final state is overwritten"),
    IfGuard("hypermesh/state/txns.py", "expand_experiment", "not done.succeeded", "False",
            "the batches after a refused one are still written, and the marker"),
    IfGuard("hypermesh/state/live.py", "_change", "snap.state in TERMINAL", "False",
            "a live change is made to a workflow that ended"),
    IfGuard("hypermesh/state/live.py", "scale_experiment", "several", "False",
            "a workers cap is set on an experiment in blocks of several tasks (they take "
            "none)"),
    IfGuard("hypermesh/state/live.py", "extend_experiment.change", "snap.control.cancelled",
            "False", "samples are added to a cancelled experiment"),
    IfGuard("hypermesh/state/live.py", "extend_experiment.change", "started", "False",
            "samples are added although a dependent experiment started"),
    IfGuard("hypermesh/state/live.py", "retry_failed", 'snap.state == "cancelled"', "False",
            "a cancelled workflow is retried"),
    IfGuard("hypermesh/state/live.py", "retry_failed",
            "json.loads(kv.value).get('state') == 'failed'", "True",
            "retry reopens tasks whose result is not a failure (a second success)"),
    IfGuard("hypermesh/state/live.py", "retry_failed", "not done.succeeded", "False",
            "retry goes on (and reports tasks reopened) after a refused batch"),
    IfGuard("hypermesh/state/live.py", "_reopen_blocks", "result.state == 'failed'", "True",
            "retry reopens tasks of blocks whose result is not a failure"),
    IfGuard("hypermesh/state/live.py", "_reopen_blocks", "not done.succeeded", "False",
            "retry goes on after a refused block batch"),
    IfGuard("agent/claims/unsure.py", "UnsureClaims.settle", "not in_use", "True",
            "a claim read back is given back although it is in use"),
    IfGuard("agent/claims/unsure.py", "UnsureClaims.settle",
            "claim.get('node') == self.node", "True",
            "a claim read back is given back although another node holds it"),
    IfGuard("agent/claims/unsure.py", "UnsureClaims.settle",
            "claim.get('lease') == self._lease()", "True",
            "a claim read back is given back although it is on another lease"),
)


@dataclass(frozen=True)
class Mutant:
    """One guard removed or weakened: bytes ``start:end`` of ``path`` become ``replacement``."""

    path: str
    line: int
    function: str
    guard: str
    change: str
    start: int = field(repr=False)
    end: int = field(repr=False)
    replacement: str = field(repr=False)
    replaced: str = field(repr=False)  # the text at start:end

    @property
    def name(self) -> str:
        return f"{self.path}:{self.line} ({self.function}) {self.change}"

    def apply(self, source: bytes) -> bytes:
        if source[self.start : self.end].decode(errors="replace") != self.replaced:
            raise ValueError(f"{self.path} is not the source {self.name} was found in")
        return source[: self.start] + self.replacement.encode() + source[self.end :]


def _short(text: str, limit: int = 90) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Source:
    """A module's bytes, and the byte offsets of its nodes (ast columns count bytes)."""

    def __init__(self, source: bytes) -> None:
        self.data = source
        self.starts = [0]
        for line in source.splitlines(keepends=True):
            self.starts.append(self.starts[-1] + len(line))

    def span(self, node: ast.AST) -> tuple[int, int]:
        start = self.starts[node.lineno - 1] + node.col_offset  # type: ignore[attr-defined]
        end = self.starts[node.end_lineno - 1] + node.end_col_offset  # type: ignore[attr-defined]
        return start, end

    def text(self, node: ast.AST) -> str:
        start, end = self.span(node)
        return self.data[start:end].decode()


def _scopes(tree: ast.Module) -> Iterator[tuple[str, ast.AST, ast.AST]]:
    """Every node with its qualified function name ('' at module level) and parent."""

    def visit(node: ast.AST, scope: str) -> Iterator[tuple[str, ast.AST, ast.AST]]:
        for child in ast.iter_child_nodes(node):
            yield scope, child, node
            inner = scope
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                inner = f"{scope}.{child.name}" if scope else child.name
            yield from visit(child, inner)

    yield from visit(tree, "")


def _is_compare(call: ast.Call) -> bool:
    """``etcd.<compare>(...)`` or ``self.etcd.<compare>(...)``."""
    func = call.func
    if not isinstance(func, ast.Attribute) or func.attr not in COMPARES:
        return False
    owner = func.value
    return (isinstance(owner, ast.Name) and owner.id == "etcd") or (
        isinstance(owner, ast.Attribute) and owner.attr == "etcd"
    )


def _is_condition(node: ast.AST, parent: ast.AST) -> bool:
    """An ``if``'s condition, an operand of ``and``/``or``, or a condition kept in a name."""
    return (
        (isinstance(parent, ast.If | ast.While | ast.IfExp) and node is parent.test)
        or (isinstance(parent, ast.BoolOp) and node in parent.values)
        or (isinstance(parent, ast.Assign) and node is parent.value)
    )


def _called(call: ast.Call) -> str | None:
    return call.func.id if isinstance(call.func, ast.Name) else None


def find_mutants(
    source: str | bytes, path: str, if_guards: Sequence[IfGuard] = ()
) -> list[Mutant]:
    """The mutants of one module's guards, in source order. ``if_guards`` are the
    ``IF_GUARDS`` of ``path``; each must match exactly one condition (ValueError)."""
    src = _Source(source.encode() if isinstance(source, str) else source)
    tree = ast.parse(src.data)
    parents = {id(node): parent for _, node, parent in _scopes(tree)}
    found: list[tuple[int, int, Mutant]] = []

    def add(node: ast.AST, scope: str, guard: str, change: str, target: ast.AST,
            replacement: str) -> None:
        start, end = src.span(target)
        mutant = Mutant(path, node.lineno, scope or "<module>", _short(guard),  # type: ignore[attr-defined]
                        change, start, end, replacement, src.data[start:end].decode())
        found.append((mutant.line, len(found), mutant))

    for scope, node, parent in _scopes(tree):
        if not isinstance(node, ast.Call):
            continue
        text = src.text(node)
        if _is_compare(node):
            helper = node.func.attr  # type: ignore[attr-defined]
            key = src.text(node.args[0]) if node.args else "''"
            owner = src.text(node.func.value)  # type: ignore[attr-defined]
            grand = parents.get(id(parent))
            if isinstance(parent, ast.List):
                rest = [src.text(e) for e in parent.elts if e is not node]
                add(node, scope, text, f"removed {_short(text, 60)} from its compare list",
                    parent, "[" + ", ".join(rest) + "]")
            elif (isinstance(parent, ast.Call) and isinstance(parent.func, ast.Attribute)
                  and parent.func.attr == "append" and isinstance(grand, ast.Expr)):
                add(node, scope, text, f"removed the appended compare {_short(text, 60)}",
                    grand, "pass")
            elif isinstance(parent, ast.ListComp) and parent.elt is node:
                add(node, scope, text,
                    f"removed the compares [{_short(text, 50)} for ...] (now [])", parent, "[]")
            else:
                add(node, scope, text, f"{_short(text, 60)} made to always hold", node,
                    ALWAYS.format(owner=owner, key=key))
            if helper in ON_REVISION:
                add(node, scope, text, f"{_short(text, 60)} weakened to 'the key exists'",
                    node, EXISTS.format(key=key))
        elif _called(node) in COMPARE_LISTS:
            add(node, scope, text, f"{_short(text, 60)} replaced by [] (no compare)", node, "[]")
        elif _called(node) in COMPARES_AND_OPS:
            add(node, scope, text, f"{_short(text, 60)} without its compares", node,
                f"(lambda r: ([], r[1]))({text})")

    for guard in if_guards:
        wanted = ast.unparse(ast.parse(guard.test, mode="eval").body)
        hits = [
            node for scope, node, parent in _scopes(tree)
            if scope == guard.function and _is_condition(node, parent)
            and ast.unparse(node) == wanted
        ]
        if len(hits) != 1:
            raise ValueError(
                f"{path}: {len(hits)} conditions `{guard.test}` in {guard.function} "
                "(IF_GUARDS in scripts/mutate_guards.py is out of date)"
            )
        test = hits[0]
        text = src.text(test)
        add(test, guard.function, f"if {text}",
            f"`{_short(text, 60)}` replaced by {guard.becomes} ({guard.why})", test,
            guard.becomes)
    return [m for _, _, m in sorted(found, key=lambda t: (t[0], t[1]))]


def all_mutants(repo: Path = REPO, modules: Sequence[str] = ()) -> list[Mutant]:
    """The mutants of every target module under ``repo`` (those matching ``modules``)."""
    mutants = []
    for path in TARGETS:
        if modules and not any(path == m or path.endswith(m) for m in modules):
            continue
        guards = [g for g in IF_GUARDS if g.path == path]
        mutants += find_mutants((repo / path).read_bytes(), path, guards)
    return mutants


# ---------------------------------------------------------------------- running


@dataclass
class Outcome:
    mutant: str
    path: str
    line: int
    guard: str
    change: str
    outcome: str  # killed, timeout (counted as killed), survived, error, no-tests
    seconds: float
    caught_by: str | None = None


PACKAGES = ("hypermesh", "agent", "chunkfs")
"""The folders of the package's code (pyproject's package-dir)."""


def changed_since_head(repo: Path) -> list[str]:
    """Target modules whose working-tree text differs from HEAD's."""
    out = subprocess.run(
        ["git", "-C", str(repo), "diff", "--name-only", "HEAD", "--", *TARGETS],
        check=True, capture_output=True, text=True,
    ).stdout
    return out.split()


def make_copy(repo: Path, head: bool = False, into: Path | None = None) -> Path:
    """The repository's files (tracked and untracked, not ignored) in a temporary folder,
    laid out so that ``PYTHONPATH=<copy>`` imports ``hypermesh.agent`` from it. With
    ``head``, the package's code is HEAD's (the tests and scripts stay the working tree's)."""
    listed = subprocess.run(
        ["git", "-C", str(repo), "ls-files", "-z", "-co", "--exclude-standard"],
        check=True, capture_output=True,
    ).stdout.decode().split("\0")
    copy = into or Path(tempfile.mkdtemp(prefix="mutate-guards-"))
    for name in filter(None, listed):
        source = repo / name
        if not source.is_file():  # deleted in the working tree, or a submodule
            continue
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, copy / name)
    if head:
        archive = subprocess.run(
            ["git", "-C", str(repo), "archive", "HEAD", *PACKAGES],
            check=True, capture_output=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(copy)], input=archive, check=True)
    (copy / "hypermesh" / "agent").symlink_to("../agent")
    (copy / "hypermesh" / "chunkfs").symlink_to("../chunkfs")
    return copy


def test_env(copy: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(copy), env.get("PYTHONPATH")]))
    return env


def check_imports(copy: Path, env: dict[str, str]) -> None:
    """A fresh interpreter (as an agent is started) imports every target from the copy."""
    names = ["hypermesh", "hypermesh.state.txns", "hypermesh.agent.claims.unsure"]
    code = "import importlib\n" + "".join(
        f"print(importlib.import_module({n!r}).__file__)\n" for n in names
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=tempfile.gettempdir(), check=True,
        capture_output=True, text=True,
    ).stdout.split()
    wrong = [f for f in out if not Path(f).resolve().is_relative_to(copy.resolve())]
    if wrong or len(out) != len(names):
        raise SystemExit(f"mutate_guards: the copy is not what Python imports: {out}")


def tests_of(copy: Path, path: str, exclude: Sequence[str] = ()) -> list[str]:
    """The tests of ``path`` that exist in the copy, less those matching ``exclude``."""
    return [
        t for t in TARGETS[path]
        if (copy / t.split("::")[0]).is_file()
        and not any(fnmatch.fnmatch(t.split("::")[0], x) for x in exclude)
    ]


def _stop_tree(proc: subprocess.Popen[bytes]) -> None:
    """SIGINT first (pytest then stops its servers and agents), then kill what is left."""
    try:
        import psutil

        children = psutil.Process(proc.pid).children(recursive=True)
    except Exception:
        children = []
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    for child in children:
        with contextlib.suppress(Exception):
            child.kill()


def run_pytest(copy: Path, env: dict[str, str], tests: Sequence[str], timeout: float,
               log: Path) -> tuple[str, float, str | None]:
    """(outcome, seconds, first failing test) of ``pytest -x`` on ``tests`` in the copy."""
    started = time.monotonic()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
            cwd=copy, env=env, stdout=out, stderr=subprocess.STDOUT,
        )
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            _stop_tree(proc)
            return "timeout", time.monotonic() - started, None
        except BaseException:  # interrupted: leave no pytest, etcd or agent behind
            _stop_tree(proc)
            raise
    seconds = time.monotonic() - started
    text = log.read_text(errors="replace")
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", text, re.MULTILINE)
    if rc == 0:
        return "survived", seconds, None
    if rc == 1:
        return "killed", seconds, failed[0] if failed else None
    return "error", seconds, failed[0] if failed else None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="only list the mutants")
    parser.add_argument("--module", action="append", default=[],
                        help="a target module (path or its end, e.g. live.py); repeatable")
    parser.add_argument("--only", action="append", default=[],
                        help="run only mutants whose name contains this text; repeatable")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds per mutant (default: 3x the baseline run + 60 s)")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the unmutated run of the tests (it must pass)")
    parser.add_argument("--exclude", action="append", default=[],
                        help="leave out the test files matching this glob; repeatable")
    parser.add_argument("--head", action="store_true",
                        help="mutate the package code of HEAD, not the working tree's (for "
                        "when someone is editing it); tests still come from the working tree")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--logs", type=Path, default=None,
                        help="keep each mutant's pytest output in this folder")
    args = parser.parse_args(argv)

    def select(root: Path) -> list[Mutant]:
        found = all_mutants(root, args.module)
        return [m for m in found if not args.only or any(o in m.name for o in args.only)]

    if args.list:
        if args.head:
            with tempfile.TemporaryDirectory() as head:
                mutants = select(make_copy(REPO, True, Path(head)))
        else:
            mutants = select(REPO)
        if args.json:
            print(json.dumps([asdict(m) | {"name": m.name} for m in mutants], indent=1))
        else:
            for path in dict.fromkeys(m.path for m in mutants):
                print(f"{path}: {sum(m.path == path for m in mutants)} mutants; tests: "
                      + ", ".join(TARGETS[path]))
            for m in mutants:
                print(f"  {m.name}")
            print(f"{len(mutants)} mutants")
        return 0

    def say(text: str) -> None:
        print(text, file=sys.stderr if args.json else sys.stdout, flush=True)

    # Started in the background, this process may have SIGINT ignored, and pytest with it:
    # restore it (pytest then stops its servers), and make SIGTERM clean up the same way.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    for path in changed_since_head(REPO):
        say(f"note: {path} differs from HEAD in the working tree; mutating "
            + ("HEAD's" if args.head else "the working tree's") + " version")
    copy = make_copy(REPO, args.head)
    logs = args.logs or copy / ".mutant-logs"
    logs.mkdir(parents=True, exist_ok=True)
    results: list[Outcome] = []
    started = time.monotonic()
    baseline: float | None = None
    interrupted = False
    try:
        mutants = select(copy)  # found in the copy: the text they change is the copy's
        env = test_env(copy)
        check_imports(copy, env)
        timeout = args.timeout
        if not args.no_baseline:
            paths = dict.fromkeys(m.path for m in mutants)
            every = list(dict.fromkeys(t for p in paths for t in tests_of(copy, p, args.exclude)))
            say(f"baseline: {len(every)} test files, unmutated ...")
            outcome, baseline, failed = run_pytest(
                copy, env, every, args.timeout or 3600, logs / "baseline.log"
            )
            say(f"baseline: {outcome} in {baseline:.0f} s")
            if outcome != "survived":
                say((logs / "baseline.log").read_text(errors="replace")[-4000:])
                raise SystemExit(f"mutate_guards: the tests fail without a mutant ({failed})")
            timeout = timeout or 3 * baseline + 60
        timeout = timeout or 1800
        for n, m in enumerate(mutants, 1):
            target = copy / m.path
            original = target.read_bytes()
            stat = target.stat()
            mutated = m.apply(original)
            compile(mutated, m.path, "exec")  # a mutant is valid Python, or the mutator is wrong
            tests = tests_of(copy, m.path, args.exclude)
            if not tests:
                results.append(Outcome(m.name, m.path, m.line, m.guard, m.change, "no-tests", 0))
                continue
            target.write_bytes(mutated)
            # A distinct mtime per mutant, so that no stale bytecode is ever imported.
            os.utime(target, ns=(stat.st_atime_ns, stat.st_mtime_ns + n * 1_000_000_000))
            try:
                outcome, seconds, failed = run_pytest(
                    copy, env, tests, timeout, logs / f"mutant-{n:03d}.log"
                )
            finally:
                target.write_bytes(original)
                os.utime(target, ns=(stat.st_atime_ns, stat.st_mtime_ns))
            results.append(
                Outcome(m.name, m.path, m.line, m.guard, m.change, outcome, seconds, failed)
            )
            say(f"[{n}/{len(mutants)}] {outcome:8} {seconds:6.1f} s  {m.name}"
                + (f"  <- {failed}" if failed else ""))
    except KeyboardInterrupt:
        interrupted = True
        say(f"interrupted: the summary below covers the {len(results)} mutants run")
    finally:
        shutil.rmtree(copy, ignore_errors=True)  # with --logs, the logs live outside it

    elapsed = time.monotonic() - started
    killed = [r for r in results if r.outcome in ("killed", "timeout")]
    left = [r for r in results if r.outcome not in ("killed", "timeout")]
    per_module = {
        p: {"mutants": sum(r.path == p for r in results),
            "killed": sum(r.path == p for r in killed)}
        for p in dict.fromkeys(r.path for r in results)
    }
    summary = {"mutants": len(results), "killed": len(killed), "survivors": len(left),
               "timeouts": sum(r.outcome == "timeout" for r in results),
               "seconds": round(elapsed), "baseline_seconds": baseline and round(baseline),
               "interrupted": interrupted, "per_module": per_module}
    if args.json:
        print(json.dumps({"summary": summary, "mutants": [asdict(r) for r in results]},
                         indent=1))
    else:
        for p, c in per_module.items():
            print(f"{p}: {c['killed']} of {c['mutants']} killed")
        for r in left:
            print(f"{r.outcome.upper()}: {r.mutant}")
        print(f"{len(results)} mutants, {len(killed)} killed ({summary['timeouts']} by "
              f"timeout), {len(left)} survivors, {elapsed / 60:.1f} min")
    return 130 if interrupted else 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
