"""Pools: declarations and their validation, cost arithmetic, the recipe's ``pools`` field
honoured by claims, and ``hypermesh pool set/ls/rm`` against a real etcd."""

from __future__ import annotations

import textwrap

import pytest

from hypermesh.agent.claims.choose import LocalLoad, choose_claims
from hypermesh.errors import RecipeError, UsageError
from hypermesh.recipe.recipe import Recipe, parse_recipe
from hypermesh.state.pools import Pool, usage_cost
from hypermesh.state.records import NodeRecord, dumps
from tests.claims.test_claims import Feed
from tests.conftest import Mesh


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": "bad name"}, "pool name 'bad name'"),
        ({"name": "p", "kind": "gce"}, "--kind 'gce': expected one of static, local, ec2"),
        ({"name": "p", "price": -1}, "--price -1 is out of range: allowed 0..1e+06"),
        ({"name": "p", "kind": "local", "max_nodes": 2, "min_nodes": 3},
         "--min 3 is more than --max 2"),
        ({"name": "p", "kind": "local", "max_nodes": 20000}, "--max 20000 is out of range"),
        ({"name": "p", "kind": "local", "max_nodes": 1, "idle_timeout": 0},
         "--idle-timeout 0 is out of range: allowed 0.1..86400"),
        ({"name": "p", "max_nodes": 3}, "a static pool is not scaled"),
        ({"name": "p", "spot": True}, "static machines are on-prem"),
        ({"name": "p", "kind": "local", "slots": 0}, "--slots 0 is out of range"),
        ({"name": "p", "kind": "local", "options": {"a b": "x"}}, "--option 'a b'"),
    ],
)
def test_pool_validation_names_the_field(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(UsageError, match=message.replace("+", r"\+").replace("(", r"\(")):
        Pool(**kwargs)  # type: ignore[arg-type]


def test_pool_json_round_trip_and_prices() -> None:
    p = Pool("cloud", kind="ec2", price=1.0, spot_price=0.3, spot=True, max_nodes=5,
             options={"image_id": "ami-1"})
    assert Pool.from_json(p.to_json()) == p
    assert p.node_price(True) == 0.3 and p.node_price(False) == 1.0
    assert Pool("od", kind="local", price=2.0, max_nodes=1).node_price(True) == 2.0


@pytest.mark.parametrize(
    ("usage", "expected"),
    [
        ({}, (0.0, 0.0, 0.0)),
        # One spot hour at 0.3 costs 0.3; on-demand it would have cost 1.0.
        ({"cloud": {"spot_s": 3600.0}}, (3600.0, 0.3, 1.0)),
        ({"cloud": {"spot_s": 1800.0, "on_demand_s": 1800.0}}, (3600.0, 0.65, 1.0)),
        # Static machines at 0.5/h: the same either way.
        ({"onprem": {"on_demand_s": 7200.0}}, (7200.0, 1.0, 1.0)),
        # An undeclared pool has no price.
        ({"gone": {"on_demand_s": 100.0}}, (100.0, 0.0, 0.0)),
    ],
)
def test_usage_cost(usage: dict[str, dict[str, float]],
                    expected: tuple[float, float, float]) -> None:
    pools = {"cloud": Pool("cloud", kind="local", price=1.0, spot_price=0.3, spot=True,
                           max_nodes=3),
             "onprem": Pool("onprem", price=0.5)}
    got = usage_cost(usage, pools)
    assert (got["node_seconds"], got["cost"], got["on_demand_cost"]) == pytest.approx(expected)


# ---------------------------------------------------------------------- recipe
def _recipe(pools: str) -> Recipe:
    return parse_recipe(textwrap.dedent(f"""\
        experiments:
          sweep:
            command: echo hi
            pools: {pools}
        """), "r.yaml")


def test_recipe_pools_field() -> None:
    assert _recipe("[onprem, cloud]").experiment("sweep").pools == ("onprem", "cloud")
    assert _recipe("onprem").experiment("sweep").pools == ("onprem",)
    recipe = _recipe("[a]")
    assert Recipe.from_json(recipe.to_json()) == recipe


@pytest.mark.parametrize(
    ("pools", "message"),
    [
        ("[]", "r.yaml:4: experiments.sweep.pools: expected one pool name or a list of them"),
        ("[a, a]", "r.yaml:4: experiments.sweep.pools[1]: pool 'a' is listed twice"),
        ("['bad name']", "r.yaml:4: experiments.sweep.pools[0]: 'bad name' is not a pool name"),
        ("[1]", "r.yaml:4: experiments.sweep.pools[0]: expected a non-empty string"),
    ],
)
def test_recipe_pools_errors_name_field_and_line(pools: str, message: str) -> None:
    with pytest.raises(RecipeError) as info:
        _recipe(pools)
    assert any(str(p).startswith(message) for p in info.value.problems), info.value.problems


def test_claims_honour_the_recipe_pools() -> None:
    feed = Feed()
    feed.workflow("w", "experiments:\n  e:\n    command: echo\n    pools: [cloud]\n")
    feed.tasks("w", "e", 2)
    onprem = NodeRecord("n1", "a:1", pool="onprem", slots=4)
    cloud = NodeRecord("n2", "a:2", pool="cloud", slots=4)
    assert choose_claims(feed.view, onprem, LocalLoad(), 10) == []
    assert len(choose_claims(feed.view, cloud, LocalLoad(), 10)) == 2


def test_view_mirrors_pools_instances_and_usage() -> None:
    feed = Feed()
    feed.put(feed.ks.pool("cloud"), Pool("cloud", kind="local", max_nodes=2).to_json())
    feed.put(feed.ks.instance("cloud-1"), {"pool": "cloud", "spot": True})
    rev = feed.put(feed.ks.usage("cloud"), {"spot_s": 5.0})
    assert feed.view.pools["cloud"]["max_nodes"] == 2
    assert feed.view.instances == {"cloud-1": {"pool": "cloud", "spot": True}}
    assert feed.view.usage["cloud"] == ({"spot_s": 5.0}, rev)
    feed.delete(feed.ks.instance("cloud-1"))
    assert feed.view.instances == {}
    assert dumps({"a": 1}) == b'{"a":1}'


# ---------------------------------------------------------------------- CLI
def test_pool_set_ls_rm(mesh: Mesh) -> None:
    mesh.hm("pool", "set", "onprem", "--price", "0.5", check=True)
    mesh.hm("pool", "set", "cloud", "--kind", "local", "--price", "1", "--spot-price", "0.3",
            "--spot", "--max", "3", "--idle-timeout", "90s", "--slots", "2",
            "--option", "root=/tmp/x", check=True)
    rows = {r["name"]: r for r in mesh.hm_json("pool", "ls")}
    assert rows["cloud"]["kind"] == "local" and rows["cloud"]["spot"] is True
    assert rows["cloud"]["max_nodes"] == 3 and rows["cloud"]["idle_timeout"] == 90
    assert rows["cloud"]["options"] == {"root": "/tmp/x"}
    assert rows["cloud"]["nodes"] == [] and rows["cloud"]["cost"] == 0
    assert rows["onprem"]["kind"] == "static" and rows["onprem"]["price"] == 0.5
    assert "cloud" in mesh.hm("pool", "ls", check=True).stdout
    mesh.hm("pool", "rm", "cloud", check=True)
    assert [r["name"] for r in mesh.hm_json("pool", "ls")] == ["onprem"]
    gone = mesh.hm("pool", "rm", "cloud")
    assert gone.returncode == 1 and "no pool 'cloud'" in gone.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--kind", "local", "--max", "2", "--min", "5"), "--min 5 is more than --max 2"),
        (("--kind", "local", "--max", "2", "--idle-timeout", "soon"), "--idle-timeout 'soon'"),
        (("--kind", "ec2", "--max", "2"), "an ec2 pool needs --option launch_template"),
        (("--option", "novalue"), "--option 'novalue': expected KEY=VALUE"),
        (("--kind", "nope"), "--kind 'nope'"),
    ],
)
def test_pool_set_rejects_bad_input(mesh: Mesh, args: tuple[str, ...], message: str) -> None:
    result = mesh.hm("pool", "set", "p", *args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert mesh.hm_json("pool", "ls") == []  # nothing half-written


def test_submit_warns_about_pools_nothing_provides(mesh: Mesh) -> None:
    recipe = mesh.write_recipe("experiments:\n  e:\n    command: echo\n    pools: [gpu]\n")
    result = mesh.hm("submit", str(recipe), check=True)
    assert "warning: experiment 'e': no pool 'gpu' is declared" in result.stderr
    mesh.hm("pool", "set", "gpu", "--kind", "local", "--max", "1", check=True)
    again = mesh.hm("submit", str(recipe), check=True).stderr
    assert "no pool 'gpu'" not in again  # (no node is live yet: that warning stays)
    assert "no live node in the mesh" in again
