"""The etcd edge: connecting, transactions, mirroring a prefix, keeping a lease.

Everything that talks to etcd goes through here, so errors from the client
library are translated once into ``hypermesh.errors`` types.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from etcd3aio import Etcd3Client, EtcdError
from etcd3aio.kv import KVService, prefix_range_end

from hypermesh.config import SMALL_MESSAGE_GRPC_OPTIONS
from hypermesh.errors import (
    EtcdAuthFailed,
    EtcdPermissionDenied,
    EtcdUnavailable,
    LeaseLost,
)
from hypermesh.etcd_endpoints import first_answer, resolve
from hypermesh.etcd_security import (
    PLAINTEXT,
    EtcdSecurity,
    auth_refusal,
    rpc_details,
    tls_hint,
)
from hypermesh.etcd_watch import (
    Following,
    RangeWatch,
    WatchCompacted,
    WatchEnded,
    hush_broken_stream_noise,
)

log = logging.getLogger(__name__)

# One etcd transaction may hold at most this many operations (etcd's --max-txn-ops
# default is 128; stay below it).
MAX_TXN_OPS = 120

PAGE_BYTES = 1 << 20
"""Bytes of keys and values one page of a range read aims at: a quarter of the 4 MiB a
gRPC client accepts in one message by default."""

FIRST_PAGE_KEYS = 256
"""Keys asked for in a range read's first page, before any size is known."""

MAX_PAGE_KEYS = 10_000
"""Most keys asked for in one page, however small the values."""

TIDY_EVERY = 256
"""Keys a mirror's load applies between two calls of its ``tidy`` hook."""


