"""The keyspace: task ids and key names are pure string functions with exact round trips."""

from __future__ import annotations

import pytest

from hypermesh.state.keyspace import BlockRef, Keyspace, TaskRef

# ------------------------------------------------------------------ TaskRef


@pytest.mark.parametrize(
    ("text", "ref"),
    [
        ("wf-1a2b3c.train.0", TaskRef("wf-1a2b3c", "train", 0)),
        ("w.e.42", TaskRef("w", "e", 42)),
        ("mnist_x-00ff00.mnist.999", TaskRef("mnist_x-00ff00", "mnist", 999)),
    ],
)
def test_task_id_parses_and_round_trips(text: str, ref: TaskRef) -> None:
    parsed = TaskRef.parse(text)
    assert parsed == ref
    assert parsed.id == text
    assert str(parsed) == text
    assert TaskRef.parse(parsed.id) == parsed


def test_task_path_is_the_id_with_slashes() -> None:
    ref = TaskRef("wf-abc", "train", 7)
    assert ref.path == "wf-abc/train/7"
    assert ref.id == "wf-abc.train.7"


def test_parse_takes_only_names_so_an_id_never_names_a_path() -> None:
    assert TaskRef.parse("wf-1a2b3c.train_2.31") == TaskRef("wf-1a2b3c", "train_2", 31)
    # Workflow ids and experiment names hold no dot: an id with more dots is not one.
    with pytest.raises(ValueError):
        TaskRef.parse("a.b.c.3")


@pytest.mark.parametrize(
    "text",
    [
        "", "w", "w.e", "w.e.", ".e.1", "w..1", "w.e.x", "w.e.-1", "w.e. 1", "w/e/1",
        "../../../etc/passwd.e.1", "w/../...e.1", "w.e.1\n", "w\n.e.1", "w.e.1" + "0" * 19,
    ],
)
def test_parse_rejects_what_is_not_a_task_id(text: str) -> None:
    with pytest.raises(ValueError, match=r"WORKFLOW\.EXPERIMENT\.INDEX"):
        TaskRef.parse(text)


def test_task_refs_order_by_workflow_experiment_then_numeric_index() -> None:
    refs = [
        TaskRef("w", "e", 10), TaskRef("w", "e", 9), TaskRef("v", "z", 0), TaskRef("w", "a", 99),
    ]
    assert sorted(refs) == [
        TaskRef("v", "z", 0), TaskRef("w", "a", 99), TaskRef("w", "e", 9), TaskRef("w", "e", 10),
    ]


# ------------------------------------------------------------------ namespaces


@pytest.mark.parametrize("namespace", ["a", "mesh", "test-01", "A_b-c", "9lives", "x" * 63])
def test_valid_namespaces_make_a_root(namespace: str) -> None:
    ks = Keyspace(namespace)
    assert ks.namespace == namespace
    assert ks.root == f"/hypermesh/{namespace}/"


@pytest.mark.parametrize(
    "namespace",
    ["", "-lead", "_lead", "x" * 64, "a/b", "a.b", "a b", "ü", "mesh\n", "\nmesh", "a\x00"],
)
def test_invalid_namespaces_are_rejected_with_the_rule(namespace: str) -> None:
    with pytest.raises(ValueError, match="1-63 letters"):
        Keyspace(namespace)


# ------------------------------------------------------------------ key names


def test_every_key_lives_under_the_namespace_root() -> None:
    ks = Keyspace("t")
    ref = TaskRef("w", "e", 3)
    assert ks.node("n1") == "/hypermesh/t/node/n1"
    assert ks.candidate(255) == "/hypermesh/t/elect/00000000000000ff"
    assert ks.workflow("w") == "/hypermesh/t/wf/w"
    assert ks.workflow_state("w") == "/hypermesh/t/wfstate/w"
    assert ks.expanded("w", "e") == "/hypermesh/t/expanded/w/e"
    assert ks.task(ref) == "/hypermesh/t/task/w/e/3"
    assert ks.claim(ref) == "/hypermesh/t/claim/w/e/3"
    assert ks.attempt(ref, 2) == "/hypermesh/t/attempt/w/e/3/2"
    assert ks.result(ref) == "/hypermesh/t/result/w/e/3"
    assert ks.slot("w", "e", 1) == "/hypermesh/t/slot/w/e/1"
    assert ks.nodes == "/hypermesh/t/node/"
    assert ks.election == "/hypermesh/t/elect/"


