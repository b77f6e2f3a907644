"""``hypermesh delete``: remove finished workflows and every key they have; and the
warning ``status`` and ``nodes`` give when etcd's database nears its quota.

The deletion itself is ``hypermesh/state/cleanup.py``; the leader deletes workflows
past their retention the same way (``agent/leader/housekeeping.py``).
"""

from __future__ import annotations

import logging
from typing import Any

import click

from hypermesh.cli.common import Mesh, err, mesh_options, print_json, run_async
from hypermesh.errors import HypermeshError
from hypermesh.state.etcd import Etcd

log = logging.getLogger(__name__)


@click.command()
@click.argument("workflows", nargs=-1, required=True, metavar="WORKFLOW...")
@click.option("--force", is_flag=True,
              help="Also a pending or running workflow: cancel it, then delete it.")
@click.option("--drain", "drain_s", type=click.FloatRange(0, 3600), default=30.0,
              show_default=True,
              help="With --force: seconds to let running tasks stop before deleting.")
@click.option("--json", "as_json", is_flag=True,
              help='Print [{"workflow", "state", "keys"}], one per workflow deleted.')
@mesh_options
@run_async
async def delete(
    mesh: Mesh, workflows: tuple[str, ...], force: bool, drain_s: float, as_json: bool
) -> None:
    """Delete finished workflows: their records, tasks, attempts, results and metrics.

    A pending or running workflow is refused (exit 2) unless --force, which cancels
    it (its running tasks are stopped) and then deletes it. Every workflow named is
    checked before any is deleted: an unknown one (exit 1) or one that has not ended
    deletes nothing.
    """
    from hypermesh.state.cleanup import check_deletable, delete_workflow

    done = []
    async with mesh.connect() as etcd:
        for wid in dict.fromkeys(workflows):
            await check_deletable(etcd, mesh.ks, wid, force)
        for wid in dict.fromkeys(workflows):
            deleted = await delete_workflow(etcd, mesh.ks, wid, force=force, drain_s=drain_s)
            done.append(deleted)
            if not as_json:
                what = f"was {deleted.state}" if deleted.state else "leftovers of a deletion"
                err(f"deleted {wid} ({what}): {deleted.keys} keys")
    if as_json:
        print_json([d.to_json() for d in done])


async def quota_warning_of(etcd: Etcd) -> str | None:
    """The warning for an etcd database near its quota (``hypermesh/state/etcd_size.py``),
    or None; never fails the command that asks (a warning it cannot get is no warning)."""
    from hypermesh.state.etcd_size import db_size, quota_warning

    try:
        return quota_warning(await db_size(etcd))
    except HypermeshError as exc:
        log.debug("etcd size: %s", exc)
        return None


def note_quota(warning: str | None, rows: list[dict[str, Any]], as_json: bool) -> None:
    """Tell of ``warning``: on stderr, or with ``--json`` as ``etcd_warning`` in each
    object ``rows`` prints."""
    if warning is None:
        return
    if as_json:
        for row in rows:
            row["etcd_warning"] = warning
    else:
        err(f"warning: {warning}")
