"""``hypermesh validate`` and ``submit``'s task cap, through the real CLI against a real
etcd: exit codes, one ``path:line: field: message`` per problem, the plan checked against
the mesh's ``max-workflow-tasks`` (read from etcd, or the default offline), and a
``submit`` over the cap refused with nothing written."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

from hypermesh.state.etcd import Etcd
from hypermesh.state.keyspace import Keyspace
from tests.conftest import Mesh

ROOT = Path(__file__).resolve().parents[2]
FIGURE1 = str(ROOT / "examples" / "figure1.yaml")  # mnist: 1,000 samples
PIPELINE = str(ROOT / "examples" / "pipeline" / "pipeline.yaml")  # 4 + 8 + 4 tasks
OFFLINE = "http://127.0.0.1:1"  # nothing listens there

BAD = """\
experiments:
  train:
    command: python train.py --lr {{lr}}
    samples: 0
    wokers: 4
"""

TPE = """\
experiments:
  search:
    sampling: tpe
    samples: 20
    objective: {metric: loss}
    parameters: {lr: {range: 0.001-0.1, sampling: loguniform}}
    command: python train.py --lr {{lr}}
"""

PROBLEM_LINE = re.compile(r"^(?P<path>[^:]+\.yaml)(?::(?P<line>\d+))?: (?P<rest>.+)$")


def mesh_keys(mesh: Mesh) -> list[str]:
    """Every key of the test's namespace in etcd."""

    async def read() -> list[str]:
        async with Etcd([mesh.etcd.url.split("//")[1]]) as etcd:
            kvs, _ = await etcd.get_prefix(Keyspace(mesh.namespace).root)
            return sorted(kv.key.decode() for kv in kvs)

    return asyncio.run(read())


def test_valid_recipes_exit_0_with_their_plan(mesh: Mesh) -> None:
    result = mesh.hm("validate", FIGURE1, PIPELINE)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr and result.stderr == ""
    lines = result.stdout.splitlines()
    assert lines[0] == f"{FIGURE1}: valid: 1,000 tasks (max-workflow-tasks 1,000,000)"
    assert re.fullmatch(r"\s+mnist\s+1,000 tasks", lines[1])
    assert f"{PIPELINE}: valid: 16 tasks (max-workflow-tasks 1,000,000)" in lines
    assert [line.split()[0] for line in lines[3:]] == ["prep", "sweep", "infer"]


def test_each_problem_is_one_located_line_and_the_exit_is_2(mesh: Mesh) -> None:
    bad = mesh.write_recipe(BAD, "bad.yaml")
    missing = mesh.root / "missing.yaml"
    result = mesh.hm("validate", str(bad), FIGURE1, str(missing))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    problems = [line for line in result.stderr.splitlines() if not line.startswith("hypermesh:")]
    assert problems == [
        f"{bad}:3: experiments.train.command: unknown template variable 'lr' "
        "(parameters: none)",
        f"{bad}:4: experiments.train.samples: must be at least 1, got 0",
        f"{bad}:5: experiments.train.wokers: unknown field 'wokers'; did you mean 'workers'?",
        f"{missing}: cannot read recipe: No such file or directory",
    ]
    assert all(PROBLEM_LINE.match(line) for line in problems)
    assert "hypermesh: 2 of 3 recipe(s) rejected" in result.stderr
    assert result.stdout.startswith(f"{FIGURE1}: valid: 1,000 tasks")  # the valid one's plan


def test_json_gives_a_result_per_file_and_set_overrides_apply(mesh: Mesh) -> None:
    bad = mesh.write_recipe(BAD, "bad.yaml")
    result = mesh.hm("validate", FIGURE1, str(bad), "--set", "mnist.samples=5", "--json")
    assert result.returncode == 2
    figure1, broken = json.loads(result.stdout)
    assert figure1 == {
        "file": FIGURE1,
        "valid": True,
        "problems": [],
        "plan": {"experiments": {"mnist": 5}, "total": 5, "exact": True,
                 "max_workflow_tasks": 1_000_000, "cap_from": "mesh"},
    }
    assert broken["file"] == str(bad) and not broken["valid"] and broken["plan"] is None
    assert {"line": None, "field": "--set mnist.samples",
            "message": "unknown experiment 'mnist'"} in broken["problems"]
    assert {"line": 4, "field": "experiments.train.samples",
            "message": "must be at least 1, got 0"} in broken["problems"]


