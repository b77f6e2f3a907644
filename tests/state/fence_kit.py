"""What the fence tests (``tests/state/test_fences_*.py``) share: a namespace per test on
the session's etcd, an etcd client that lets another actor act between a read and the
write that depends on it (the pause a fence exists for) or loses answers (``fault_txns``,
which ``test_etcd_client.py`` also uses on a plain client), and a running
workflow (experiment ``a`` of 8 samples, and ``b`` after it) for the leader's and the
live changes' fences.

The clients are the production ``Etcd`` edge; only the moment at which another actor
writes is chosen by the test, so every transaction under test is the real one.
"""

from __future__ import annotations

import asyncio
import json
import textwrap
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

import grpc

from hypermesh.local.etcd import EtcdServer
from hypermesh.recipe.recipe import parse_recipe
from hypermesh.state.etcd import Etcd, TxnResult
from hypermesh.state.keyspace import Keyspace
from hypermesh.state.records import WorkflowRecord
from hypermesh.state.txns import new_workflow_id, set_workflow_state, submit_workflow

Hook = Callable[[], Awaitable[None]]


def fresh_keyspace() -> Keyspace:
    """A namespace no other test uses."""
    return Keyspace(f"f{uuid.uuid4().hex[:10]}")


def endpoint(server: EtcdServer) -> list[str]:
    return [server.url.split("//")[1]]


def run(scenario: Coroutine[Any, Any, None]) -> None:
    asyncio.run(scenario)


async def value_of(etcd: Etcd, key: str) -> Any:
    """The JSON value stored at ``key``, or None when there is no such key."""
    got = await etcd.get(key)
    return None if got is None else json.loads(got[0])


async def revision_of(etcd: Etcd, key: str) -> int | None:
    """The mod revision of ``key``, or None when there is no such key."""
    got = await etcd.get(key)
    return None if got is None else got[1]


class SteppedEtcd(Etcd):
    """A real ``Etcd`` client whose caller can be paused at chosen points.

    - ``before_txn(hook)``: ``hook`` runs just before this client's next transaction
      (hooks queue up, one per transaction): another actor's writes land between the
      reads a function made and its write.
    - ``after_read(key, hook)``: ``hook`` runs once, right after this client read ``key``.
    - ``reads``: every key this client read with ``get``, in order.
    - ``lose_answers()``: from now on, the next transaction is committed by etcd but
      its answer never arrives, and every later one is refused (etcd unreachable), until
      ``answers_again()``: what a member dying mid-claim and staying away looks like.
    """

    def __init__(self, endpoints: list[str], *, timeout: float = 5.0) -> None:
        super().__init__(endpoints, timeout=timeout)
        self._before: list[Hook] = []
        self._after_read: dict[str, Hook] = {}
        self.reads: list[str] = []
        self.interleaved = 0  # hooks run so far
        self._fault: str | None = None
        self._timeout = timeout

    def before_txn(self, hook: Hook) -> None:
        self._before.append(hook)

    def after_read(self, key: str, hook: Hook) -> None:
        self._after_read[key] = hook

    async def txn(
        self, compare: list[Any], success: list[Any], failure: Sequence[Any] = ()
    ) -> TxnResult:
        if self._before:
            await self._before.pop(0)()
            self.interleaved += 1
        return await super().txn(compare, success, failure)

    async def get(self, key: str) -> tuple[bytes, int] | None:
        got = await super().get(key)
        self.reads.append(key)
        hook = self._after_read.pop(key, None)
        if hook is not None:
            await hook()
            self.interleaved += 1
        return got

    def lose_answers(self, deadline: float = 0.5) -> list[str]:
        """Start losing answers (see the class), with ``deadline`` seconds for a
        transaction to give up in; returns the log of faulted calls."""
        self._fault = "lost"
        self._timeout, self.timeout = self.timeout, deadline

        def next_fault() -> str:
            fault = self._fault or "ok"
            if fault == "lost":
                self._fault = "refused"
            return fault

        return fault_txns(self, next_fault)

    def answers_again(self) -> None:
        self._fault = None
        self.timeout = self._timeout


def fault_txns(etcd: Etcd, faults: list[str] | Callable[[], str]) -> list[str]:
    """Make ``etcd``'s next transactions go wrong, one word each, taken from the list
    ``faults`` (then ``ok``) or asked of ``faults()`` per call: ``lost`` (etcd commits
    it, the answer never arrives), ``refused`` (it never reaches etcd), ``ok``. Both
    fail as an unreachable member does (gRPC ``UNAVAILABLE``). Returns the log of what
    each call did."""
    real = type(etcd.kv).txn.__get__(etcd.kv)  # the client's own, not an earlier fault's
    log: list[str] = []

    def next_fault() -> str:
        if callable(faults):
            return faults()
        return faults.pop(0) if faults else "ok"

    async def txn(*args: Any, **kwargs: Any) -> Any:
        fault = next_fault()
        log.append(fault)
        if fault == "refused":
            raise _unavailable()
        resp = await real(*args, **kwargs)
        if fault == "lost":
            raise _unavailable()
        return resp

    etcd.kv.txn = txn  # type: ignore[method-assign]
    return log


def _unavailable() -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "Socket closed"
    )


# ---------------------------------------------------------------- a running workflow
CHAIN = """
experiments:
  a:
    command: echo {{x}}
    parameters: {x: {range: [0.0, 1.0]}}
    samples: 8
  b: {command: echo b, after: [a]}
"""


def workflow() -> WorkflowRecord:
    return WorkflowRecord(
        id=new_workflow_id("fence"), name="fence", recipe=parse_recipe(textwrap.dedent(CHAIN)),
        seed=1, submitted_at=time.time(), workdir="/tmp",
    )


async def running(etcd: Etcd, ks: Keyspace, wf: WorkflowRecord | None = None) -> tuple[str, int]:
    """Submit ``wf`` (a new one by default) and start it, as the leader does; its id and
    the revision of its state key (what a leader's view of it holds)."""
    wf = wf or workflow()
    await submit_workflow(etcd, ks, wf)
    assert await set_workflow_state(etcd, ks, wf.id, "pending", "running")
    got = await etcd.get(ks.workflow_state(wf.id))
    assert got is not None
    return wf.id, got[1]


async def state_of(etcd: Etcd, ks: Keyspace, wid: str) -> tuple[str, int]:
    """The workflow's state and its key's revision."""
    got = await etcd.get(ks.workflow_state(wid))
    assert got is not None
    return json.loads(got[0])["state"], got[1]
