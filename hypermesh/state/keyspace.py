"""The etcd keyspace of one mesh.

Every key of a mesh lives under ``/hypermesh/<namespace>/`` so that several meshes
(and test runs) can share one etcd. Values are compact JSON. Keys of one workflow
share a prefix per kind so a workflow can be read or deleted with one range.

- ``node/<name>``: node registration; on the node's lease; by the node.
- ``elect/<lease hex>``: a leadership candidate (lowest create revision leads);
  on the node's lease.
- ``wf/<wid>``: workflow spec (the parsed recipe, seed, workdir); by ``submit``.
- ``wfstate/<wid>``: pending, running or a terminal state; by submit, the
  leader and ``cancel``.
- ``progress/<wid>``: the workflow's status summary as the leader last published
  it (``hypermesh status --json``'s object), at most every ``PROGRESS_S`` while it
  runs and with its final state; what ``submit --wait`` and ``status --watch``
  follow instead of every task's records. By the leader, fenced by the state key.
- ``expanded/<wid>/<exp>``: task count of an expanded experiment; by the leader.
- ``task/<wid>/<exp>/<index>``: the task's parameters; by the leader.
- ``claim/<wid>/<exp>/<index>``: node, attempt and slot of the running attempt;
  on the claiming node's lease.
- ``slot/<wid>/<exp>/<k>``: slot k of an experiment's ``workers`` cap; on the
  claiming node's lease.
- ``attempt/<wid>/<exp>/<index>/<n>``: attempt record; by the claiming node, fenced.
- ``result/<wid>/<exp>/<index>``: the task's one final outcome; fenced.
- ``metrics/<wid>/<exp>/<index>/<n>``: metrics attempt n reported (bounded, see
  ``hypermesh.state.task_metrics``); by the claiming node, fenced like the attempt record.
- ``block/<wid>/<exp>/<first>``: the parameters of tasks ``first``.. of a batched
  experiment (``hypermesh.state.blocks``), in one value; by the leader, instead of ``task/``.
- ``bclaim/<wid>/<exp>/<first>``: the node holding a block; on its lease. The key's
  create revision fences every batch the holder writes.
- ``bdone/<wid>/<exp>/<first>/<lease hex>-<seq>``: a batch of attempt records and
  results of one block's tasks; by its holder, fenced by the ``bclaim`` create revision.
- ``bcap/<wid>/<exp>/<k>``: slot k of the ``workers`` cap of an experiment in one-task
  blocks (a large mesh), naming the block that holds it; on the holder's lease, written
  and deleted with the block's claim (``hypermesh.state.block_txns``). Beside the other
  block kinds, so a node that watches its own part never receives it.
- ``gang/<wid>/<exp>/<index>/seat/<rank>``: a member's seat (rank) in the gang of a
  task of an experiment with ``nodes`` > 1; on the member's lease; by the member.
- ``gang/<wid>/<exp>/<index>/rdv``: the running gang attempt's rendezvous (attempt,
  master address and port, the seats it started with); on rank 0's lease.
- ``gang/<wid>/<exp>/<index>/end/<n>/<rank>``: how rank ``rank`` of attempt n ended;
  by that member, fenced by the attempt's claim (see ``hypermesh.state.gangs``).
- ``prunemed/<wid>/<exp>``: what the median pruner compares a trial of an experiment
  with pruning against: how many trials completed and, per step, the median of their
  intermediate values; by the leader, for the nodes that see no metrics.
- ``expctl/<wid>/<exp>``: live changes to a running experiment (cancelled, a new
  ``workers`` cap, samples added); by ``cancel --experiment``, ``scale`` and
  ``extend``, each guarded by the key's and the workflow state's revisions.
- ``offer/<node>``: the blocks the leader offers a node that chooses from offers, and the
  revision of the view it planned them from
  (``agent start --watch own``, ``agent/leader/offers.py``); by the leader. Such a node
  watches only :meth:`Keyspace.own_ranges`: none of the block kinds, no metrics, no other
  node's offer, no progress summary, and the workflow keys (``wf/``, ``wfstate/``,
  ``expanded/``, ``expctl/``, ``wfusage/``) only of the workflows it works on.
- ``pool/<name>``: a pool's declaration (``hypermesh/state/pools.py``); by ``pool set``.
- ``inst/<node>``: a node a provisioner started for the leader (pool, spot,
  provider id, when); by the leader, deleted when the node is released or lost.
- ``event/<ns time>-<node>``: one burst decision; by the leader, the last N kept.
- ``usage/<pool>``: node-seconds of a pool, spot and on-demand; by the leader.
- ``wfusage/<wid>``: node-seconds used by a workflow's tasks, per pool; by the leader.
- ``settings``: mesh-wide settings (``hypermesh/state/settings.py``: the task cap of a
  workflow, how long finished workflows are kept); by ``hypermesh settings``.
- ``watchall/<seat>``: one of the seats (``watch-all`` setting) of the nodes started with
  ``--watch auto`` that watch the whole namespace; on the holder's lease; by the holder
  (``hypermesh.state.settings.take_watch_seat``).
- ``compacted``: the revision the leader last compacted etcd to, when and by whom; by
  the leader's housekeeping, after each compaction (``agent/leader/housekeeping.py``).

One kind lives beside the namespace, not under it, so that the agents' watch of the
namespace never sees it (it changes with every cold chunk read):

- ``/hypermesh-fetching/<namespace>/<chunk>/<offset>-<length>``: the node fetching
  that segment of a chunk from the object store now; on a short lease of its own
  (``agent/share/duty.py``).
"""

