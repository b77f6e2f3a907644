"""One exception hierarchy for all of hypermesh.

Two axes matter to callers: whether retrying can help (``TransientError``) or
not (``FatalError``), and the coordination case that changes what a node may do
(``LeaseLost``; a lost claim shows as a fenced write that did not apply).
Translation to exit codes (CLI), gRPC status codes (agent) and errno (chunkfs)
happens only at those edges.
"""

from __future__ import annotations

from dataclasses import dataclass


class HypermeshError(Exception):
    """Base of every error hypermesh raises on purpose."""


class TransientError(HypermeshError):
    """A failure that may go away if the same operation is tried again later."""


class FatalError(HypermeshError):
    """A failure that retrying will not fix (bad input, missing object, bug)."""


class UsageError(FatalError):
    """The user asked for something that cannot be done; the message says why."""


class NotFound(FatalError):
    """A named object (workflow, task, node) does not exist."""


class StateConflict(FatalError):
    """The object exists but its state forbids the change (a workflow that ended...)."""


class EtcdUnavailable(TransientError):
    """No etcd endpoint answered in time."""


class EtcdAuthFailed(FatalError):
    """etcd refused the user and password (or the TLS handshake's client certificate)."""


class EtcdPermissionDenied(FatalError):
    """etcd authenticated the user but its roles do not allow the operation (a key
    outside the role's prefix, or maintenance that needs the root role)."""


class NoSuchObject(NotFound):
    """An object store has no object under the key asked for."""


class StoreUnavailable(TransientError):
    """The object store did not answer (refused, timed out) or answered 5xx/throttled."""


class CorruptData(FatalError):
    """Bytes read back do not match their content hash or recorded size."""


class LeaseLost(HypermeshError):
    """This node's etcd lease expired or was revoked; its claims are gone."""


class LeadershipLost(HypermeshError):
    """A leader-only write was fenced: this node's candidacy key (``elect/``) is gone or
    was put again since it stood, so another node may lead; it must stop acting as leader."""


@dataclass(frozen=True, order=True)
class Problem:
    """One problem found in a recipe, located as precisely as we can."""

    source: str
    line: int | None
    path: str
    message: str

    def __str__(self) -> str:
        where = f"{self.source}:{self.line}" if self.line else self.source
        return f"{where}: {self.path}: {self.message}" if self.path else f"{where}: {self.message}"


class RecipeError(UsageError):
    """A recipe was rejected; ``problems`` lists every problem found, in line order."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = sorted(problems, key=lambda p: (p.line or 0, p.path, p.message))
        super().__init__("\n".join(str(p) for p in self.problems))