def test_the_plan_is_checked_against_the_cap_in_etcd(mesh: Mesh) -> None:
    mesh.hm("settings", "max-workflow-tasks=10", check=True)
    result = mesh.hm("validate", FIGURE1)
    assert result.returncode == 2
    assert result.stdout.startswith(f"{FIGURE1}: over the cap: 1,000 tasks "
                                    "(max-workflow-tasks 10)")
    assert (f"{FIGURE1}: the recipe plans 1,000 tasks (mnist 1,000), more than the mesh's "
            "max-workflow-tasks (10)") in result.stderr
    assert "`hypermesh settings max-workflow-tasks=1000`" in result.stderr
    within = mesh.hm("validate", FIGURE1, "--set", "mnist.samples=10", "--json")
    assert within.returncode == 0, within.stderr
    assert json.loads(within.stdout)[0]["plan"]["cap_from"] == "mesh"


def test_offline_it_checks_against_the_default_cap_and_says_so(mesh: Mesh) -> None:
    mesh.hm("settings", "max-workflow-tasks=10", check=True)  # not the etcd it is given
    result = mesh.hm("validate", "--etcd", OFFLINE, FIGURE1, "--json", timeout=30)
    assert result.returncode == 0, result.stderr
    assert "checked against the default max-workflow-tasks (1,000,000)" in result.stderr
    assert "127.0.0.1:1" in result.stderr and "Traceback" not in result.stderr
    (report,) = json.loads(result.stdout)
    assert report["plan"]["max_workflow_tasks"] == 1_000_000
    assert report["plan"]["cap_from"] == "default"
    over = mesh.hm("validate", "--etcd", OFFLINE, FIGURE1, "--set", "mnist.samples=1000001")
    assert over.returncode == 2 and "max-workflow-tasks (1,000,000)" in over.stderr


def test_hostile_recipes_are_rejected_in_one_line_never_a_traceback(mesh: Mesh) -> None:
    texts = {
        "deep.yaml": "experiments:\n  a:\n    command: x\n    env: " + "{a: " * 3000 + "1"
                     + "}" * 3000 + "\n",
        "bomb.yaml": "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
            f"{c}: &{c} [{', '.join([f'*{p}'] * 10)}]\n"
            for p, c in zip("abcdefgh", "bcdefghi", strict=True)
        ) + "experiments:\n  e:\n    command: x\n",
        "digits.yaml": "experiments:\n  a:\n    command: x\n    samples: " + "9" * 4301 + "\n",
        "memory.yaml": "experiments:\n  a:\n    command: x\n    hardware: {memory: 1e999999}\n",
        "grid.yaml": "experiments:\n  a:\n    command: x\n    parameters:\n" + "".join(
            f"      p{i}: {{values: [{', '.join(map(str, range(10)))}]}}\n" for i in range(40)),
    }
    paths = [str(mesh.write_recipe(text, name)) for name, text in texts.items()]
    result = mesh.hm("validate", *paths, timeout=30)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    problems = [line for line in result.stderr.splitlines() if not line.startswith("hypermesh:")]
    assert len(problems) == len(texts)  # one line each
    assert all(line.startswith(path) for line, path in zip(problems, paths, strict=True))
    assert "more than the mesh's max-workflow-tasks (1,000,000)" in problems[-1]


def test_submit_over_the_cap_exits_2_and_writes_nothing(mesh: Mesh) -> None:
    mesh.hm("settings", "max-workflow-tasks=10", check=True)
    before = mesh_keys(mesh)
    assert before == [Keyspace(mesh.namespace).settings]
    result = mesh.hm("submit", FIGURE1)
    assert result.returncode == 2
    assert result.stdout == ""
    assert ("the recipe plans 1,000 tasks (mnist 1,000), more than the mesh's "
            "max-workflow-tasks (10)") in result.stderr
    assert "`hypermesh settings max-workflow-tasks=1000`" in result.stderr
    tpe = mesh.write_recipe(TPE, "tpe.yaml")  # an adaptive search counts its budget
    refused = mesh.hm("submit", str(tpe))
    assert refused.returncode == 2 and "plans 20 tasks (search 20)" in refused.stderr
    assert mesh_keys(mesh) == before
    wid = mesh.submit(tpe, "--set", "search.samples=10")  # at the cap: accepted
    assert wid in mesh.hm("status", "--json", check=True).stdout