def _cancelled(exc: BaseException) -> bool:
    """Whether an error is really our own cancellation in disguise: grpc.aio reports a
    call cancelled under a cancelled task as an RPC error with status CANCELLED.
    Swallowing it would keep a stopping agent alive forever."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        return True
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.CANCELLED


# gRPC status codes that mean no endpoint answered (the others are etcd's own answers).
_UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.UNKNOWN)


def _first_line(text: str | None) -> str:
    return (text or "").strip().splitlines()[0] if (text or "").strip() else ""


@dataclass(frozen=True)
class TxnResult:
    succeeded: bool
    revision: int
    responses: Any


class Etcd:
    """A connected etcd client with the few operations hypermesh needs.

    ``security`` (``hypermesh/etcd_security.py``): with a CA the channel is TLS, checked
    against the first endpoint's host name (every member's certificate must carry it);
    with a user, the client authenticates at ``connect`` and again, once, whenever etcd
    answers that its token expired (simple tokens lapse after ``--auth-token-ttl``
    unused, JWTs at their expiry) or that the auth store changed since, in every call,
    watch and lease keep-alive. Only ``_authenticate`` changes the token."""

    def __init__(
        self, endpoints: Sequence[str], *, timeout: float = 5.0,
        security: EtcdSecurity = PLAINTEXT,
    ) -> None:
        self.endpoints = list(endpoints)
        self.timeout = timeout
        self.security = security
        self._token_gen = 0  # raised by every authentication
        self._auth_lock = asyncio.Lock()
        server_name = None
        if security.tls and self.endpoints:
            server_name = self.endpoints[0].rpartition(":")[0].strip("[]")
        tls = security.conn_args()
        self.client = Etcd3Client(
            self.endpoints, rpc_max_attempts=5, tls_server_name=server_name,
            ca_cert=tls.get("ca_cert"), cert_chain=tls.get("cert_chain"),
            cert_key=tls.get("cert_key"))
        # etcd3aio takes no channel options; its connection manager's list is read
        # when connect() opens the channel. Without the attribute (another etcd3aio
        # version) the channel keeps gRPC's defaults, which only costs idle CPU.
        options = getattr(getattr(self.client, "_manager", None), "grpc_options", None)
        if isinstance(options, list):
            options.extend(SMALL_MESSAGE_GRPC_OPTIONS)

    async def __aenter__(self) -> Etcd:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def connect(self) -> None:
        """Open the channel. etcd3aio dials its endpoints as IPv4 addresses only (an
        ``ipv4:`` target), so host names are resolved here first; one that does not
        resolve raises ``EtcdUnavailable`` naming it."""
        addresses = [await resolve(endpoint) for endpoint in self.endpoints]
        manager = getattr(self.client, "_manager", None)
        if addresses != self.endpoints and isinstance(getattr(manager, "target", None), str):
            manager.target = "ipv4:" + ",".join(addresses)  # type: ignore[union-attr]
        await self.client.connect()
        if self.security.user:
            if warning := self.security.cleartext_warning(self.endpoints):
                log.warning(warning)
            await self._authenticate()

    async def close(self) -> None:
        await self.client.close()

    # ------------------------------------------------------------------ auth
    async def _authenticate(self, stale: int | None = None) -> None:
        """Get a token for the user and use it from now on. ``stale``: the token
        generation a failed call used; if another caller renewed it since, nothing to do.
        Wrong credentials raise ``EtcdAuthFailed``."""
        user, password = self.security.user, self.security.password
        if not user:
            return
        async with self._auth_lock:
            if stale is not None and stale != self._token_gen:
                return
            assert self.client.auth is not None, "not connected"
            try:
                resp = await self.client.auth.authenticate(user, password or "",
                                                           timeout=self.timeout)
            except (grpc.aio.AioRpcError, EtcdError, TimeoutError) as exc:
                if auth_refusal(exc) is None:
                    raise self._translate("authenticate", exc) from exc
                detail = rpc_details(exc).removeprefix("etcdserver: ")
                raise EtcdAuthFailed(
                    f"etcd authentication failed for user {user!r} at "
                    f"{','.join(self.endpoints)}: {detail}"
                ) from None
            self.client.set_token(resp.token)
            self._token_gen += 1
            if stale is not None:
                log.info("etcd: authenticated again as %s (the token had expired)", user)

    def _token_expired(self, exc: BaseException) -> bool:
        """Whether ``exc`` says our token is no longer good (expired, or issued before
        the auth store changed): authenticating again may help."""
        if not self.security.user:
            return False
        rpc = exc if isinstance(exc, grpc.aio.AioRpcError) else exc.__cause__
        if not isinstance(rpc, grpc.aio.AioRpcError):
            return False
        details = rpc.details() or ""
        return rpc.code() == grpc.StatusCode.UNAUTHENTICATED or (
            "auth store is old" in details or "invalid auth token" in details
        )

    def _metadata(self) -> tuple[tuple[str, str], ...] | None:
        """The gRPC metadata that carries the token, for streams opened on the stub."""
        lease = self.client.lease
        return getattr(lease, "_metadata", None) or None

    async def _authed(self, make: Callable[[], Awaitable[Any]]) -> Any:
        """``await make()``; made once more after authenticating again if etcd said the
        token expired. Other errors pass through untranslated."""
        generation = self._token_gen
        try:
            return await make()
        except (grpc.aio.AioRpcError, EtcdError) as exc:
            if not self._token_expired(exc):
                raise
        await self._authenticate(stale=generation)
        return await make()

    @property
    def kv(self) -> KVService:
        assert self.client.kv is not None, "not connected"
        return self.client.kv

    async def _call(self, what: str, make: Callable[[], Awaitable[Any]]) -> Any:
        try:
            return await self._authed(make)
        except (grpc.aio.AioRpcError, EtcdError, TimeoutError) as exc:
            raise self._translate(what, exc) from exc

    def _translate(self, what: str, exc: BaseException) -> BaseException:
        """The ``hypermesh.errors`` exception (or cancellation) an error from the
        client library stands for."""
        if isinstance(exc, grpc.aio.AioRpcError):
            if _cancelled(exc):
                return asyncio.CancelledError()
            if exc.code() == grpc.StatusCode.NOT_FOUND and "lease not found" in (
                exc.details() or ""
            ):
                return LeaseLost(f"etcd {what}: the lease is gone")
        at = ",".join(self.endpoints)
        refused = auth_refusal(exc)
        if refused is not None:
            user = self.security.user
            who = f"user {user!r}" if user else (
                "the client certificate's user" if self.security.cert else "no user")
            if refused == grpc.StatusCode.UNAUTHENTICATED:
                return EtcdAuthFailed(f"etcd authentication failed at {at} ({who}): "
                                      f"{_first_line(rpc_details(exc))}")
            return EtcdPermissionDenied(
                f"etcd {what} at {at}: permission denied for {who}"
                + ("" if user or self.security.cert else
                   " (etcd has auth enabled: give --etcd-user, or a client certificate)"))
        if isinstance(exc, grpc.aio.AioRpcError) and exc.code() not in _UNREACHABLE:
            return EtcdUnavailable(f"etcd {what} failed at {at}: {exc.code().name}: "
                                   f"{_first_line(exc.details())}")
        return EtcdUnavailable(f"cannot reach etcd at {at}: {self._unreachable_reason(exc)}")

    def _unreachable_reason(self, exc: BaseException) -> str:
        """One line on why no endpoint answered (never gRPC's multi-line repr)."""
        if isinstance(exc, TimeoutError) or (
            isinstance(exc, grpc.aio.AioRpcError)
            and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        ):
            return f"no answer within {self.timeout:g} s"
        text = str(exc)
        if isinstance(exc, grpc.aio.AioRpcError):
            text = exc.details() or exc.code().name
        if "Connection refused" in text:
            return "connection refused"
        return tls_hint(_first_line(text), self.security.tls) or type(exc).__name__

    async def get(self, key: str) -> tuple[bytes, int] | None:
        resp = await self._call("get", functools.partial(self.kv.get, key, timeout=self.timeout))
        if not resp.kvs:
            return None
        return resp.kvs[0].value, resp.kvs[0].mod_revision

    async def get_prefix(self, prefix: str, revision: int = 0, ranges: Sequence[
            tuple[str | None, str | None]] = ((None, None),)) -> tuple[list[Any], int]:
        """The key-values under ``prefix`` (in ``ranges``, each ``[start, end)``) as of
        ``revision`` (or now) and the revision read at, in pages (``pages``)."""
        kvs: list[Any] = []
        read_at = revision
        for start, end in ranges:
            async for page, read_at in self.pages(prefix, read_at, start=start, end=end):  # noqa: B007,B020
                kvs += page
        return kvs, read_at

    async def get_ranges(self, ranges: Sequence[tuple[str, str]]) -> tuple[list[Any], int]:
        """The key-values in a few small ``[start, end)`` ranges, read in one transaction
        (one revision, one round trip, no paging), and the revision read at."""
        reads = [KVService.txn_op_get(a.encode(), range_end=b.encode()) for a, b in ranges]
        resp = await self._call("range", functools.partial(
            self.kv.txn, [], reads, [], timeout=self.timeout))
        return ([kv for r in resp.responses for kv in r.response_range.kvs],
                int(resp.header.revision))

    async def pages(
        self, prefix: str, revision: int = 0, *, start: str | None = None,
        end: str | None = None, most: int = MAX_PAGE_KEYS,
    ) -> AsyncIterator[tuple[list[Any], int]]:
        """The key-values under ``prefix`` (from ``start``, before ``end``, when given)
        in key order, one page at a time (of ``most`` keys at most), every page read at
        the same revision (``revision``, or that of the first page), with it.

        A page holds about ``PAGE_BYTES`` (its key count follows the sizes seen so
        far, from ``FIRST_PAGE_KEYS``); one refused as too large is asked for again at
        half the keys. The first page is yielded even when empty (for its revision)."""
        key = (start or prefix).encode()
        stop = end.encode() if end is not None else prefix_range_end(prefix)
        limit = min(most, FIRST_PAGE_KEYS)
        while True:
            try:
                resp = await self._authed(functools.partial(
                    self.kv.get, key, range_end=stop, revision=revision, limit=limit,
                    timeout=self.timeout))
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and limit > 1:
                    limit //= 2
                    continue
                raise self._translate("range", exc) from exc
            except (EtcdError, TimeoutError) as exc:
                raise self._translate("range", exc) from exc
            revision = revision or resp.header.revision
            page = list(resp.kvs)
            yield page, revision
            if not resp.more or not page:
                return
            key = page[-1].key + b"\0"
            size = sum(len(kv.key) + len(kv.value) for kv in page)
            limit = max(1, min(most, limit * PAGE_BYTES // max(1, size)))

    async def put(self, key: str, value: bytes, lease: int = 0) -> int:
        resp = await self._call("put", functools.partial(
            self.kv.put, key, value, lease=lease, timeout=self.timeout))
        return int(resp.header.revision)

    async def txn(
        self, compare: list[Any], success: list[Any], failure: Sequence[Any] = ()
    ) -> TxnResult:
        """Run one transaction, retried while etcd is unreachable.

        A transaction is not idempotent: an attempt whose answer was lost (the
        member died after committing it) fails its compares when tried again. So a
        retry also reads back what ``success`` writes, and if that is exactly there
        (each put's value and lease, each deleted key gone, the puts at one
        revision) the earlier attempt committed: the result says so, with that
        revision and no responses.
        """
        failure = list(failure)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        backoff = TXN_RETRY_BACKOFF_S
        retried = False
        fail_ops = failure
        while True:
            try:
                # refused for an expired token, a transaction did nothing: _authed
                # makes it once more with a new one
                resp = await self._authed(functools.partial(
                    self.kv.txn, compare, success, fail_ops,
                    timeout=max(deadline - loop.time(), 0.05), max_attempts=1,
                ))
            except (grpc.aio.AioRpcError, EtcdError, TimeoutError) as exc:
                if _cancelled(exc) or _cancelled(exc.__cause__ or exc):
                    raise asyncio.CancelledError from exc
                if not _transient(exc) or loop.time() + backoff >= deadline:
                    raise self._translate("txn", exc) from exc
                log.info("txn: %s; retrying in %.2fs", exc, backoff)
                await asyncio.sleep(backoff)
                backoff *= 2
                if not retried:
                    retried = True
                    fail_ops = failure + _effect_reads(success)
                continue
            if resp.succeeded or not retried:
                return TxnResult(bool(resp.succeeded), int(resp.header.revision), resp.responses)
            committed = _committed_at(success, resp.responses[len(failure):])
            if committed is not None:
                log.info("txn: an earlier attempt committed at revision %d", committed)
                return TxnResult(True, committed or int(resp.header.revision), [])
            return TxnResult(False, int(resp.header.revision), resp.responses[: len(failure)])

    # Builders, re-exported so callers need not know the client library.
    @staticmethod
    def absent(key: str) -> Any:
        return KVService.txn_compare_create_revision(key, 0)

    @staticmethod
    def created_at(key: str, revision: int) -> Any:
        """The key exists and was created at ``revision`` (not deleted and put since)."""
        return KVService.txn_compare_create_revision(key, revision)

    @staticmethod
    def mod_revision_is(key: str, revision: int) -> Any:
        from etcd3aio._protobuf import Compare

        return Compare(
            result=Compare.EQUAL, target=Compare.MOD, key=key.encode(), mod_revision=revision
        )

    @staticmethod
    def none_created_since(prefix: str, revision: int) -> Any:
        """Every key under ``prefix`` already existed at ``revision`` (also: no key at all)."""
        from etcd3aio._protobuf import Compare

        return Compare(
            result=Compare.LESS,
            target=Compare.CREATE,
            key=prefix.encode(),
            range_end=prefix_range_end(prefix),
            create_revision=revision + 1,
        )

    @staticmethod
    def value_is(key: str, value: bytes) -> Any:
        return KVService.txn_compare_value(key, value)

    @staticmethod
    def op_put(key: str, value: bytes, lease: int = 0) -> Any:
        return KVService.txn_op_put(key, value, lease=lease)

    @staticmethod
    def op_delete(key: str) -> Any:
        return KVService.txn_op_delete(key)

    # ------------------------------------------------------------------ leases
    async def grant(self, ttl: int) -> int:
        assert self.client.lease is not None
        resp = await self._call("lease grant", functools.partial(
            self.client.lease.grant, ttl, timeout=self.timeout))
        return int(resp.ID)

    async def revoke(self, lease: int) -> None:
        """Revoke ``lease``, best effort: a lease that is already gone is the goal
        reached, and an unreachable etcd will expire it by itself."""
        assert self.client.lease is not None
        with contextlib.suppress(EtcdUnavailable, LeaseLost):
            await self._call("lease revoke", functools.partial(
                self.client.lease.revoke, lease, timeout=self.timeout))

    async def keepalive_once(self, lease: int) -> int:
        """Renew ``lease`` once; returns the TTL etcd granted (<= 0: the lease is gone)."""
        assert self.client.lease is not None
        stream = self.client.lease.keep_alive(lease)
        try:
            async with asyncio.timeout(self.timeout):
                async for response in stream:
                    return int(response.TTL)
        except (grpc.aio.AioRpcError, TimeoutError) as exc:
            if _cancelled(exc):
                raise asyncio.CancelledError from exc
            raise EtcdUnavailable(f"lease keepalive failed: {exc}") from exc
        finally:
            stream.cancel()
        raise EtcdUnavailable("lease keepalive stream closed without an answer")

    async def keep_lease(
        self,
        lease: int,
        ttl: int,
        on_lost: Callable[[], None],
        on_renewed: Callable[[float], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        give_up_after: float | None = None,
    ) -> None:
        """Renew ``lease`` every ttl/3 s over one long-lived keep-alive stream (a stream
        per renewal costs an idle agent measurable CPU); call ``on_lost`` and return once
        etcd says it is gone, or no renewal sent in the last ``give_up_after`` s (default
        the TTL) was answered. A renewal counts from when it was sent, so a lease given
        up at ``give_up_after < ttl`` is given up before etcd can have expired it.
        ``on_renewed(when)`` is told the send time of each renewal answered. A try waits
        a third of the interval at most; after a failed one, the next opens a stream per
        endpoint and keeps the first to answer: round robin spreads them over the members,
        so a silent one (its host cut off, connections still up) cannot take every retry."""
        from etcd3aio._protobuf import LeaseKeepAliveRequest

        assert self.client.lease is not None
        interval = keepalive_interval(ttl)
        give_up = ttl if give_up_after is None else give_up_after
        last_ok = sent = clock()
        request = LeaseKeepAliveRequest(ID=lease)
        hedge = 1  # streams the next try opens: one per endpoint after a failed try
        while True:
            # etcd3aio has no persistent keep-alive stream: its stub (hence the pinned
            # version). Requests are written, not drawn from an async generator, which
            # grpc.aio logs errors for when the connection breaks while it sleeps.
            generation = self._token_gen
            streams = [self.client.lease._stub.LeaseKeepAlive(metadata=self._metadata())
                       for _ in range(hedge)]
            stream = streams[0]
            try:
                while True:
                    sent = clock()
                    wait = min(self.timeout, max(0.5, interval / 3),
                               max(0.05, last_ok + give_up - sent))
                    if len(streams) > 1:  # rare: tasks are fine here
                        stream, answer = await first_answer(streams, request, wait)
                        streams = [stream]
                    else:  # asyncio.timeout, not wait_for: no task per renewal (3.11)
                        async with asyncio.timeout(wait):
                            await stream.write(request)
                            answer = await stream.read()
                    if answer is grpc.aio.EOF:
                        break
                    if answer.TTL <= 0:
                        on_lost()
                        return
                    last_ok = sent
                    if on_renewed is not None:
                        on_renewed(last_ok)
                    await asyncio.sleep(interval)
            except (grpc.aio.AioRpcError, TimeoutError, asyncio.InvalidStateError) as exc:
                if _cancelled(exc):
                    raise asyncio.CancelledError from exc
                log.warning("lease %x keep-alive: %s", lease,
                            exc if str(exc) else f"no answer within {wait:.1f}s")
                if self._token_expired(exc):
                    with contextlib.suppress(EtcdUnavailable, EtcdAuthFailed):
                        await self._authenticate(stale=generation)
            finally:
                for opened in streams:
                    opened.cancel()
            if clock() - last_ok >= give_up:
                on_lost()
                return
            hedge = len(self.endpoints)
            # tries start at least 0.5 s apart (one that timed out has waited already)
            await asyncio.sleep(min(interval, 0.5 - (clock() - sent),
                                    last_ok + give_up - clock()))

    # ------------------------------------------------------------------ upkeep
    async def keys(self, prefix: str, limit: int, start: str | None = None) -> list[bytes]:
        """The first ``limit`` keys under ``prefix`` (from ``start``), without values."""
        resp = await self._call(
            "range",
            functools.partial(self.kv.get, start or prefix, range_end=prefix_range_end(prefix),
                              limit=limit, keys_only=True, timeout=self.timeout),
        )
        return [kv.key for kv in resp.kvs]

    @staticmethod
    def op_delete_range(key: bytes, range_end: bytes) -> Any:
        return KVService.txn_op_delete(key, range_end=range_end)

    @staticmethod
    def present(key: str) -> Any:
        """The key exists (its create revision is above 0)."""
        from etcd3aio._protobuf import Compare

        return Compare(
            result=Compare.GREATER, target=Compare.CREATE, key=key.encode(), create_revision=0
        )

    async def status(self) -> Any:
        """Maintenance status of the member this client reaches (``dbSize``,
        ``dbSizeInUse``, ``dbSizeQuota`` from etcd 3.6, ``header.revision``...)."""
        assert self.client.maintenance is not None
        return await self._call(
            "status", functools.partial(self.client.maintenance.status, timeout=self.timeout))

    async def compact(self, revision: int) -> bool:
        """Compact etcd's history up to ``revision``, returning once the old revisions are
        gone from the database; False if it already was (etcd's own auto-compaction, or
        another leader, got further)."""
        try:
            await self._authed(functools.partial(self.kv.compact, revision, physical=True,
                                                 timeout=self.timeout))
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.OUT_OF_RANGE:
                return False
            raise self._translate("compact", exc) from exc
        except (EtcdError, TimeoutError) as exc:
            raise self._translate("compact", exc) from exc
        return True

    async def defragment(self, timeout: float) -> None:
        """Defragment the member this client reaches (it answers nothing meanwhile)."""
        assert self.client.maintenance is not None
        await self._call(
            "defragment",
            functools.partial(self.client.maintenance.defragment, timeout=timeout, max_attempts=1),
        )

    async def disarm_nospace(self) -> bool:
        """Clear etcd's NOSPACE alarm (raised when the database hit its quota), if
        raised; whether it was."""
        from etcd3aio.maintenance import AlarmType

        maintenance = self.client.maintenance
        assert maintenance is not None
        alarms = await self._call(
            "alarms", functools.partial(maintenance.alarms, timeout=self.timeout))
        raised = [a.memberID for a in alarms.alarms if a.alarm == AlarmType.NOSPACE]
        for member in raised:
            await self._call("alarm disarm", functools.partial(
                maintenance.alarm_deactivate, AlarmType.NOSPACE, member_id=member,
                timeout=self.timeout))
        return bool(raised)

    # ------------------------------------------------------------------ watching
    async def mirror(
        self,
        prefix: str,
        apply: Callable[[str, bytes | None, int, int], None],
        on_batch: Callable[[int], None],
        *,
        reset: Callable[[], None] | None = None,
        ready: asyncio.Event | None = None,
        first: Sequence[str] = (),
        tidy: Callable[[], None] | None = None,
        ranges: Sequence[tuple[str, str]] = (),
        following: Following | None = None,
    ) -> None:
        """Feed every key under ``prefix`` to ``apply``, then every change, forever.

        ``on_batch(revision)`` runs after each consistent batch (the initial load,
        then each watch response). A compacted watch calls ``reset`` and reloads
        the prefix; a broken one resumes at the next revision; a transient etcd
        outage is retried with backoff.

        ``ranges``: only the keys in these ``[start, end)`` ranges (within ``prefix``),
        loaded at one revision and each watched on the one stream; changes elsewhere
        are never sent (``Keyspace.own_ranges``; ``submit --wait`` follows three keys
        this way). Each range's changes come in etcd's order, and ``on_batch`` gets a
        revision every range has caught up with; across ranges, a stream catching up
        after a resume may interleave (``hypermesh/etcd_watch.py``). With ``following``,
        also the ranges of each name it is asked for, read and added to the open stream
        when asked (``Following``; ``apply`` asks, for the workflows a node works on).

        A (re)load applies the keys under ``first`` before the others (the load is one
        snapshot: any order gives the same state), and calls ``tidy`` every
        ``TIDY_EVERY`` keys it applied, so that a mirror may shrink what it holds while
        a large namespace loads (``hypermesh/state/folding.py``).
        """
        assert self.client.watch is not None
        backoff = 0.2
        revision = 0
        while True:
            try:
                if revision == 0:
                    if ranges:
                        followed = following.ranges() if following is not None else []
                        kvs, loaded_at = await self.get_prefix(prefix, ranges=[*ranges, *followed])
                        if following is not None:
                            following.forget_absent({kv.key for kv in kvs})
                    else:
                        kvs, loaded_at = await self.get_prefix(prefix)
                    revision = loaded_at  # only once all of it is loaded
                    if reset is not None:
                        reset()
                    ordered = kvs
                    if first:
                        early = tuple(p.encode() for p in first)
                        ordered = [kv for kv in kvs if kv.key.startswith(early)]
                        ordered += [kv for kv in kvs if not kv.key.startswith(early)]
                    del kvs
                    for n, kv in enumerate(ordered, start=1):
                        apply(kv.key.decode(), kv.value, kv.create_revision, kv.mod_revision)
                        if tidy is not None and n % TIDY_EVERY == 0:
                            tidy()
                    del ordered
                    on_batch(revision)
                    if ready is not None:
                        ready.set()
                generation = self._token_gen
                # Our own stream, which never reopens by itself: after any break the
                # loop resumes after the last event it applied (etcd3aio's watch reopened
                # from its last answer's header, which can skip events).
                partial = [*ranges, *(following.ranges() if following is not None else ())]
                watched = ([(a.encode(), b.encode()) for a, b in partial] if ranges
                           else [(prefix.encode(), prefix_range_end(prefix))])
                async with RangeWatch(
                    self.client.watch._stub, watched, revision + 1, metadata=self._metadata(),
                ) as watch:
                    if following is not None:
                        following.reopened(len(ranges))
                        await self._follow(watch, following, apply, on_batch)
                    async for change in watch:
                        for ev in change.events:
                            kv = ev.kv
                            apply(kv.key.decode(), None if ev.type == 1 else kv.value,
                                  kv.create_revision, kv.mod_revision)
                        revision = change.revision
                        on_batch(revision)
                        backoff = 0.2
                        if following is not None and (following.wanted or following.unwanted):
                            await self._follow(watch, following, apply, on_batch)
            except WatchCompacted:
                log.warning("watch on %s compacted; reloading", prefix)
                revision = 0
            except WatchEnded as exc:
                if exc.cancelled and self.security.user:
                    # etcd checks the token when a watch is created: refused, it has
                    # most likely expired. Resume with a new one.
                    log.info("watch on %s: %s; authenticating again", prefix, exc)
                    with contextlib.suppress(EtcdUnavailable):
                        await self._authenticate(stale=generation)
                elif exc.cancelled:
                    log.warning("watch on %s: %s; reloading", prefix, exc)
                    revision = 0
                else:
                    log.warning("watch on %s: %s; resuming at %d", prefix, exc, revision + 1)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
            except (EtcdUnavailable, EtcdError, grpc.aio.AioRpcError) as exc:
                if _cancelled(exc) or _cancelled(exc.__cause__ or exc):
                    raise asyncio.CancelledError from exc
                log.warning("mirror of %s: %s; retrying in %.1fs", prefix, exc, backoff)
                if self._token_expired(exc):
                    with contextlib.suppress(EtcdUnavailable):
                        await self._authenticate()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    async def _follow(self, watch: RangeWatch, following: Following,
                      apply: Callable[[str, bytes | None, int, int], None],
                      on_batch: Callable[[int], None]) -> None:
        """Stop watching the names ``following`` no longer wants; read and apply the keys
        of those it wants, then watch them on ``watch`` from the revision read at."""
        while following.unwanted:
            await watch.cancel(following.followed.pop(following.unwanted.pop(), []))
        added = False
        while following.wanted:
            name = next(iter(following.wanted))  # still wanted if this read fails
            named = following.ranges_of(name)
            kvs, read_at = await self.get_ranges(named)
            following.wanted.discard(name)
            if name in following.followed or not following.anchored(
                    name, {kv.key for kv in kvs}):
                continue
            for kv in kvs:
                apply(kv.key.decode(), kv.value, kv.create_revision, kv.mod_revision)
            if name in following.ended:
                continue  # its keys said it ended: nothing more of it to follow
            following.followed[name] = await watch.add(
                [(a.encode(), b.encode()) for a, b in named], read_at)
            added = True
        if added:
            on_batch(watch.revision)


TXN_RETRY_BACKOFF_S = 0.1  # first pause before a transaction is tried again (doubles)
_TRANSIENT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def _transient(exc: BaseException) -> bool:
    """An error after which the same request may succeed (etcd3aio's own transient
    errors, an unreachable member, a deadline)."""
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code() in _TRANSIENT
    cause = exc.__cause__
    if isinstance(cause, grpc.aio.AioRpcError):
        return cause.code() in _TRANSIENT
    return isinstance(exc, TimeoutError)


def _effect_reads(success: Sequence[Any]) -> list[Any]:
    """Range requests that read back what the operations in ``success`` write."""
    reads = []
    for op in success:
        kind = op.WhichOneof("request")
        if kind == "request_put":
            reads.append(KVService.txn_op_get(op.request_put.key))
        elif kind == "request_delete_range":
            d = op.request_delete_range
            reads.append(KVService.txn_op_get(d.key, range_end=d.range_end or None))
        else:  # a nested transaction or a read: its effect cannot be read back
            return []
    return reads


def _committed_at(success: Sequence[Any], reads: Sequence[Any]) -> int | None:
    """The revision at which ``success`` was applied, judged from ``reads`` (the
    answers to ``_effect_reads``): None if what it writes is not all there. 0: all
    there, but it only deletes, so the revision is unknown."""
    if not success or len(reads) != len(success):
        return None
    revisions = set()
    for op, read in zip(success, reads, strict=True):
        kvs = read.response_range.kvs
        if op.WhichOneof("request") == "request_put":
            put = op.request_put
            if len(kvs) != 1 or kvs[0].value != put.value or kvs[0].lease != put.lease:
                return None
            revisions.add(kvs[0].mod_revision)
        elif kvs:
            return None
    if len(revisions) > 1:
        return None  # some of it was written again since
    return revisions.pop() if revisions else 0


def keepalive_interval(ttl: int) -> float:
    """Seconds between lease renewals: a third of the TTL (at least 0.5 s)."""
    return max(0.5, ttl / 3)


__all__ = [
    "MAX_TXN_OPS",
    "Etcd",
    "LeaseLost",
    "hush_broken_stream_noise",
    "keepalive_interval",
]