from __future__ import annotations

import re
from typing import NamedTuple

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,62}")
# Node names may also hold dots (host names such as ip-10-0-0-1.ec2.internal).
NODE_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,252}")


class BlockRef(NamedTuple):
    """Names one block of a batched experiment: its tasks are ``first``, ``first+1``..."""

    workflow: str
    experiment: str
    first: int

    @property
    def path(self) -> str:
        return f"{self.workflow}/{self.experiment}/{self.first}"

    def task(self, offset: int) -> TaskRef:
        return TaskRef(self.workflow, self.experiment, self.first + offset)

    def __str__(self) -> str:
        return f"{self.workflow}.{self.experiment}[{self.first}..]"


class TaskRef(NamedTuple):
    """Names one task: workflow id, experiment name and index within the experiment.

    A named tuple rather than a dataclass: views hash and build refs tens of times per
    task, and a tuple's hash, equality and construction run in C."""

    workflow: str
    experiment: str
    index: int  # type: ignore[assignment]  # shadows tuple.index, on purpose

    @property
    def id(self) -> str:
        return f"{self.workflow}.{self.experiment}.{self.index}"

    @property
    def path(self) -> str:
        return f"{self.workflow}/{self.experiment}/{self.index}"

    @classmethod
    def parse(cls, task_id: str) -> TaskRef:
        """Parse ``WID.EXP.INDEX``; raises ValueError naming the expected form."""
        parts = task_id.rsplit(".", 2)
        if (
            len(parts) != 3
            or not (parts[2].isascii() and parts[2].isdigit() and len(parts[2]) <= 18)
            or not NAME_RE.fullmatch(parts[0])
            or not NAME_RE.fullmatch(parts[1])
        ):
            raise ValueError(f"not a task id: {task_id!r} (expected WORKFLOW.EXPERIMENT.INDEX)")
        return cls(parts[0], parts[1], int(parts[2]))

    def __str__(self) -> str:
        return self.id