def test_candidate_keys_sort_like_their_lease_ids() -> None:
    ks = Keyspace("t")
    leases = [1, 0xFF, 0x100, 2**63 - 1]
    assert sorted(ks.candidate(x) for x in leases) == [ks.candidate(x) for x in sorted(leases)]


def test_kind_prefix_with_and_without_a_workflow() -> None:
    ks = Keyspace("t")
    assert ks.kind_prefix("task") == "/hypermesh/t/task/"
    assert ks.kind_prefix("task", "w") == "/hypermesh/t/task/w/"
    assert ks.task(TaskRef("w", "e", 0)).startswith(ks.kind_prefix("task", "w"))


def test_workflow_prefixes_cover_every_key_of_the_workflow() -> None:
    # The list mixes range prefixes (ending in "/") with the exact keys wf/<wid>,
    # wfstate/<wid>, progress/<wid> and wfusage/<wid>; callers range-read only the former
    # (an exact key used as a prefix would also match wf/<wid>2).
    ks = Keyspace("t")
    ref = TaskRef("w", "e", 0)
    block = BlockRef("w", "e", 0)
    found = ks.workflow_prefixes("w")
    ranges = [p for p in found if p.endswith("/")]
    exact = [p for p in found if not p.endswith("/")]
    assert sorted(exact) == sorted([ks.workflow("w"), ks.workflow_state("w"), ks.progress("w"),
                                    ks.workflow_usage("w")])
    ranged = [
        ks.expanded("w", "e"), ks.task(ref), ks.claim(ref), ks.attempt(ref, 1), ks.result(ref),
        ks.slot("w", "e", 0), ks.experiment_control("w", "e"), ks.metrics(ref, 1),
        ks.gang_seat(ref, 0), ks.gang_rendezvous(ref), ks.gang_end(ref, 1, 0),
        ks.block(block), ks.block_claim(block), ks.block_batch(block, 1, 1),
    ]
    for key in ranged:
        assert any(key.startswith(p) for p in ranges), key
    other = TaskRef("w2", "e", 0)
    for key in (ks.task(other), ks.claim(other), ks.attempt(other, 1), ks.expanded("w2", "e")):
        assert not any(key.startswith(p) for p in ranges), key


# ------------------------------------------------------------------ split


def test_split_returns_kind_and_parts() -> None:
    ks = Keyspace("t")
    ref = TaskRef("w", "e", 3)
    assert ks.split(ks.attempt(ref, 2)) == ("attempt", ["w", "e", "3", "2"])
    assert ks.split(ks.task(ref)) == ("task", ["w", "e", "3"])
    assert ks.split(ks.node("n1")) == ("node", ["n1"])
    assert ks.split(ks.workflow("w")) == ("wf", ["w"])
    assert ks.split(ks.candidate(1)) == ("elect", ["0000000000000001"])


def test_split_of_a_bare_kind_has_no_parts() -> None:
    ks = Keyspace("t")
    assert ks.split("/hypermesh/t/node") == ("node", [])
    assert ks.split("/hypermesh/t/node/") == ("node", [])


@pytest.mark.parametrize(
    "key",
    [
        "/hypermesh/other/node/n1", "/hypermesh/tt/node/n1", "/hypermesh/t", "node/n1", "",
        "/x/t/node/a",
    ],
)
def test_split_ignores_keys_of_other_namespaces(key: str) -> None:
    assert Keyspace("t").split(key) is None


def test_split_inverts_every_key_builder() -> None:
    ks = Keyspace("mesh-1")
    ref = TaskRef("wf-9", "exp_a", 12)
    built = {
        ks.task(ref): ("task", ref.path.split("/")),
        ks.claim(ref): ("claim", ref.path.split("/")),
        ks.result(ref): ("result", ref.path.split("/")),
        ks.attempt(ref, 5): ("attempt", [*ref.path.split("/"), "5"]),
        ks.slot("wf-9", "exp_a", 0): ("slot", ["wf-9", "exp_a", "0"]),
        ks.expanded("wf-9", "exp_a"): ("expanded", ["wf-9", "exp_a"]),
        ks.workflow_state("wf-9"): ("wfstate", ["wf-9"]),
    }
    for key, expected in built.items():
        assert ks.split(key) == expected
