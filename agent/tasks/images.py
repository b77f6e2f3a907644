"""The agent's image cache: the container images its tasks run in, pulled ahead of the
claims that need them, kept while they are recent, removed past a disk budget.

:meth:`ImageCache.ensure` makes an image present in the runtime's store. An image already
there (built here, pulled by someone else, pulled earlier) is used as it is. Otherwise one
pull runs per image at a time, however many callers wait for it, under an overall
deadline (:class:`ImageConfig`): a permanent refusal (``manifest unknown``, an invalid
reference, ``unauthorized``: :func:`is_permanent`) fails at once; anything else (a
refused connection, a registry that does not answer) is tried again with backoff
(:func:`pull_backoff`) until the deadline, and a try that hangs is stopped at it. The
failure (:class:`ImageUnavailable`) carries the runtime's own message and is remembered
for ``failure_memory_s``, so the attempts that meet it end at once with reason ``image``.

Pull-ahead: each claim round the claimer asks :meth:`ImageCache.hold` which experiments
to leave unclaimed: those whose image is not known to be present here and whose pull has
not failed lately. It starts their pulls; when one ends the claim loop is woken. What is
being pulled for which experiment (:meth:`ImageCache.pulling`) goes into the node's
registration record, which ``hypermesh tasks`` and the dashboard read ("pulling image
REF on NODE"): two writes per pull, none for an image that is present.

Budget: the images this agent pulled are recorded in ``images.json`` in its work folder
(reference, image id, size, last use), so a restarted agent knows them. After each pull,
while their distinct images take more than ``budget_bytes``, the least recently used one
is removed, unless a running attempt uses it or an experiment with open tasks wants it.
An image this agent did not pull is never removed; ``rmi`` without force leaves an image
that a container still uses.

Owned by the agent's event loop. The runtime's CLI (podman or docker) is the only I/O;
:func:`is_permanent`, :func:`pull_backoff` and :func:`images_wanted` are pure.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from hypermesh.agent.tasks.containers import image_for
from hypermesh.errors import HypermeshError, UsageError
from hypermesh.recipe.units import parse_duration, parse_size
from hypermesh.state.fit import allowed_on
from hypermesh.state.keyspace import BlockRef, TaskRef
from hypermesh.state.records import TERMINAL, NodeRecord
from hypermesh.state.view import MeshView

log = logging.getLogger("hypermesh.agent")

STATE_FILE = "images.json"
GIB = 1 << 30

# What registries and runtimes say when trying again cannot help (lower case).
PERMANENT_MARKERS = (
    "manifest unknown",
    "name unknown",
    "invalid reference",
    "repository name must",
    "unauthorized",
    "authentication required",
    "access denied",
    "requested access to the resource is denied",
    "denied:",
)

ExperimentKey = tuple[str, str]  # (workflow id, experiment name)


class ImageUnavailable(HypermeshError):
    """An image could not be made present; ``str()`` is what the runtime said."""


@dataclass(frozen=True)
class ImageConfig:
    """How an agent pulls and keeps images. Presets: :meth:`lan` and :meth:`local`."""

    deadline_s: float = 300.0
    """Seconds one pull may take, tries and waits included (1-86400). Longer lets a
    large image arrive over a slow link and rides out a longer registry outage; shorter
    fails the attempts that wait for it sooner (they fail with reason ``image`` and retry
    as the recipe allows)."""

    budget_bytes: int = 20 * GIB
    """Most bytes the images this agent pulled may take (``--image-budget``); past it
    the least recently used ones are removed. 0 keeps only those in use or wanted."""

    failure_memory_s: float = 60.0
    """Seconds a failed pull is remembered (0-3600): attempts in that time fail at once
    with its message instead of pulling again; then a claim round tries again."""

    backoff_first_s: float = 1.0
    """Wait after the first transient failure (0.01-60); doubled after each."""

    backoff_max_s: float = 30.0
    """Longest wait between two tries (0.01-600)."""

    def __post_init__(self) -> None:
        for name, value, low, high in (
            ("image pull deadline", self.deadline_s, 1.0, 86400.0),
            ("failure_memory_s", self.failure_memory_s, 0.0, 3600.0),
            ("backoff_first_s", self.backoff_first_s, 0.01, 60.0),
            ("backoff_max_s", self.backoff_max_s, 0.01, 600.0),
        ):
            if not low <= value <= high:
                raise UsageError(f"{name} {value} is out of range: allowed {low}..{high}")
        if self.budget_bytes < 0:
            raise UsageError(f"--image-budget {self.budget_bytes}: must not be negative")

    @classmethod
    def lan(cls, **overrides: object) -> ImageConfig:
        return cls(**overrides)  # type: ignore[arg-type]

    @classmethod
    def local(cls, **overrides: object) -> ImageConfig:
        """Tight timings for tests and the local mesh."""
        base: dict[str, object] = {"deadline_s": 20.0, "failure_memory_s": 5.0,
                                   "backoff_first_s": 0.2, "backoff_max_s": 2.0}
        return cls(**(base | overrides))  # type: ignore[arg-type]

    @classmethod
    def for_agent(cls, preset: str, budget: str, deadline: str | None) -> ImageConfig:
        """The agent's (``--image-budget``, ``--image-pull-deadline``; None: the preset's)."""
        overrides: dict[str, object] = {"budget_bytes": parse_size(budget)}
        if deadline is not None:
            overrides["deadline_s"] = parse_duration(deadline)
        return cls.local(**overrides) if preset == "local" else cls.lan(**overrides)


def is_permanent(message: str) -> bool:
    """Whether a runtime's error says that trying again cannot help."""
    lower = message.lower()
    return any(marker in lower for marker in PERMANENT_MARKERS)


