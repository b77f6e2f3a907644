"""Where a task's TensorBoard event files live, so that they outlive the node.

The agent sets ``HM_TENSORBOARD_DIR`` for every attempt (``agent/tasks/attempts.py``)
and ``hypermesh tensorboard`` (``hypermesh/cli/tensorboard.py``) reads the same places;
both take the paths from here, so neither can drift from the other:

- a task with ``data``: ``.out/tensorboard/<task id>`` in its first data mount, the
  mounts' shared writable area. A file closed there is stored in the object store as
  ``outputs/tensorboard/<task id>/...`` (``chunkfs/outputs.py``), as checkpoints are
  (``outputs/checkpoints/<task id>``): durable, and seen by every node;
- a task without ``data``: ``.hm-tensorboard/<task id>`` in the workflow's workdir (the
  recipe's folder unless the recipe says ``workdir``), the folder a gang keeps its
  checkpoints in without data. An agent with an object store copies what is there to
  the same ``outputs/tensorboard/<task id>/...`` at each attempt's end
  (``agent/tasks/logs.py``, ``copy_event_files``), so it outlives the node; and where the
  workdir is one shared file system (one machine, NFS), ``hypermesh tensorboard`` also
  reads the folder itself, which follows a running task.

Every attempt of a task writes to the same folder; a TensorBoard writer names each file
for its host, process and time, so a resumed attempt adds a file to the same run.
The folder is not made in advance (thousands of trivial tasks would leave thousands of
empty folders): a writer makes it (``SummaryWriter`` does), or ``mkdir -p``.
"""

from __future__ import annotations

from pathlib import Path

ENV = "HM_TENSORBOARD_DIR"
STORE_PREFIX = "outputs/tensorboard/"
"""Where the event files of every task are in the object store: then the task id."""
OUT_FOLDER = Path(".out") / "tensorboard"
"""The same place inside a data mount (``.out`` is stored under ``outputs/``)."""
WORKDIR_FOLDER = ".hm-tensorboard"
"""Where the event files of tasks without data are, in the workflow's workdir."""


def tensorboard_dir(mountpoint: str | None, workdir: str, task_id: str) -> str:
    """A task's ``HM_TENSORBOARD_DIR``: under its first data mount ``mountpoint`` when it
    has one, else under the workflow's ``workdir``."""
    if mountpoint:
        return str(Path(mountpoint) / OUT_FOLDER / task_id)
    return f"{workdir}/{WORKDIR_FOLDER}/{task_id}"


def store_prefix(task_id_prefix: str) -> str:
    """The object store prefix of the event files of tasks whose ids start with
    ``task_id_prefix`` (a task id, or ``WID.`` for a whole workflow)."""
    return STORE_PREFIX + task_id_prefix
