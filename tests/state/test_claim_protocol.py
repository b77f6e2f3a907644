"""The claim / renew / finish / revoke / retry protocol as a Hypothesis state machine,
against the session's real etcd.

Three simulated agents, each on its own lease like a node, interleave on one workflow of
three tasks (``workers: 2``, ``retries: 1``). They do what an agent does, with the agent's
own code: pick tasks from a mirror that may lag behind etcd (``choose_claims``) and claim
them in one transaction (``claim_tasks``), renew their leases, and record how an attempt
ended (a success, or a failure that counts against ``retries``; ``MeshView.final_state``
decides whether it is final) through the fenced ``finish_attempt``. The leader revokes an
agent's lease (it died): its running attempts live on as zombies, which may try to record
their end late. A dead agent comes back on a new lease, and ``retry`` reopens the failed
tasks (``retry_failed``).

After every step the invariants are checked against etcd itself, never against the model:
what the namespace holds now, and for each record the keys as they were at the revision
that wrote it (etcd keeps the history; the session's etcd is never compacted under a run):

- a task has at most one recorded success, and a result agrees with its attempt record;
- a result, and every ended attempt record, was written by the attempt whose claim held
  just before (a ``node-lost`` record: by the claim of the next attempt, written with it);
- a claim disappears only through its holder's finish or the end of its lease;
- slot keys are exactly the slots of the claims (the ``workers`` cap holds);
- a result stays, but a failed one that ``retry`` reopened;
- the failures that count against ``retries`` never exceed it by more than the one that
  fails the task, and that one always does.

At the end of a run (teardown) the agents stop failing: the zombies are gone, every agent
lives again, and rounds of claiming and succeeding must decide every task.

Removing the claim compare from ``finish_ops`` fails this test: Hypothesis finds a claim,
the revocation of its agent's lease and the zombie's late finish, which is recorded.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pytest
from etcd3aio.kv import prefix_range_end
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from hypermesh.agent.claims.choose import LocalLoad, choose_claims
from hypermesh.local.etcd import EtcdServer
from hypermesh.recipe.recipe import parse_recipe
from hypermesh.state.etcd import Etcd, hush_broken_stream_noise
from hypermesh.state.keyspace import Keyspace, TaskRef
from hypermesh.state.live import retry_failed
from hypermesh.state.records import Attempt, NodeRecord, WorkflowRecord
from hypermesh.state.txns import (
    ClaimPlan,
    claim_tasks,
    expand_experiment,
    finish_attempt,
    new_workflow_id,
    submit_workflow,
)
from hypermesh.state.view import MeshView

AGENTS = 3
TASKS = 3
WORKERS = 2  # the experiment's cap: fewer than the tasks, so slot keys are contended
RETRIES = 1
SLOTS = 2  # per agent
LEASE_TTL = 60  # s: no lease expires by itself during a run; leases end by revocation
ROUNDS = 2 * TASKS  # claim-and-succeed rounds the agents get to decide every task
RECIPE = f"""
experiments:
  e:
    command: 'true'
    parameters:
      x: {{values: {list(range(TASKS))}}}
    workers: {WORKERS}
    retries: {RETRIES}
