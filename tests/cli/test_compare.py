"""`hypermesh best` with curves and `hypermesh compare`: two small searches on one mesh of
two real agents (real etcd, real tasks reporting `HM_METRIC` lines step by step), then
what both commands print, as JSON, as plain lines and on a terminal; and the pure parts
(the recipe differences, the winner mark) against tables."""

from __future__ import annotations

import os
import select
import subprocess
import time

from hypermesh.cli.compare import comparison_lines
from hypermesh.local.agents import hypermesh_command
from hypermesh.recipe.diff import describe, differences, search_settings
from hypermesh.recipe.ml import Objective
from hypermesh.recipe.recipe import Experiment, Parameter
from tests.conftest import Mesh

# A trial: loss 8*lr/(step+1) at steps 0..3 (so its last value is 2*lr); lr above 5 fails
# after reporting.
TRIAL = """\
import json, sys
lr = float(sys.argv[1])
for step in range(4):
    print("HM_METRIC", json.dumps({"step": step, "loss": 8 * lr / (step + 1)}), flush=True)
sys.exit(1 if lr > 5 else 0)
"""

SEARCH = """
name: {name}
seed: 7
experiments:
  sweep:
    parameters: {{lr: {{values: {values}}}{extra}}}
    objective: {{metric: loss, goal: minimize}}
    command: ["python3 trial.py {{{{lr}}}}"]
{tail}"""
CURVE_LR1 = [[0, 8.0], [1, 4.0], [2, 8 / 3], [3, 2.0]]


