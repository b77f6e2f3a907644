"""The image cache (agent/tasks/images.py) against a real registry (docker-registry on
loopback) and real podman: pulls of images the tests pushed, a wrong name, a registry
that is down (paused, or not listening), one pull shared by concurrent callers, and the
disk budget. Each test pushes images under names of its own and removes what it pulled."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from hypermesh.agent.tasks.containers import FRAMEWORK_IMAGES
from hypermesh.agent.tasks.images import (
    ImageCache,
    ImageConfig,
    ImageUnavailable,
    images_in_use,
    is_permanent,
    last_error,
    pull_backoff,
)
from hypermesh.config import AgentConfig
from hypermesh.errors import UsageError
from hypermesh.local.images import build_image, image_exists
from hypermesh.local.processes import free_port, wait_for
from hypermesh.local.registry import Registry
from hypermesh.state.keyspace import TaskRef
from tests.claims.test_claims import Feed

FAST = ImageConfig.local(deadline_s=20.0, backoff_first_s=0.1, backoff_max_s=0.5)


def podman(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["podman", *args], capture_output=True, text=True, check=False)


class Pushed:
    """Images pushed to the registry under names of one test; removes at the end the
    references it made (local and pulled), only those."""

    def __init__(self, registry: Registry, root: Path) -> None:
        self.registry = registry
        self.root = root
        self.prefix = f"{registry.address}/t{uuid.uuid4().hex[:12]}"
        self.refs: list[str] = []
        self.sizes: dict[str, int] = {}

    def tiny(self, name: str, runnable: bool = False) -> str:
        """A tiny image of its own (one file), pushed as PREFIX/NAME:1 and absent here;
        ``runnable``: with bash and busybox's tools too (a few MB), for a task to run in."""
        marker = self.root / f"{name}-{uuid.uuid4().hex}.txt"
        marker.write_text(f"{name} {uuid.uuid4().hex}\n")
        files, links = [marker], {}
        if runnable:
            busybox, bash = shutil.which("busybox"), shutil.which("bash")
            assert busybox and bash, "bash scripts/setup.sh installs busybox-static"
            files += [Path(busybox), Path(os.path.realpath(bash))]
            links = {f"/bin/{tool}": busybox for tool in ("sh", "cat", "echo", "sleep", "test")}
        local = build_image(f"localhost/hm-test-{uuid.uuid4().hex[:12]}", files, links)
        ref = f"{self.prefix}/{name}:1"
        self.refs.append(ref)
        try:
            size = podman("image", "inspect", "--format", "{{.Size}}", local).stdout.strip()
            self.sizes[ref] = int(size)
            pushed = podman("push", local, ref)
            assert pushed.returncode == 0, pushed.stderr
        finally:
            podman("rmi", local)
        assert not image_exists(ref)
        return ref

    def remove(self) -> None:
        for ref in self.refs:
            if image_exists(ref):
                podman("rmi", ref)


@pytest.fixture
def pushed(registry: Registry, tmp_path: Path) -> Iterator[Pushed]:
    images = Pushed(registry, tmp_path)
    try:
        yield images
    finally:
        registry.resume()
        images.remove()


def cache(work_dir: Path, cfg: ImageConfig = FAST, in_use: set[str] | None = None
          ) -> tuple[ImageCache, list[str]]:
    """A cache on podman, and its decision log."""
    decisions: list[str] = []

    async def runtime() -> str:
        return "podman"

    return ImageCache(cfg, work_dir, runtime, in_use=lambda: set(in_use or ()),
                      decide=decisions.append), decisions


def pulls(decisions: list[str], ref: str) -> int:
    return sum(d.startswith(f"pulling image {ref}") for d in decisions)


# ---------------------------------------------------------------------- pure rules
@pytest.mark.parametrize(("failures", "expected"), [(1, 1.0), (2, 2.0), (3, 4.0), (5, 16.0),
                                                    (6, 30.0), (100, 30.0)])