"""

# Reproducible in CI: the same examples every run, no example database.
SETTINGS = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

T = TypeVar("T")


@dataclass
class SimAgent:
    """One simulated agent: its lease (None while it is dead), its mirror of the namespace
    (read again before a claim, unless the claim is drawn stale, so it lags as a watch
    may), the newest revision it wrote, and its running attempts: task -> (plan, claim
    revision)."""

    name: str
    lease: int | None
    view: MeshView
    written: int = 0
    running: dict[TaskRef, tuple[ClaimPlan, int]] = field(default_factory=dict)

    def record(self) -> NodeRecord:
        return NodeRecord(self.name, f"{self.name}:7000", slots=SLOTS, lease=self.lease or 0)


@dataclass(frozen=True, eq=False)
class Zombie:
    """An attempt whose agent's lease was revoked while it ran (a node paused or cut off
    that has not noticed yet): it may still try to record its end, deciding its final
    state with the mirror it had."""

    node: str
    lease: int
    plan: ClaimPlan
    claim_revision: int
    view: MeshView


@dataclass(frozen=True)
class SeenClaim:
    """A claim as one check read it."""

    mod_revision: int
    lease: int
    node: str
    attempt: int


def step(method: Callable[..., T]) -> Callable[..., T]:
    """Marks the machine unchecked until the invariants pass after this rule, so that
    teardown runs the protocol to its end only after steps that all passed."""

    @functools.wraps(method)
    def checked_later(self: ClaimProtocol, *args: Any, **kwargs: Any) -> T:
        self.healthy = False
        return method(self, *args, **kwargs)

    return checked_later


def ended(node: str, plan: ClaimPlan, succeed: bool) -> Attempt:
    """How an attempt's process ended, as the runner reports it (``agent/tasks/runner.py``)."""
    state, code = ("succeeded", 0) if succeed else ("failed", 1)
    return Attempt(plan.attempt, node, state, code, "exit", time.time() - 1, time.time())