def _on_terminal(mesh: Mesh, *args: str, timeout: float = 30) -> str:
    """What the CLI writes to a pseudo terminal on its stdout, escape codes and all."""
    master, slave = os.openpty()
    env = dict(mesh.env, TERM="xterm-256color", COLUMNS="160")
    for name in ("NO_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "FORCE_COLOR"):
        env.pop(name, None)
    try:
        proc = subprocess.Popen([*hypermesh_command(), *args], env=env, stdout=slave,
                                stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    finally:
        os.close(slave)
    seen = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if select.select([master], [], [], 0.5)[0]:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: the process closed its end
                    break
                if not data:
                    break
                seen += data
        assert proc.wait(timeout) == 0, proc.stderr.read() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    return seen.decode()


def test_best_curves_and_compare_two_searches(mesh: Mesh) -> None:
    mesh.agent("node1", slots=2)
    mesh.agent("node2", slots=2)
    (mesh.root / "trial.py").write_text(TRIAL)
    first = mesh.submit(mesh.write_recipe(
        SEARCH.format(name="first", values="[1, 2, 3, 4]", extra=", depth: {values: [2]}", tail=""),
        "first.yaml"))
    second = mesh.submit(mesh.write_recipe(
        SEARCH.format(name="second", values="[0.5, 1, 1.5, 9]", extra="",
                      tail="  report: {after: [sweep], command: ['true']}\n"), "second.yaml"))
    assert mesh.wait_state(first, {"succeeded", "failed"})["state"] == "succeeded"
    assert mesh.wait_state(second, {"succeeded", "failed"})["state"] == "failed"

    # best --json: the existing keys as they were, plus each trial's state and curve.
    rows = mesh.hm_json("best", first)
    assert [(r["rank"], r["params"], r["value"], r["state"]) for r in rows] == [
        (i, {"lr": i, "depth": 2}, 2.0 * i, "complete") for i in range(1, 5)]
    assert rows[0]["curve"] == CURVE_LR1
    assert set(rows[0]) == {"rank", "task", "experiment", "metric", "goal", "value", "params",
                            "state", "curve"}
    # --incomplete adds the failed trial after the ranked ones, unranked, with its curve.
    rows = mesh.hm_json("best", second, "--incomplete")
    assert [(r["rank"], r["params"]["lr"], r["state"]) for r in rows] == [
        (1, 0.5, "complete"), (2, 1, "complete"), (3, 1.5, "complete"), (None, 9, "failed")]
    assert rows[-1]["curve"] == [[0, 72.0], [1, 36.0], [2, 24.0], [3, 18.0]]

    # Off a terminal: plain aligned lines, greppable, the failed trial marked.
    plain = mesh.hm("best", second, "--incomplete", check=True).stdout
    assert "\x1b" not in plain
    lines = plain.splitlines()
    assert lines[0].split() == ["1", "loss=1", f"{second}.sweep.0", "█▃▂▁", "first=4",
                                "best=1", "last=1", "steps=4", "lr=0.5"]
    assert lines[3].split()[:4] == ["failed", "loss=18", f"{second}.sweep.3", "█▃▂▁"]
    assert len({line.index("first=") for line in lines}) == 1  # columns line up

    # On a terminal: rich's table, one per experiment, the same sparkline.
    drawn = _on_terminal(mesh, "best", first, "-n", "2")
    assert "\x1b[" in drawn  # styled by rich
    assert f"{first} sweep: loss (minimize)" in drawn
    assert "█▃▂▁" in drawn and f"{first}.sweep.1" in drawn and f"{first}.sweep.2" not in drawn

    # compare --json: both searches, their best trials, and what the second recipe changed.
    result = mesh.hm_json("compare", first, second)
    entries = {(e["workflow"], e["experiment"]): e for e in result["experiments"]}
    assert list(entries) == [(first, "sweep"), (second, "sweep"), (second, "report")]
    ran, changed, report = entries.values()
    assert (report["metric"], report["best"]) == (None, None)
    assert (ran["state"], ran["succeeded"]) == ("succeeded", 4)
    assert (changed["state"], changed["failed"]) == ("failed", 1)
    assert ran["best"] == {"task": f"{first}.sweep.0", "value": 2.0,
                           "params": {"lr": 1, "depth": 2}, "curve": CURVE_LR1}
    assert (changed["metric"], changed["best"]["value"]) == ("loss", 1.0)
    assert result["differences"] == [
        {"experiment": "sweep", "field": "parameters.lr",
         "values": {first: {"values": [1, 2, 3, 4]}, second: {"values": [0.5, 1, 1.5, 9]}}},
        {"experiment": "sweep", "field": "parameters.depth",
         "values": {first: {"values": [2]}, second: None}},
    ]
    table = mesh.hm("compare", first, second, check=True).stdout.splitlines()
    assert table[0].split()[:3] == ["EXPERIMENT", "WORKFLOW", "STATE"]
    assert table[1].split()[:8] == ["sweep", first, "succeeded", "4", "4", "0", "0", "loss=2"]
    assert table[2].split()[:9] == ["sweep", second, "failed", "4", "3", "1", "0", "loss=1", "*"]
    # An experiment of one workflow only is listed, with nothing to tell apart.
    assert table[3].split()[:3] == ["report", second, "cancelled"]
    assert table[4] == "changed between the recipes:"
    assert table[5].split() == ["sweep.parameters.lr", f"{first}:", "values", "[1,", "2,", "3,",
                                "4]", f"{second}:", "values", "[0.5,", "1,", "1.5,", "9]"]
    assert table[6].split() == ["sweep.parameters.depth", f"{first}:", "values", "[2]",
                                f"{second}:", "-"]

    # Errors name the problem: no such workflow exits 1 (as for every command), bad input 2.
    for args, code, says in [
        ((first, "nosuch"), 1, "no workflow 'nosuch'"),
        ((first, second, "--experiment", "report"), 2,
         f"workflow {first} has no experiment 'report' (its experiments: sweep)"),
        ((first, second, "--metric", "acc"), 2,
         f"no task of {first}, {second} reported metric 'acc' (they reported: loss)"),
        ((first, first), 2, f"workflow {first} given more than once"),
    ]:
        refused = mesh.hm("compare", *args)
        assert refused.returncode == code and refused.stdout == "", (args, refused.stderr)
        assert says in refused.stderr, (args, refused.stderr)


# ------------------------------------------------------------------ pure parts


def _exp(**fields: object) -> Experiment:
    base: dict[str, object] = {"name": "sweep", "command": ("train {{lr}}",)}
    return Experiment(**(base | fields))  # type: ignore[arg-type]


def test_differences_name_the_changed_settings_parameters_first() -> None:
    a = _exp(parameters=(Parameter("lr", "range", 0.001, 0.1, "loguniform"),
                         Parameter("bs", "values", values=(32, 64))),
             samples=8, objective=Objective("loss"))
    b = _exp(parameters=(Parameter("lr", "range", 0.001, 0.5, "loguniform"),
                         Parameter("bs", "values", values=(32, 64)),
                         Parameter("wd", "range", 0.0, 0.1)),
             samples=16, objective=Objective("loss"), seed=3)
    changed = differences({"A": search_settings(a, 3), "B": search_settings(b, 9)})
    assert list(changed) == ["parameters.lr", "parameters.wd", "samples"]  # seed 3 in both
    assert changed["parameters.wd"] == {"A": None, "B": {"range": [0.0, 0.1],
                                                         "sampling": "uniform"}}
    assert differences({"A": search_settings(a, 1), "B": search_settings(a, 1)}) == {}
    assert list(differences({"A": search_settings(a, 1), "B": search_settings(a, 2)})) == [
        "seed"]


def test_describe_reads_as_a_recipe() -> None:
    cases = [
        ("parameters.lr", {"range": [0.001, 0.1], "sampling": "loguniform"},
         "range [0.001, 0.1] loguniform"),
        ("parameters.x", {"range": [-10.0, 10.0], "sampling": "uniform"}, "range [-10, 10]"),
        ("parameters.bs", {"values": [32, "auto"]}, "values [32, auto]"),
        ("parameters.bs", None, "-"),
        ("objective", {"metric": "acc", "goal": "maximize"}, "acc (maximize)"),
        ("command", ["prep", "train"], "prep && train"),
        ("env", {"A": "1", "B": "x"}, "A=1 B=x"),
        ("samples", 8, "8"),
    ]
    for field, value, text in cases:
        assert describe(field, value) == text, field


def _entry(wid: str, value: float | None, goal: str = "maximize") -> dict[str, object]:
    best = None if value is None else {"task": f"{wid}.e.0", "value": value, "params": {},
                                       "curve": [[0, value]]}
    return {"workflow": wid, "experiment": "e", "state": "succeeded", "total": 1,
            "succeeded": 1, "failed": 0, "cancelled": 0, "metric": "acc", "goal": goal,
            "best": best}


def test_the_best_value_of_an_experiment_is_marked_by_its_goal() -> None:
    result = {"experiments": [_entry("a", 0.7), _entry("b", 0.9), _entry("c", None)],
              "differences": []}
    lines = comparison_lines(result)
    assert [line.split()[7:9] for line in lines[1:4]] == [
        ["acc=0.7", "a.e.0"], ["acc=0.9", "*"], ["acc=-"]]
    lowest = {"experiments": [_entry("a", 0.7, "minimize"), _entry("b", 0.9, "minimize")],
              "differences": []}
    assert "*" in comparison_lines(lowest)[1] and "*" not in comparison_lines(lowest)[2]
    alone = {"experiments": [_entry("a", 0.7)], "differences": []}
    assert "*" not in comparison_lines(alone)[1]  # nothing to compare with
    assert comparison_lines(alone)[-1] == (
        "the recipes differ in none of their experiments' settings")
    unjudged = {"experiments": [_entry("a", None) | {"metric": None, "goal": None}],
                "differences": []}
    assert comparison_lines(unjudged)[1].split()[7:] == ["-"]  # no objective, no --metric