class Keyspace:
    """Key names for one namespace. Pure string functions; no I/O."""

    def __init__(self, namespace: str) -> None:
        if not NAME_RE.fullmatch(namespace):
            raise ValueError(
                f"namespace {namespace!r} must be 1-63 letters, digits, '-' or '_', "
                "starting with a letter or digit"
            )
        self.namespace = namespace
        self.root = f"/hypermesh/{namespace}/"

    def fetching(self, chunk: str, offset: int, length: int) -> str:
        return f"/hypermesh-fetching/{self.namespace}/{chunk}/{offset}-{length}"

    # -- nodes and election
    def node(self, name: str) -> str:
        return f"{self.root}node/{name}"

    @property
    def nodes(self) -> str:
        return f"{self.root}node/"

    def candidate(self, lease_id: int) -> str:
        return f"{self.root}elect/{lease_id:016x}"

    @property
    def election(self) -> str:
        return f"{self.root}elect/"

    @property
    def settings(self) -> str:
        return f"{self.root}settings"

    @property
    def compacted(self) -> str:
        return f"{self.root}compacted"

    def watch_seat(self, seat: int) -> str:
        return f"{self.root}watchall/{seat:05d}"

    @property
    def watch_seats(self) -> str:
        return f"{self.root}watchall/"

    # -- workflows
    def workflow(self, wid: str) -> str:
        return f"{self.root}wf/{wid}"

    def workflow_state(self, wid: str) -> str:
        return f"{self.root}wfstate/{wid}"

    def progress(self, wid: str) -> str:
        return f"{self.root}progress/{wid}"

    def expanded(self, wid: str, experiment: str) -> str:
        return f"{self.root}expanded/{wid}/{experiment}"

    # -- tasks
    def task(self, ref: TaskRef) -> str:
        return f"{self.root}task/{ref.path}"

    def claim(self, ref: TaskRef) -> str:
        return f"{self.root}claim/{ref.path}"

    def attempt(self, ref: TaskRef, n: int) -> str:
        return f"{self.root}attempt/{ref.path}/{n}"

    def result(self, ref: TaskRef) -> str:
        return f"{self.root}result/{ref.path}"

    def metrics(self, ref: TaskRef, n: int) -> str:
        return f"{self.root}metrics/{ref.path}/{n}"

    def prune_medians(self, wid: str, experiment: str) -> str:
        return f"{self.root}prunemed/{wid}/{experiment}"

    def gang_seat(self, ref: TaskRef, rank: int) -> str:
        return f"{self.root}gang/{ref.path}/seat/{rank}"

    def gang_rendezvous(self, ref: TaskRef) -> str:
        return f"{self.root}gang/{ref.path}/rdv"

    def gang_end(self, ref: TaskRef, attempt: int, rank: int) -> str:
        return f"{self.root}gang/{ref.path}/end/{attempt}/{rank}"

    def block(self, ref: BlockRef) -> str:
        return f"{self.root}block/{ref.path}"

    def block_claim(self, ref: BlockRef) -> str:
        return f"{self.root}bclaim/{ref.path}"

    def block_batches(self, ref: BlockRef) -> str:
        return f"{self.root}bdone/{ref.path}/"

    def block_batch(self, ref: BlockRef, lease: int, seq: int) -> str:
        return f"{self.root}bdone/{ref.path}/{lease:016x}-{seq:010d}"

    def block_slot(self, wid: str, experiment: str, k: int) -> str:
        return f"{self.root}bcap/{wid}/{experiment}/{k}"

    def experiment_control(self, wid: str, experiment: str) -> str:
        return f"{self.root}expctl/{wid}/{experiment}"

    def slot(self, wid: str, experiment: str, k: int) -> str:
        return f"{self.root}slot/{wid}/{experiment}/{k}"

    def offer(self, node: str) -> str:
        return f"{self.root}offer/{node}"

    def own_ranges(self, node: str) -> list[tuple[str, str]]:
        """The key ranges ``[start, end)`` a node that chooses blocks from its offers
        watches: the namespace but the four block kinds (which sort together, from
        ``bcap/`` to ``block/``), the metrics attempts report (up to one write a second
        per attempt; the leader and the nodes that watch everything see them), the other
        nodes' offers, the progress summaries (for the CLI; the leader writes them every
        second), the pruning medians (``prunemed/``, which a pruning check here reads on
        demand), and every workflow's own keys (``wf/``, ``wfstate/``, ``expanded/``,
        ``expctl/``, ``wfusage/``): such a node follows those of the workflows it works
        on (:meth:`workflow_ranges`, ``hypermesh.etcd_watch.Following``), from when its
        offer or a task key names them. What a task of a block costs such a node is then
        its own claim and flushes, and a workflow costs only the nodes it runs on,
        whatever the mesh's size."""
        r, mine = self.root, self.offer(node)
        holes = [(f"{r}{kind}/", f"{r}{kind}0")  # "0" follows "/": "x0" ends the prefix "x/"
                 for kind in ("expanded", "expctl", "metrics", "offer", "progress", "prunemed",
                              "wf", "wfstate", "wfusage")]
        holes.append((f"{r}bcap/", f"{r}block0"))
        ranges, start = [], r
        for hole_start, hole_end in sorted(holes):
            ranges.append((start, hole_start))
            start = hole_end
        ranges.append((start, r[:-1] + "0"))
        return sorted([*ranges, (mine, mine + "\0")])  # "k\0" ends the key "k" alone

    def workflow_ranges(self, wid: str) -> list[tuple[str, str]]:
        """The ranges of the workflow keys that :meth:`own_ranges` leaves out and a node
        working on the workflow follows: its record first (the anchor: the workflow
        exists while it does), then its state and its experiments' expansions and live
        changes (not its usage, which only the leader and the dashboard read)."""
        exact = [self.workflow(wid), self.workflow_state(wid)]
        prefixes = [self.kind_prefix(kind, wid) for kind in ("expanded", "expctl")]
        return ([(key, key + "\0") for key in exact]
                + [(p, p[:-1] + "0") for p in prefixes])

    # -- bursting: pools, provisioned nodes, decisions, usage
    def pool(self, name: str) -> str:
        return f"{self.root}pool/{name}"

    def instance(self, node: str) -> str:
        return f"{self.root}inst/{node}"

    def event(self, at_ns: int, node: str) -> str:
        return f"{self.root}event/{at_ns:020d}-{node}"

    def usage(self, pool: str) -> str:
        return f"{self.root}usage/{pool}"

    def workflow_usage(self, wid: str) -> str:
        return f"{self.root}wfusage/{wid}"

    def kind_prefix(self, kind: str, wid: str | None = None) -> str:
        """Prefix of all keys of one kind (``task``, ``claim``...), optionally of one workflow."""
        return f"{self.root}{kind}/" + (f"{wid}/" if wid else "")

    def workflow_prefixes(self, wid: str) -> list[str]:
        """Every prefix (ending in ``/``) and exact key holding keys of workflow ``wid``
        (for reading or deleting it: ``hypermesh/state/cleanup.py`` deletes them all)."""
        kinds = ("task", "claim", "attempt", "result", "slot", "expanded", "expctl", "metrics",
                 "gang", "block", "bclaim", "bdone", "bcap", "prunemed")
        exact = [self.workflow(wid), self.workflow_state(wid), self.progress(wid),
                 self.workflow_usage(wid)]
        return exact + [
            self.kind_prefix(k, wid) for k in kinds
        ]

    def split(self, key: str) -> tuple[str, list[str]] | None:
        """Split a key of this namespace into (kind, parts); None for foreign keys."""
        if not key.startswith(self.root):
            return None
        kind, _, rest = key[len(self.root) :].partition("/")
        return kind, rest.split("/") if rest else []
