"""The ``hypermesh`` command line: the stable contract users' scripts drive.

Exit codes: 0 success; 1 a failure at run time (a workflow failed, etcd did not
answer, an object does not exist); 2 bad input (a usage error or an invalid
recipe — nothing was submitted). Machine-readable output (``--json``, the
workflow id of ``submit``) goes to stdout; progress and errors to stderr.

This module holds the ``hypermesh`` group and registers the commands, which live in
one module per concern:

- ``agent.py``: ``agent start``, the agent on this machine;
- ``workflows.py``: ``submit``, ``status``, ``tasks``, ``logs``, ``cancel``;
- ``validate.py``: ``validate``, recipes checked (and their tasks counted) without submitting;
- ``ops.py``: ``retry``, ``scale``, ``extend``, which change a running workflow;
- ``ml.py``: ``best``, a workflow's best trials with their curves;
- ``compare.py``: ``compare``, the experiments of several workflows side by side;
- ``notebook.py``: ``notebook``, JupyterLab as a task next to the data;
- ``tensorboard.py``: ``tensorboard``, a workflow's event files served by TensorBoard;
- ``nodes.py`` and ``top.py``: the live nodes, and what each uses;
- ``burst.py``: ``pool`` and ``events``, the pools and the leader's burst decisions;
- ``data.py``: ``data`` (data sets in an object store) and ``mount``;
- ``settings.py``: ``settings``, the mesh-wide settings (task cap, retention);
- ``tls.py``: ``tls init`` and ``tls issue``, the mesh's CA and certificates;
- ``cleanup.py``: ``delete``, finished workflows and all their keys.

What they share (the mesh options, running a command, exit codes, printing) is in
``common.py``. The command modules import ``common.py``, never this module.
"""

from __future__ import annotations

import logging

import click

from hypermesh.cli.agent import agent
from hypermesh.cli.burst import events, pool
from hypermesh.cli.cleanup import delete
from hypermesh.cli.compare import compare
from hypermesh.cli.data import data, mount
from hypermesh.cli.ml import best
from hypermesh.cli.nodes import nodes
from hypermesh.cli.notebook import notebook
from hypermesh.cli.ops import OPS_COMMANDS
from hypermesh.cli.settings import settings
from hypermesh.cli.tensorboard import tensorboard
from hypermesh.cli.tls import tls
from hypermesh.cli.top import top
from hypermesh.cli.validate import validate
from hypermesh.cli.workflows import cancel, logs, status, submit, tasks


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--etcd", default=None, metavar="URL[,URL...]", help="etcd endpoints.")
@click.option("--namespace", default=None, metavar="NAME", help="Mesh namespace in etcd.")
@click.option("-v", "--verbose", count=True, help="More log output on stderr.")
@click.version_option(package_name="hypermesh")
def main(etcd: str | None, namespace: str | None, verbose: int) -> None:
    """Run batch deep-learning work on a mesh of on-prem and spot machines."""
    level = logging.WARNING - 10 * verbose
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


# `hypermesh --help` lists the commands in name order, whatever the order here.
for _command in (
    agent, submit, status, tasks, nodes, logs, cancel, best, compare, data, pool, events, mount,
    top, settings, tls, validate, *OPS_COMMANDS,
):
    main.add_command(_command)
main.add_command(delete)
main.add_command(tensorboard)
main.add_command(notebook)

if __name__ == "__main__":
    main()