def pull_backoff(failures: int, first_s: float, max_s: float) -> float:
    """Seconds to wait after ``failures`` transient failures in a row (1 or more):
    ``first_s``, doubled after each, at most ``max_s``."""
    return float(min(max_s, first_s * 2 ** max(0, min(failures - 1, 30))))


def last_error(stderr: str) -> str:
    """The runtime's message: its last ``Error:`` line, else its last line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    for line in reversed(lines):
        if line.startswith("Error"):
            return line
    return lines[-1] if lines else ""


def images_wanted(view: MeshView, me: NodeRecord) -> dict[ExperimentKey, str]:
    """The experiments this node may run now that name an image (their own, or their
    framework's): live workflow, expanded, not cancelled, a single-node experiment whose
    hardware and pools fit this node, with open tasks or an unfinished free block."""
    wanted: dict[ExperimentKey, str] = {}
    offered = {(b.workflow, b.experiment) for b in view.offers.get(me.name, ((), 0))[0]}
    for wf in view.workflows.values():
        if view.workflow_state(wf.id) in TERMINAL:
            continue
        for exp in wf.recipe.experiments:
            image = image_for(exp.framework, exp.image)
            if image is None or exp.nodes > 1 or (wf.id, exp.name) not in view.expanded:
                continue
            if view.experiment_cancelled(wf.id, exp.name) or not allowed_on(exp, me):
                continue
            if (wf.id, exp.name) in offered:  # --watch own: blocks the leader offers it
                work = True
            elif view.batched(wf.id, exp.name):
                work = any(
                    BlockRef(wf.id, exp.name, first) not in view.block_claims
                    and view.block_unfinished(BlockRef(wf.id, exp.name, first)) > 0
                    for first in view.block_firsts(wf.id, exp.name)
                )
            else:
                work = bool(view.open.get((wf.id, exp.name)))
            if work:
                wanted[(wf.id, exp.name)] = image
    return wanted


def images_in_use(view: MeshView, refs: Iterable[TaskRef]) -> set[str]:
    """The images of the experiments of ``refs`` (the attempts running here)."""
    used: set[str] = set()
    for ref in refs:
        wf = view.workflows.get(ref.workflow)
        if wf is None:
            continue
        exp = wf.recipe.experiment(ref.experiment)
        image = image_for(exp.framework, exp.image)
        if image is not None:
            used.add(image)
    return used


@dataclass
class Pulled:
    """One image this agent pulled, as ``images.json`` records it."""

    id: str
    size: int
    used_at: float  # wall clock: survives a restart


class ImageCache:
    """The images of one agent. ``runtime`` resolves the container runtime (None: no
    runtime; nothing is pulled); ``in_use`` gives the images of running attempts;
    ``changed`` is called when :meth:`pulling` changes; ``wake`` when a pull ends."""

    def __init__(
        self,
        cfg: ImageConfig,
        work_dir: Path,
        runtime: Callable[[], Awaitable[str | None]],
        *,
        in_use: Callable[[], set[str]] = set,
        changed: Callable[[], None] = lambda: None,
        wake: Callable[[], None] = lambda: None,
        decide: Callable[[str], None] = lambda message: None,
    ) -> None:
        self.cfg = cfg
        self.path = Path(work_dir) / STATE_FILE
        self._runtime = runtime
        self._in_use = in_use
        self._changed = changed
        self._wake = wake
        self.decide = decide
        self.pulled: dict[str, Pulled] = self._load()
        self._present: set[str] = set()
        self._failed: dict[str, tuple[float, str]] = {}  # image -> (monotonic, message)
        self._fetches: dict[str, asyncio.Task[None]] = {}
        self._pulling: set[str] = set()  # images whose pull (not only the check) runs
        self._waiting: dict[str, set[ExperimentKey]] = {}  # image -> experiments held
        self._wanted: set[str] = set()
        self.version = 0  # raised whenever what pulling() says may have changed

    # ------------------------------------------------------------------ asking
    async def ensure(self, image: str) -> None:
        """Return once ``image`` is present (or there is no runtime); raise
        :class:`ImageUnavailable` with the runtime's message when it cannot be."""
        if image in self._present:
            self._touch(image)
            return
        failed = self._recent_failure(image)
        if failed is not None:
            raise ImageUnavailable(failed)
        await asyncio.shield(self._fetch(image))
        self._touch(image)

    def hold(self, wanted: dict[ExperimentKey, str]) -> set[ExperimentKey]:
        """The experiments of ``wanted`` (:func:`images_wanted`) not to claim yet: their
        image is not known to be present and has not failed lately. Their pulls start."""
        self._wanted = set(wanted.values())
        held: set[ExperimentKey] = set()
        for key, image in wanted.items():
            if image in self._present or self._recent_failure(image) is not None:
                continue
            held.add(key)
            waiting = self._waiting.setdefault(image, set())
            if key not in waiting:
                waiting.add(key)
                if image in self._pulling:
                    self._pulling_changed()
            self._fetch(image)
        return held

    def pulling(self) -> dict[str, str]:
        """``WORKFLOW/EXPERIMENT`` -> image for each experiment held for a pull in flight."""
        return {f"{wid}/{name}": image for image in sorted(self._pulling)
                for wid, name in sorted(self._waiting.get(image, ()))}

    def _pulling_changed(self) -> None:
        self.version += 1
        self._changed()

    # ------------------------------------------------------------------ pulling
    def _fetch(self, image: str) -> asyncio.Task[None]:
        task = self._fetches.get(image)
        if task is None:
            task = self._fetches[image] = asyncio.ensure_future(self._make_present(image))
            task.add_done_callback(lambda t: self._fetched(image, t))
        return task

    def _fetched(self, image: str, task: asyncio.Task[None]) -> None:
        self._fetches.pop(image, None)
        self._waiting.pop(image, None)
        if not task.cancelled():
            task.exception()  # retrieved: each waiter sees it
        self._wake()

    async def _make_present(self, image: str) -> None:
        runtime = await self._runtime()
        if runtime is None or await self._inspect(runtime, image) is not None:
            self._present.add(image)
            return
        self._pulling.add(image)
        self._pulling_changed()
        try:
            await self._pull(runtime, image)
        except ImageUnavailable as exc:
            self._failed[image] = (time.monotonic(), str(exc))
            self.decide(f"image {image}: pull failed: {exc}")
            raise
        finally:
            self._pulling.discard(image)
            self._pulling_changed()
        self._failed.pop(image, None)
        self._present.add(image)
        found = await self._inspect(runtime, image)
        image_id, size = found if found is not None else ("", 0)
        self.pulled[image] = Pulled(image_id, size, time.time())
        self.decide(f"image {image}: pulled ({size / 1e6:.1f} MB)")
        await self.collect(runtime)

    async def _pull(self, runtime: str, image: str) -> None:
        deadline = time.monotonic() + self.cfg.deadline_s
        failures = 0
        message = "no answer from the registry"
        while True:
            left = deadline - time.monotonic()
            self.decide(f"pulling image {image}" + (f" (try {failures + 1})" if failures else ""))
            done = await _run([runtime, "pull", image], left)
            if done is None:
                raise ImageUnavailable(
                    f"{runtime} pull {image} did not finish within {self.cfg.deadline_s:g}s: "
                    f"{message}")
            code, _, err = done
            if code == 0:
                return
            message = last_error(err) or f"{runtime} pull exited with {code}"
            if is_permanent(message):
                raise ImageUnavailable(message)
            failures += 1
            wait = pull_backoff(failures, self.cfg.backoff_first_s, self.cfg.backoff_max_s)
            if time.monotonic() + wait >= deadline:
                raise ImageUnavailable(
                    f"{runtime} pull {image} failed until its deadline "
                    f"({self.cfg.deadline_s:g}s): {message}")
            await asyncio.sleep(wait)

    async def _inspect(self, runtime: str, image: str) -> tuple[str, int] | None:
        """The image's id and size when the runtime's store holds it."""
        done = await _run([runtime, "image", "inspect", "--format", "{{.Id}} {{.Size}}", image],
                          60.0)
        if done is None or done[0] != 0:
            return None
        fields = done[1].split()
        try:
            return fields[0], int(fields[1])
        except (IndexError, ValueError):
            return None

    # ------------------------------------------------------------------ keeping
    async def collect(self, runtime: str | None = None) -> list[str]:
        """Remove the least recently used images this agent pulled while they take more
        than the budget; never one in use or wanted. The references removed."""
        runtime = runtime or await self._runtime()
        if runtime is None:
            return []
        keep = self._in_use() | self._wanted | self._pulling | set(self._fetches)
        sizes = {p.id: p.size for p in self.pulled.values()}
        total = sum(sizes.values())
        removed: list[str] = []
        for image in sorted(self.pulled, key=lambda i: self.pulled[i].used_at):
            if total <= self.cfg.budget_bytes:
                break
            if image in keep:
                continue
            done = await _run([runtime, "rmi", image], 60.0)
            if done is None or (done[0] != 0 and "image not known" not in done[2]
                                and "No such image" not in done[2]):
                self.decide(f"image {image}: not removed: {last_error(done[2]) if done else ''}")
                continue
            gone = self.pulled.pop(image)
            self._present.discard(image)
            removed.append(image)
            if all(p.id != gone.id for p in self.pulled.values()):
                total -= sizes.get(gone.id, 0)
            self.decide(f"image {image}: removed (unused; images past the budget)")
        try:
            self._save()
        except OSError as exc:
            log.warning("%s: not written: %s", self.path, exc)
        return removed

    def _touch(self, image: str) -> None:
        pulled = self.pulled.get(image)
        if pulled is not None:
            pulled.used_at = time.time()

    def _recent_failure(self, image: str) -> str | None:
        failed = self._failed.get(image)
        if failed is None:
            return None
        if time.monotonic() - failed[0] >= self.cfg.failure_memory_s:
            del self._failed[image]
            return None
        return failed[1]

    def _load(self) -> dict[str, Pulled]:
        try:
            data = json.loads(self.path.read_text())
            return {image: Pulled(str(p["id"]), int(p["size"]), float(p["used_at"]))
                    for image, p in data.get("pulled", {}).items()}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("%s: unreadable, starting afresh: %s", self.path, exc)
            return {}

    def _save(self) -> None:
        data = {"pulled": {image: {"id": p.id, "size": p.size, "used_at": p.used_at}
                           for image, p in sorted(self.pulled.items())}}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        os.replace(tmp, self.path)

    async def close(self) -> None:
        """Stop the pulls in flight and record what was pulled."""
        for task in list(self._fetches.values()):
            task.cancel()
        if self._fetches:
            await asyncio.wait(list(self._fetches.values()), timeout=5)
        if self.pulled or self.path.exists():  # the last uses, for the next start
            with contextlib.suppress(OSError):
                self._save()


async def _run(argv: list[str], timeout: float) -> tuple[int, str, str] | None:
    """Run the runtime's CLI; its exit code, stdout and stderr, or None when it did not
    finish within ``timeout`` seconds (it is killed)."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
    except OSError as exc:  # the runtime's CLI is gone: a failure like any other
        return 127, "", f"Error: {argv[0]}: {exc}"
    try:
        out, err = await asyncio.wait_for(proc.communicate(), max(0.0, timeout))
    except TimeoutError:
        return None
    finally:
        if proc.returncode is None:  # timed out, or the caller was cancelled
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
    return proc.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace")
