"""The lab itself: hosts reach each other, each kind of cut cuts what it says, heals heal,
and nothing is left once it is closed."""

from __future__ import annotations

import subprocess

from hypermesh.local.netns import NetLab, namespaces


def test_hosts_reach_each_other_until_cut(lab: NetLab) -> None:
    for name in ("etcd", "onprem", "cloud-a"):
        lab.add_host(name)
    assert lab.connects("onprem", "cloud-a") and lab.connects("cloud-a", "etcd")

    lab.cut_off("onprem")  # nothing in, nothing out
    assert not lab.connects("onprem", "cloud-a")
    assert not lab.connects("etcd", "onprem")
    assert lab.connects("cloud-a", "etcd")  # the others are untouched
    lab.heal_off("onprem")
    assert lab.connects("onprem", "cloud-a") and lab.connects("etcd", "onprem")

    lab.cut("onprem", "etcd")  # those two only, both ways
    assert not lab.connects("onprem", "etcd") and not lab.connects("etcd", "onprem")
    assert lab.connects("onprem", "cloud-a") and lab.connects("cloud-a", "etcd")
    lab.heal("onprem", "etcd")
    assert lab.connects("onprem", "etcd") and lab.connects("etcd", "onprem")


def test_one_way_cut(lab: NetLab) -> None:
    lab.add_host("a")
    lab.add_host("b")
    lab.cut_one_way("a", "b")
    # a's packets to b are dropped; b's datagrams still reach a ...
    assert not lab.datagram_arrives("a", "b")
    assert lab.datagram_arrives("b", "a")
    # ... but a TCP connection needs a's answer, so it fails from both ends.
    assert not lab.connects("a", "b") and not lab.connects("b", "a")
    lab.heal_one_way("a", "b")
    assert lab.datagram_arrives("a", "b") and lab.connects("b", "a")


def test_close_leaves_nothing(netns_ok: None) -> None:
    lab = NetLab()
    try:
        for name in ("x", "y"):
            lab.add_host(name)
        sleeper = lab.popen("x", ["sleep", "60"])
        lab.cut("x", "y")
        lab.cut_off("y")
        assert all(ns in namespaces() for ns in (lab.switch, lab.hosts["x"].ns))
    finally:
        lab.close()
    lab.close()  # idempotent
    assert sleeper.poll() is not None
    assert not [ns for ns in namespaces() if ns.startswith(lab.lab_id)]
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    # The veths were made inside the lab's namespaces, never here; none came back. Names
    # are compared whole: a container's "veth0@if2" (podman, in another test) is not ours.
    names = [line.split(": ")[1] for line in links.splitlines() if ": " in line]
    assert not [n for n in names if n == "br0" or n.startswith(("eth0@", "p0"))], names
