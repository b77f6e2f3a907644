"""scripts/mutate_guards.py, the mutant finder: which guards it finds in a module, the code
each mutant leaves (valid, the rest untouched), and that the replacement compares mean
what their names say, on a real etcd."""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import sys
import uuid
from pathlib import Path
from types import ModuleType

import pytest

from hypermesh.local.etcd import EtcdServer
from hypermesh.state.etcd import Etcd

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "mutate_guards.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mutate_guards", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


mg = _load()

SOURCE = '''\
async def fenced(etcd, ks, ref, rev, extra):
    compare = [etcd.mod_revision_is(ks.claim(ref), rev), etcd.absent(ks.result(ref))]
    compare.append(etcd.absent(ks.slot(ref)))
    compare += [etcd.none_created_since(k, rev) for k in extra]
    fence = etcd.created_at(ks.block(ref), rev) if rev else etcd.absent(ks.block(ref))
    ops = [etcd.op_put(ks.result(ref), b"done"), etcd.op_delete(ks.claim(ref))]
    if await etcd.get(ks.task(ref)) is None or not ops:
        raise LookupError(ref)
    return await etcd.txn(compare + [fence] + state_guard(etcd, ks, ref, rev), ops)
'''

GUARD = mg.IfGuard("t.py", "fenced", "await etcd.get(ks.task(ref)) is None", "False", "why")


def _mutated(change: str) -> str:
    """The code of the one mutant whose change starts with ``change``."""
    found = [m for m in mg.find_mutants(SOURCE, "t.py", [GUARD]) if m.change.startswith(change)]
    assert len(found) == 1, [m.change for m in mg.find_mutants(SOURCE, "t.py", [GUARD])]
    return found[0].apply(SOURCE.encode()).decode()


def _changed_lines(code: str) -> list[int]:
    before, after = SOURCE.splitlines(), code.splitlines()
    assert len(before) == len(after)
    return [n for n, (a, b) in enumerate(zip(before, after, strict=True), 1) if a != b]


def test_finds_every_compare_and_guard_and_no_operation() -> None:
    mutants = mg.find_mutants(SOURCE, "t.py", [GUARD])
    assert [(m.line, m.change.split(" ")[0]) for m in mutants] == [
        (2, "removed"), (2, "etcd.mod_revision_is(ks.claim(ref),"), (2, "removed"),
        (3, "removed"),
        (4, "removed"),
        (5, "etcd.created_at(ks.block(ref),"), (5, "etcd.created_at(ks.block(ref),"),
        (5, "etcd.absent(ks.block(ref))"),
        (7, "`await"),
        (9, "state_guard(etcd,"),
    ]
    for m in mutants:
        code = m.apply(SOURCE.encode()).decode()
        ast.parse(code)  # valid Python
        assert "op_put" in code and "op_delete" in code  # operations are never touched


def test_each_mutant_removes_its_compare_and_nothing_else() -> None:
    code = _mutated("removed etcd.mod_revision_is")
    assert _changed_lines(code) == [2]
    assert "compare = [etcd.absent(ks.result(ref))]" in code

    code = _mutated("removed etcd.absent(ks.result(ref))")
    assert "compare = [etcd.mod_revision_is(ks.claim(ref), rev)]" in code

    code = _mutated("removed the appended compare")
    assert _changed_lines(code) == [3]
    assert code.splitlines()[2] == "    pass"

    code = _mutated("removed the compares")
    assert code.splitlines()[3] == "    compare += []"

    code = _mutated("etcd.absent(ks.block(ref)) made to always hold")
    assert "else etcd.none_created_since(ks.block(ref), 1 << 62)" in code
    assert "etcd.created_at(ks.block(ref), rev) if rev" in code

    code = _mutated("etcd.created_at(ks.block(ref), rev) weakened")
    assert "etcd.created_at" not in code and "create_revision=0" in code

    code = _mutated("`await")
    assert _changed_lines(code) == [7]
    assert code.splitlines()[6] == "    if False or not ops:"

    code = _mutated("state_guard")
    assert "compare + [fence] + []" in code


def test_an_if_guard_that_is_not_found_is_an_error() -> None:
    stale = mg.IfGuard("t.py", "fenced", "state in TERMINAL", "False", "why")
    with pytest.raises(ValueError, match="out of date"):
        mg.find_mutants(SOURCE, "t.py", [stale])


def test_the_target_modules_have_their_guards() -> None:
    mutants = mg.all_mutants()
    for path in mg.TARGETS:
        assert any(m.path == path for m in mutants), path
    # Every if guard of the table is found (all_mutants raises otherwise), once.
    assert sum(m.change.startswith("`") for m in mutants) == len(mg.IF_GUARDS)
    # The compare of the issue: the claim's revision in the per-task result transaction.
    assert any(
        m.function == "finish_ops" and m.change.startswith("removed etcd.mod_revision_is")
        for m in mutants
    )


def test_the_replacement_compares_mean_what_they_say(etcd_server: EtcdServer) -> None:
    key = f"mg{uuid.uuid4().hex[:8]}/k"

    async def scenario() -> None:
        async with Etcd([etcd_server.url.split("//")[1]]) as etcd:
            names = {"etcd": etcd, "key": key}
            always = eval(mg.ALWAYS.format(owner="etcd", key="key"), names)
            exists = eval(mg.EXISTS.format(key="key"), names)
            put = [etcd.op_put(f"{key}-w", b"x")]
            assert (await etcd.txn([always], put)).succeeded  # key absent
            assert not (await etcd.txn([exists], put)).succeeded
            await etcd.put(key, b"1")
            await etcd.put(key, b"2")  # a later revision and another value
            assert (await etcd.txn([always], put)).succeeded
            assert (await etcd.txn([exists], put)).succeeded

    asyncio.run(scenario())
