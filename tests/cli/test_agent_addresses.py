"""``--listen`` and ``--advertise``: which addresses an agent accepts, and what it registers
(``hypermesh/addresses.py``). No mesh: the options are refused before the agent starts."""

from __future__ import annotations

import os
import subprocess

import pytest

from hypermesh import addresses
from hypermesh.config import AgentConfig
from hypermesh.errors import UsageError
from hypermesh.local.agents import hypermesh_command


def start(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``hypermesh agent start ARGS`` against an etcd nobody serves: only a refused
    option ends it before it tries to connect (and it is stopped after 30 s if not)."""
    return subprocess.run(
        [*hypermesh_command(), "agent", "start", "--etcd", "http://127.0.0.1:1", "--name", "x",
         "--insecure", *args],
        capture_output=True, text=True, timeout=30,
        env=dict(os.environ if env is None else env),
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--listen", "0.0.0.0:7070"), "--listen 0.0.0.0:7070 listens on every interface"),
        (("--listen", "[::]:7070"), "give --advertise HOST:PORT"),
        (("--listen", "0.0.0.0:7070", "--advertise", "10.0.0.5"), "--advertise '10.0.0.5': "
         "expected HOST:PORT with a port in 1-65535"),
        (("--advertise", "10.0.0.5:0"), "port in 1-65535"),
        (("--advertise", "10.0.0.5:65536"), "port in 1-65535"),
        (("--advertise", "0.0.0.0:7070"), "no address a peer can reach"),
        (("--advertise", ":7070"), "no address a peer can reach"),
        (("--advertise", "bad_name!:7070"), "HOST must be an IPv4 address"),
        (("--advertise", "10.0.0.500:7070"), "HOST must be an IPv4 address"),
        (("--advertise", "::1:7070"), "HOST must be an IPv4 address"),
    ],
)
def test_bad_addresses_exit_2_naming_the_option(args: tuple[str, ...], message: str) -> None:
    result = start(*args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    option = "--listen" if "every interface" in message else "--advertise"
    assert option in result.stderr


def test_the_environment_gives_the_advertised_address() -> None:
    result = start("--listen", "0.0.0.0:7070",
                   env=dict(os.environ, HYPERMESH_ADVERTISE="10.0.0.5:99999"))
    assert result.returncode == 2 and "--advertise '10.0.0.5:99999'" in result.stderr


@pytest.mark.parametrize(
    "address",
    ["10.0.0.5:7070", "[fd00::5]:7070", "node-1.example.com:443", "gpu1:1",
     "gpu1.example.com.:65535"],
)
def test_good_advertised_addresses(address: str) -> None:
    cfg = AgentConfig.local(listen="0.0.0.0:7070", advertise=address, insecure=True)
    assert cfg.advertise == address


def test_no_advertise_needed_on_a_given_address() -> None:
    assert AgentConfig.local(listen="127.0.0.1:0").advertise is None
    with pytest.raises(UsageError, match="--advertise"):
        AgentConfig.local(listen="0.0.0.0:0", insecure=True)


@pytest.mark.parametrize(
    ("bound", "advertise", "registered", "dashboard", "here"),
    [
        # bound, --advertise, registered, dashboard bound at 0.0.0.0:7071, what mounts dial
        ("10.0.0.5:7070", None, "10.0.0.5:7070", "0.0.0.0:7071", "10.0.0.5:7070"),
        ("0.0.0.0:7070", "10.0.0.5:7070", "10.0.0.5:7070", "10.0.0.5:7071", "127.0.0.1:7070"),
        ("0.0.0.0:7070", "gpu1.lan:9000", "gpu1.lan:9000", "gpu1.lan:7071", "127.0.0.1:7070"),
        ("[::]:7070", "[fd00::5]:7070", "[fd00::5]:7070", "[fd00::5]:7071", "[::1]:7070"),
        ("10.0.0.5:7070", "203.0.113.9:7070", "203.0.113.9:7070", "203.0.113.9:7071",
         "10.0.0.5:7070"),
    ],
)
def test_what_an_agent_registers_and_dials(
    bound: str, advertise: str | None, registered: str, dashboard: str, here: str
) -> None:
    assert addresses.advertised(bound, advertise) == registered
    assert addresses.public("0.0.0.0:7071", advertise) == dashboard
    assert addresses.local(bound) == here