class ClaimProtocol(RuleBasedStateMachine):
    """Agents claiming, renewing, finishing and dying on one workflow in a fresh namespace
    of the session's etcd, driven through one event loop owned by the run."""

    endpoint = ""  # host:port of the session's etcd; set by the test

    def __init__(self) -> None:
        super().__init__()
        self.healthy = True
        self.loop = asyncio.new_event_loop()
        hush_broken_stream_noise(self.loop)
        self.ks = Keyspace(f"p{uuid.uuid4().hex[:10]}")
        self.etcd = Etcd([self.endpoint])
        self.run(self.etcd.connect())
        wf = WorkflowRecord(
            id=new_workflow_id("protocol"), name="protocol", recipe=parse_recipe(RECIPE),
            seed=1, submitted_at=time.time(), workdir="/tmp",
        )
        self.wid = wf.id
        self.run(submit_workflow(self.etcd, self.ks, wf))
        params = [{"x": i} for i in range(TASKS)]
        assert self.run(expand_experiment(self.etcd, self.ks, wf.id, "e", params))
        self.refs = [TaskRef(wf.id, "e", i) for i in range(TASKS)]
        self.agents = [
            SimAgent(f"node{i}", self.run(self.etcd.grant(LEASE_TTL)), self.run(self.snapshot()))
            for i in range(AGENTS)
        ]
        self.zombies: list[Zombie] = []
        self.failed_results = False  # whether a task may have failed since the last retry
        self.claimable = True  # whether the last check saw an open task and a free slot
        # What the previous check read: claim key -> its claim; result key -> (mod
        # revision, value); and the records whose writing revision was checked already.
        self.seen_claims: dict[str, SeenClaim] = {}
        self.seen_results: dict[str, tuple[int, dict[str, Any]]] = {}
        self.checked: set[tuple[str, int]] = set()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    # ------------------------------------------------------------------ the agents' side
    def live(self) -> list[SimAgent]:
        return [a for a in self.agents if a.lease is not None]

    def named(self, name: str) -> SimAgent:
        return next(a for a in self.agents if a.name == name)

    def pick(self, data: st.DataObject, agents: list[SimAgent]) -> SimAgent:
        return self.named(data.draw(st.sampled_from([a.name for a in agents]), label="agent"))

    async def snapshot(self) -> MeshView:
        """A mirror of the namespace as etcd holds it now (one read, one revision)."""
        kvs, revision = await self.etcd.get_prefix(self.ks.root)
        view = MeshView(self.ks)
        for kv in kvs:
            view.apply(kv.key.decode(), kv.value, kv.create_revision, kv.mod_revision)
        view.revision = revision
        return view

    async def claim_round(self, agent: SimAgent, limit: int) -> None:
        """One claim transaction of ``agent``, planned on its mirror as the claimer does
        (``agent/claims/claimer.py``), read-your-writes gate included."""
        assert agent.lease is not None
        if agent.view.revision < agent.written:
            return  # the claimer waits for the watch to bring its own writes
        load = LocalLoad(
            running=set(agent.running),
            slots_held={
                (ref.workflow, ref.experiment, plan.slot)
                for ref, (plan, _) in agent.running.items()
                if plan.slot is not None
            },
        )
        plans = choose_claims(agent.view, agent.record(), load, limit)
        if not plans:
            return
        revision = await claim_tasks(
            self.etcd, self.ks, plans, agent.name, agent.lease, time.time()
        )
        if revision is None:
            return  # another agent got there first (or the mirror was stale)
        agent.written = max(agent.written, revision)
        for plan in plans:
            agent.running[plan.ref] = (plan, revision)

    async def record_end(self, agent: SimAgent, ref: TaskRef, succeed: bool) -> None:
        """``agent`` records the end of its attempt on ``ref`` (``agent/tasks/attempts.py``);
        it holds the claim, so the fenced write must go through."""
        plan, claim_revision = agent.running.pop(ref)
        attempt = ended(agent.name, plan, succeed)
        final = agent.view.final_state(ref, attempt.state, attempt.reason or "", RETRIES)
        written = await finish_attempt(
            self.etcd, self.ks, ref, claim_revision, plan.slot, attempt, final
        )
        assert written is not None, (
            f"{agent.name} holds its claim on {ref} (attempt {plan.attempt}), yet the "
            "finish transaction rejected its end"
        )
        agent.written = max(agent.written, written)
        self.failed_results |= final == "failed"

    @precondition(lambda self: self.claimable and bool(self.live()))
    @rule(data=st.data())
    @step
    def claim(self, data: st.DataObject) -> None:
        """A live agent claims what its mirror shows open: after a sync, unless ``stale``."""
        agent = self.pick(data, self.live())
        stale = data.draw(st.booleans(), label="stale")
        limit = data.draw(st.integers(1, SLOTS), label="limit")
        if not stale:
            agent.view = self.run(self.snapshot())
        self.run(self.claim_round(agent, limit))

    @precondition(lambda self: bool(self.live()))
    @rule(data=st.data())
    @step
    def renew(self, data: st.DataObject) -> None:
        """A live agent renews its lease; etcd keeps it."""
        agent = self.pick(data, self.live())
        assert agent.lease is not None
        ttl = self.run(self.etcd.keepalive_once(agent.lease))
        assert ttl > 0, f"{agent.name}'s lease is gone though nobody revoked it"

    @precondition(lambda self: any(a.running for a in self.live()))
    @rule(data=st.data())
    @step
    def finish(self, data: st.DataObject) -> None:
        """A live agent's attempt ends, succeeded or failed (a counted failure)."""
        agent = self.pick(data, [a for a in self.live() if a.running])
        ref = data.draw(st.sampled_from(sorted(agent.running)), label="task")
        self.run(self.record_end(agent, ref, data.draw(st.booleans(), label="succeeded")))

    @precondition(lambda self: any(a.running for a in self.live()))
    @rule(data=st.data())
    @step
    def revoke(self, data: st.DataObject) -> None:
        """An agent dies while it runs attempts: the leader revokes its lease. The
        attempts run on as zombies."""
        agent = self.pick(data, [a for a in self.live() if a.running])
        assert agent.lease is not None
        self.run(self.etcd.revoke(agent.lease))
        self.zombies += [
            Zombie(agent.name, agent.lease, plan, revision, agent.view)
            for plan, revision in agent.running.values()
        ]
        agent.lease, agent.running = None, {}

    @precondition(lambda self: any(a.lease is None for a in self.agents))
    @rule(data=st.data())
    @step
    def restart(self, data: st.DataObject) -> None:
        """A dead agent comes back: a new process, a new lease, its mirror loaded."""
        agent = self.pick(data, [a for a in self.agents if a.lease is None])
        agent.lease = self.run(self.etcd.grant(LEASE_TTL))
        agent.view, agent.written = self.run(self.snapshot()), 0

    @precondition(lambda self: bool(self.zombies))
    @rule(data=st.data())
    @step
    def late_finish(self, data: st.DataObject) -> None:
        """A zombie's attempt ends and it tries to record that, late: rejected."""
        zombie = self.zombies.pop(data.draw(st.integers(0, len(self.zombies) - 1), "zombie"))
        ref = zombie.plan.ref
        attempt = ended(zombie.node, zombie.plan, data.draw(st.booleans(), label="succeeded"))
        final = zombie.view.final_state(ref, attempt.state, attempt.reason or "", RETRIES)
        written = self.run(finish_attempt(
            self.etcd, self.ks, ref, zombie.claim_revision, zombie.plan.slot, attempt, final
        ))
        assert written is None, (
            f"{zombie.node}'s late end of {ref} attempt {zombie.plan.attempt} was recorded "
            "after its lease was revoked"
        )

    @precondition(lambda self: self.failed_results)
    @rule()
    @step
    def retry(self) -> None:
        """``hypermesh retry``: the failed tasks are reopened."""
        self.run(retry_failed(self.etcd, self.ks, self.wid))
        self.failed_results = False

    # ------------------------------------------------------------------ the invariants
    @invariant()
    def etcd_keeps_the_invariants(self) -> None:
        self.run(self.check())
        self.healthy = True

    async def at(self, key: str, revision: int) -> Any | None:
        """``key``'s key-value as it was at ``revision``; None if it did not exist then."""
        resp = await self.etcd.kv.get(key, revision=revision, timeout=self.etcd.timeout)
        return resp.kvs[0] if resp.kvs else None

    async def lease_gone(self, lease: int) -> bool:
        assert self.etcd.client.lease is not None
        resp = await self.etcd.client.lease.time_to_live(lease, timeout=self.etcd.timeout)
        return int(resp.TTL) <= 0

    async def check(self) -> None:
        ks = self.ks
        kvs, _ = await self.etcd.get_prefix(ks.root)
        view = MeshView(ks)
        for kv in kvs:
            view.apply(kv.key.decode(), kv.value, kv.create_revision, kv.mod_revision)
        kinds: dict[str, dict[str, Any]] = {}
        for kv in kvs:
            split = ks.split(kv.key.decode())
            if split is not None:
                kinds.setdefault(split[0], {})[kv.key.decode()] = kv
        claims, results = kinds.get("claim", {}), kinds.get("result", {})
        self.claimable = len(claims) < WORKERS and len(claims) + len(results) < TASKS
        self.one_success(view)
        await self.results_written_under_claims(results)
        await self.attempts_written_under_claims(kinds.get("attempt", {}))
        await self.claims_vanish_only_by_holder_or_lease(claims)
        self.slots_are_the_claims(claims, kinds.get("slot", {}))
        self.results_stay(results, view)
        self.retries_counted(view)
        self.seen_claims = {}
        for key, kv in claims.items():
            claim = json.loads(kv.value)
            self.seen_claims[key] = SeenClaim(
                kv.mod_revision, kv.lease, claim["node"], claim["attempt"]
            )
        self.seen_results = {
            key: (kv.mod_revision, json.loads(kv.value)) for key, kv in results.items()
        }

    def one_success(self, view: MeshView) -> None:
        """At most one attempt of a task succeeded, and a result is its attempt's end."""
        for ref in self.refs:
            attempts = view.attempts.get(ref, {})
            succeeded = [n for n, a in attempts.items() if a.state == "succeeded"]
            assert len(succeeded) <= 1, f"{ref} succeeded more than once: attempts {succeeded}"
            result = view.results.get(ref)
            if result is not None:
                record = attempts.get(result.attempt)
                assert record is not None and record.state == result.state, (
                    f"{ref}'s result {result} disagrees with its attempt record {record}"
                )

    async def results_written_under_claims(self, results: dict[str, Any]) -> None:
        """Each result was written, with its attempt record, by the one transaction that
        also released the claim that attempt held just before."""
        for key, kv in results.items():
            written = kv.mod_revision
            if (key, written) in self.checked:
                continue
            result = json.loads(kv.value)
            parts = self.ks.split(key)[1]  # type: ignore[index]
            ref = TaskRef(parts[0], parts[1], int(parts[2]))
            n = result["attempt"]
            held = await self.at(self.ks.claim(ref), written - 1)
            record = await self.at(self.ks.attempt(ref, n), written)
            assert held is not None and json.loads(held.value)["attempt"] == n, (
                f"{ref}'s result (attempt {n}, revision {written}) was written without that "
                f"attempt's claim: the claim just before was "
                f"{json.loads(held.value) if held else None}"
            )
            assert record is not None and record.mod_revision == written, (
                f"{ref}'s result at revision {written} came without its attempt record"
            )
            assert json.loads(record.value)["node"] == json.loads(held.value)["node"]
            assert await self.at(self.ks.claim(ref), written) is None, (
                f"{ref}'s claim outlived the result of its attempt {n}"
            )
            self.checked.add((key, written))

    async def attempts_written_under_claims(self, attempts: dict[str, Any]) -> None:
        """A running attempt record was written with its claim; an ended one by the
        finish of that claim's holder, or (``node-lost``) by the next attempt's claim."""
        for key, kv in attempts.items():
            written = kv.mod_revision
            if (key, written) in self.checked:
                continue
            record = json.loads(kv.value)
            parts = self.ks.split(key)[1]  # type: ignore[index]
            ref, n = TaskRef(parts[0], parts[1], int(parts[2])), int(parts[3])
            claim_key = self.ks.claim(ref)
            before, after = await self.at(claim_key, written - 1), await self.at(claim_key, written)
            held = json.loads(before.value) if before is not None else None
            now = json.loads(after.value) if after is not None else None
            new_claim = after is not None and after.create_revision == written
            if record["state"] == "running":
                ok = new_claim and now is not None and (now["attempt"], now["node"]) == (
                    n, record["node"]
                )
            elif held is not None and (held["attempt"], held["node"]) == (n, record["node"]):
                ok = after is None  # its holder's finish, which released the claim
            else:
                ok = (
                    record["reason"] == "node-lost"
                    and new_claim
                    and now is not None
                    and now["attempt"] == n + 1
                )
            assert ok, (
                f"{ref} attempt {n} record {record} (revision {written}) was written by no "
                f"holder of its claim: the claim was {held} just before and {now} after"
            )
            self.checked.add((key, written))

    async def claims_vanish_only_by_holder_or_lease(self, claims: dict[str, Any]) -> None:
        """A claim seen at the last check that is gone (or replaced) now was released by
        its holder's finish (the transaction that ended its attempt deleted it), or its
        lease ended. Nobody else removes a claim."""
        for key, seen in self.seen_claims.items():
            kv = claims.get(key)
            if kv is not None and kv.mod_revision == seen.mod_revision:
                continue
            if await self.lease_gone(seen.lease):
                continue
            parts = self.ks.split(key)[1]  # type: ignore[index]
            ref = TaskRef(parts[0], parts[1], int(parts[2]))
            record = await self.at(self.ks.attempt(ref, seen.attempt), 0)
            finished = record is not None and json.loads(record.value)["state"] != "running"
            if finished:
                ended_at = record.mod_revision
                before = await self.at(key, ended_at - 1)
                finished = (
                    json.loads(record.value)["node"] == seen.node
                    and before is not None
                    and before.mod_revision == seen.mod_revision
                    and await self.at(key, ended_at) is None
                )
            assert finished, (
                f"{seen.node}'s claim on {ref} (attempt {seen.attempt}) vanished while its "
                "lease lives, and no finish of that attempt removed it"
            )

    def slots_are_the_claims(self, claims: dict[str, Any], slots: dict[str, Any]) -> None:
        """Every slot key is the slot of a live claim on its lease, and the reverse."""
        held = {}
        for kv in claims.values():
            claim = json.loads(kv.value)
            if claim["slot"] is not None:
                key = self.ks.slot(self.wid, "e", claim["slot"])
                parts = self.ks.split(kv.key.decode())[1]  # type: ignore[index]
                held[key] = (kv.lease, TaskRef(parts[0], parts[1], int(parts[2])).id)
        taken = {key: (kv.lease, json.loads(kv.value)["task"]) for key, kv in slots.items()}
        assert taken == held, f"slot keys {taken} are not the claims' slots {held}"
        assert len(taken) <= WORKERS

    def results_stay(self, results: dict[str, Any], view: MeshView) -> None:
        """A result is never rewritten; only a failed one goes, reopened by ``retry``
        (its task then counts failures from after that attempt)."""
        for key, (revision, result) in self.seen_results.items():
            kv = results.get(key)
            if kv is not None and kv.mod_revision == revision:
                continue
            parts = self.ks.split(key)[1]  # type: ignore[index]
            ref = TaskRef(parts[0], parts[1], int(parts[2]))
            retry_from = int(view.tasks.get(ref, {}).get("retry_from", 0))
            assert result["state"] == "failed" and retry_from >= result["attempt"], (
                f"{ref}'s result {result} was removed or rewritten, not by a retry"
            )

    def retries_counted(self, view: MeshView) -> None:
        """Counted failures since the last retry reach ``retries + 1`` exactly when the
        task failed, and never go beyond."""
        for ref in self.refs:
            counted = view.counted_failures(ref)
            result = view.results.get(ref)
            failed = result is not None and result.state == "failed"
            assert counted <= RETRIES + 1, f"{ref} failed {counted} times, retries {RETRIES}"
            assert failed == (counted == RETRIES + 1), (
                f"{ref}: {counted} counted failures with retries {RETRIES}, result {result}"
            )

    # ------------------------------------------------------------------ the end
    async def stop_failing(self) -> None:
        """The agents stop failing: zombies have noticed their lease is gone, every agent
        lives, and each round each agent syncs, claims and succeeds what it claimed."""
        self.zombies.clear()
        for agent in self.agents:
            if agent.lease is None:
                agent.lease = await self.etcd.grant(LEASE_TTL)
                agent.written = 0
        for _ in range(ROUNDS):
            for agent in self.agents:
                agent.view = await self.snapshot()
                await self.claim_round(agent, SLOTS)
                for ref in sorted(agent.running):
                    await self.record_end(agent, ref, succeed=True)
            await self.check()
        view = await self.snapshot()
        undecided = [ref.id for ref in self.refs if ref not in view.results]
        assert not undecided, f"{undecided} still undecided after {ROUNDS} rounds"
        assert not view.claims, f"claims left after every task was decided: {view.claims}"

    async def close(self) -> None:
        for agent in self.agents:
            if agent.lease is not None:
                await self.etcd.revoke(agent.lease)
        root = self.ks.root
        await self.etcd.kv.delete(root, range_end=prefix_range_end(root))
        await self.etcd.close()

    def teardown(self) -> None:
        try:
            if self.healthy:
                self.run(self.stop_failing())
        finally:
            try:
                self.run(self.close())
            finally:
                # As asyncio.run ends: what the client left running is cancelled first.
                pending = asyncio.all_tasks(self.loop)
                for task in pending:
                    task.cancel()
                if pending:
                    self.run(asyncio.gather(*pending, return_exceptions=True))
                self.run(self.loop.shutdown_asyncgens())
                self.loop.close()


# Passing, the run takes about 20 s. Failing, Hypothesis shrinks the counterexample for up to
# 300 s (its own cap) before it reports it: the test's timeout leaves room for that.
@pytest.mark.timeout(480)
def test_claim_protocol_keeps_its_invariants(etcd_server: EtcdServer) -> None:
    ClaimProtocol.endpoint = etcd_server.url.split("//")[1]
    run_state_machine_as_test(ClaimProtocol, settings=SETTINGS)