def test_backoff_doubles_up_to_its_cap(failures: int, expected: float) -> None:
    assert pull_backoff(failures, 1.0, 30.0) == expected


@pytest.mark.parametrize(("message", "permanent"), [
    ("Error: initializing source docker://r/x:1: reading manifest 1 in r/x: "
     "manifest unknown: manifest unknown", True),
    ("Error: invalid reference format", True),
    ("Error: reading manifest: unauthorized: authentication required", True),
    ("Error: requested access to the resource is denied", True),
    ('Error: pinging container registry r: Get "http://r/v2/": dial tcp: '
     "connect: connection refused", False),
    ("Error: ... i/o timeout", False),
])
def test_permanent_errors_are_told_from_transient_ones(message: str, permanent: bool) -> None:
    assert is_permanent(message) is permanent


def test_the_runtimes_message_is_its_last_error_line() -> None:
    err = "Trying to pull r/x:1...\nError: manifest unknown\n"
    assert last_error(err) == "Error: manifest unknown"
    assert last_error("only a line\n") == "only a line"


def test_the_images_in_use_are_those_of_the_running_attempts_experiments() -> None:
    feed = Feed()
    feed.workflow("w1", """
        experiments:
          own: {image: "r.example/own:1", command: ["true"]}
          torch: {framework: pytorch, command: ["true"]}
          both: {framework: pytorch, image: "r.example/both:2", command: ["true"]}
          plain: {command: ["true"]}
          idle: {image: "r.example/idle:1", command: ["true"]}
    """)
    feed.workflow("w2", """
        experiments:
          own: {image: "r.example/own:1", command: ["true"]}
    """)
    running = [TaskRef("w1", name, 0) for name in ("own", "torch", "both", "plain")]
    assert images_in_use(feed.view, [*running, TaskRef("w2", "own", 3)]) == {
        "r.example/own:1", FRAMEWORK_IMAGES["pytorch"], "r.example/both:2"}
    assert images_in_use(feed.view, [TaskRef("gone", "own", 0)]) == set()  # a workflow removed
    assert images_in_use(feed.view, []) == set()


# ---------------------------------------------------------------------- pulls
def test_an_image_is_pulled_once_recorded_and_known_after_a_restart(
    pushed: Pushed, tmp_path: Path
) -> None:
    ref = pushed.tiny("a")
    images, decisions = cache(tmp_path)

    async def twice() -> None:
        await images.ensure(ref)
        await images.ensure(ref)

    asyncio.run(twice())
    assert image_exists(ref)
    assert pulls(decisions, ref) == 1
    assert images.pulled[ref].size > 0 and images.pulled[ref].id
    again, _ = cache(tmp_path)  # a restarted agent reads images.json
    assert set(again.pulled) == {ref}


def test_a_wrong_name_fails_fast_with_the_runtimes_message(pushed: Pushed, tmp_path: Path) -> None:
    wrong = f"{pushed.prefix}/missing:1"
    images, decisions = cache(tmp_path)
    started = time.monotonic()
    with pytest.raises(ImageUnavailable, match="manifest unknown"):
        asyncio.run(images.ensure(wrong))
    assert time.monotonic() - started < 5
    # Remembered for a while: the next attempt fails at once, without pulling again.
    with pytest.raises(ImageUnavailable, match="manifest unknown"):
        asyncio.run(images.ensure(wrong))
    assert pulls(decisions, wrong) == 1


def test_a_paused_registry_is_waited_for_and_concurrent_callers_share_one_pull(
    pushed: Pushed, registry: Registry, tmp_path: Path
) -> None:
    ref = pushed.tiny("b")
    images, decisions = cache(tmp_path)

    async def scenario() -> None:
        registry.pause()
        callers = [asyncio.ensure_future(images.ensure(ref)) for _ in range(3)]
        while pulls(decisions, ref) == 0:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # the registry stays down a while; the pull holds
        assert not any(c.done() for c in callers)
        registry.resume()
        await asyncio.wait_for(asyncio.gather(*callers), 15)

    asyncio.run(scenario())
    assert image_exists(ref)
    assert pulls(decisions, ref) == 1


