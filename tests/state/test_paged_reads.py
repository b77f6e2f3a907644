"""Range reads in pages (issue 22): a prefix holding more than a gRPC message may carry
(4 MiB by default) is read whole, every page at one revision. Against a real etcd."""

from __future__ import annotations

import asyncio

import pytest

from hypermesh.local.etcd import EtcdServer
from hypermesh.state import etcd as etcd_module
from hypermesh.state.etcd import Etcd
from tests.state.fence_kit import endpoint, fresh_keyspace, run

VALUE = b"x" * 100_000  # 60 of them: 6 MB, over the 4 MiB a client accepts at once


async def fill(etcd: Etcd, prefix: str) -> None:
    for i in range(60):
        await etcd.put(f"{prefix}{i:03d}", VALUE)


@pytest.mark.parametrize("first_page", [256, 10_000])
def test_a_prefix_larger_than_one_message_is_read_in_pages(
    etcd_server: EtcdServer, monkeypatch: pytest.MonkeyPatch, first_page: int
) -> None:
    """Pages follow the sizes seen; the first is sized before any value is seen, and when
    etcd's answer would be over the client's limit it is asked for again at half."""
    monkeypatch.setattr(etcd_module, "FIRST_PAGE_KEYS", first_page)
    ks = fresh_keyspace()
    prefix = f"{ks.root}big/"

    async def scenario() -> None:
        async with Etcd(endpoint(etcd_server)) as etcd:
            await fill(etcd, prefix)
            kvs, revision = await etcd.get_prefix(prefix)
            assert [kv.key.decode() for kv in kvs] == [f"{prefix}{i:03d}" for i in range(60)]
            assert all(kv.value == VALUE for kv in kvs)

            pages = []
            async for page, at in etcd.pages(prefix):
                pages.append((len(page), at))
                if len(pages) == 1:  # a write between pages is not seen by the read
                    await etcd.put(f"{prefix}zzz", b"late")
                    await etcd.put(f"{prefix}059", b"changed")
            assert len(pages) > 1 and sum(n for n, _ in pages) == 60
            assert len({at for _, at in pages}) == 1
            assert pages[0][1] >= revision
            assert all(n * len(VALUE) < 4 << 20 for n, _ in pages)  # under gRPC's limit
            assert all(n * len(VALUE) <= 2 * etcd_module.PAGE_BYTES for n, _ in pages[1:])

            empty, at = await etcd.get_prefix(f"{ks.root}nothing/")
            assert empty == [] and at > revision

    run(scenario())


def test_a_mirror_loads_the_first_prefixes_first_and_tidies_as_it_goes(
    etcd_server: EtcdServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mirror's load applies the keys under ``first`` before the rest (so a view can
    fold each block's batches as they come) and calls ``tidy`` every ``TIDY_EVERY`` keys."""
    monkeypatch.setattr(etcd_module, "TIDY_EVERY", 4)
    ks = fresh_keyspace()

    async def scenario() -> None:
        async with Etcd(endpoint(etcd_server)) as etcd:
            for kind in ("a", "b", "c"):
                for i in range(5):
                    await etcd.put(f"{ks.root}{kind}/{i}", b"v")
            applied: list[str] = []
            tidied: list[int] = []
            loaded = asyncio.Event()
            mirror = asyncio.create_task(etcd.mirror(
                ks.root, lambda key, *_: applied.append(key.removeprefix(ks.root)),
                lambda _rev: loaded.set(), first=(f"{ks.root}c/",),
                tidy=lambda: tidied.append(len(applied)),
            ))
            await asyncio.wait_for(loaded.wait(), 10)
            mirror.cancel()
            assert applied == [f"c/{i}" for i in range(5)] + [
                f"{k}/{i}" for k in "ab" for i in range(5)]
            assert tidied == [4, 8, 12]

    run(scenario())