def test_a_registry_down_past_the_deadline_fails_the_pull_with_why(
    pushed: Pushed, registry: Registry, tmp_path: Path
) -> None:
    ref = pushed.tiny("c")
    images, _ = cache(tmp_path, ImageConfig.local(deadline_s=2.0))
    registry.pause()
    started = time.monotonic()
    with pytest.raises(ImageUnavailable, match=r"did not finish within 2s"):
        asyncio.run(images.ensure(ref))
    assert 2.0 <= time.monotonic() - started < 6
    registry.resume()
    assert not image_exists(ref)


def test_refused_connections_are_retried_with_backoff_until_the_deadline(tmp_path: Path) -> None:
    ref = f"127.0.0.1:{free_port()}/nobody/here:1"  # no registry listens there
    images, decisions = cache(tmp_path, ImageConfig.local(deadline_s=4.0, backoff_first_s=0.1))
    with pytest.raises(ImageUnavailable, match="connection refused"):
        asyncio.run(images.ensure(ref))
    assert pulls(decisions, ref) >= 2, decisions


def test_past_the_budget_the_least_recently_used_pulled_images_go(
    pushed: Pushed, tmp_path: Path
) -> None:
    a, b, c, d = (pushed.tiny(n) for n in "abcd")
    (tmp_path / "own.txt").write_text(f"own {uuid.uuid4().hex}\n")
    own = build_image(f"localhost/hm-test-{uuid.uuid4().hex[:12]}", [tmp_path / "own.txt"], {})
    try:
        budget = pushed.sizes[a] + pushed.sizes[b] + min(pushed.sizes.values()) // 2
        in_use: set[str] = set()
        images, _ = cache(tmp_path, ImageConfig.local(budget_bytes=budget), in_use)

        async def scenario() -> None:
            await images.ensure(own)  # present, not pulled here: never removed
            await images.ensure(a)
            await images.ensure(b)
            await images.ensure(a)  # a used again: b is the least recently used
            await images.ensure(c)  # three past the budget: b goes
            assert not image_exists(b) and image_exists(a) and image_exists(c)
            in_use.add(a)  # a running task uses a, the least recently used now
            await images.ensure(d)  # c goes, a stays
            assert not image_exists(c) and image_exists(a) and image_exists(d)

        asyncio.run(scenario())
        assert image_exists(own)
        assert set(images.pulled) == {a, d}
        assert set(cache(tmp_path)[0].pulled) == {a, d}
    finally:
        podman("rmi", own)


def test_the_pull_ahead_of_a_held_experiment_wakes_the_claims(
    pushed: Pushed, tmp_path: Path
) -> None:
    ref = pushed.tiny("e")
    woken = asyncio.Event()
    changes: list[dict[str, str]] = []

    async def runtime() -> str:
        return "podman"

    async def scenario() -> None:
        images = ImageCache(FAST, tmp_path, runtime, wake=woken.set,
                            changed=lambda: changes.append(images.pulling()))
        assert images.hold({("w1", "train"): ref}) == {("w1", "train")}
        await asyncio.wait_for(woken.wait(), 15)
        assert images.hold({("w1", "train"): ref}) == set()

    asyncio.run(scenario())
    assert changes == [{"w1/train": ref}, {}]  # published when it started and ended
    wait_for(lambda: image_exists(ref), 5, "the pulled image")


def test_the_agents_image_options_are_checked_and_become_its_image_config() -> None:
    with pytest.raises(UsageError, match="--image-budget 'lots'"):
        AgentConfig.local(image_budget="lots")
    with pytest.raises(UsageError, match="--image-pull-deadline"):
        AgentConfig.local(image_pull_deadline="0s")
    cfg = ImageConfig.for_agent("lan", "2GiB", None)
    assert (cfg.budget_bytes, cfg.deadline_s) == (2 << 30, 300.0)
    assert ImageConfig.for_agent("local", "20GiB", "7s").deadline_s == 7.0
