"""A Valkey Cluster resharded while operations run, through valkey+cluster:// and valkey-py:
every error an operation raises is a kvplug error, never the client library's own (issue 34
saw ``AttributeError: 'NoneType' object has no attribute 'writelines'`` from operations caught
while valkey-py's cluster client closed the connections they were using), and once the slots
have moved every operation succeeds and reads what was written."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
import valkey

import kvplug
from kvplug import BackendTimeout, BackendUnavailable, CacheKey, KvplugError
from kvplug.backend import Backend
from kvplug_testing import ValkeyCluster
from kvplug_testing.tier_checks import make_obj, new_model, run, same

pytestmark = [pytest.mark.redis, pytest.mark.slow]

KEYS = 64
TASKS = 32
MOVES = 6
"""Rounds of moving every slot that holds a test key to the next master."""


def node_ids(cluster: ValkeyCluster) -> list[str]:
    ids = []
    for node in cluster.nodes:
        with node.client() as client:
            ids.append(client.execute_command("CLUSTER", "MYID").decode())
    return ids


def owner(cluster: ValkeyCluster, slot: int) -> int:
    """The index in ``cluster.nodes`` of the master serving ``slot``."""
    with cluster.nodes[0].client() as client:
        for start, end, primary, *_ in client.execute_command("CLUSTER", "SLOTS"):
            if start <= slot <= end:
                port = int(primary[1])
                return next(i for i, n in enumerate(cluster.nodes) if n.port == port)
    raise AssertionError(f"no master serves slot {slot}")


def move_slot(cluster: ValkeyCluster, ids: list[str], slot: int, source: int, target: int) -> None:
    """Migrate ``slot`` with its keys from master ``source`` to master ``target``, the way
    ``valkey-cli --cluster reshard`` does."""
    src, dst = cluster.nodes[source], cluster.nodes[target]
    with src.client() as src_client, dst.client() as dst_client:
        dst_client.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[source])
        src_client.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[target])
        while True:
            keys = src_client.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100)
            if not keys:
                break
            src_client.execute_command(
                "MIGRATE", "127.0.0.1", dst.port, "", 0, 5000, "REPLACE", "KEYS", *keys
            )
        for node in cluster.nodes:
            with node.client() as client:
                client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[target])


async def load(backend: Backend, keys: list[CacheKey], stop: asyncio.Event) -> Counter[str]:
    """Puts and gets of ``keys`` from TASKS tasks until ``stop``: the operations done and the
    errors, by class (``raw ...`` for what is not a kvplug error, ``long ...`` for a message
    over a few KiB: a client library may name the whole command, value and all)."""
    seen: Counter[str] = Counter()
    objs = [make_obj(n) for n in range(len(keys))]

    async def one(task: int) -> None:
        n = task
        while not stop.is_set():
            key, obj = keys[n % len(keys)], objs[n % len(keys)]
            try:
                if n % 3:
                    got = await backend.get(key)
                    if got is not None:
                        got.release()
                else:
                    await backend.batched_put([key], [obj])
            except KvplugError as error:
                seen[f"kvplug {type(error).__name__}"] += 1
                if len(str(error)) > 4096:
                    seen[f"long {type(error).__name__}: {str(error)[:300]}"] += 1
            except Exception as error:
                seen[f"raw {type(error).__name__}: {str(error)[:300]}"] += 1
            seen["operations"] += 1
            n += TASKS
            await asyncio.sleep(0)

    try:
        await asyncio.gather(*(one(task) for task in range(TASKS)))
    finally:
        for obj in objs:
            obj.release()
    return seen


def test_operations_during_a_reshard_raise_only_kvplug_errors_and_succeed_after() -> None:
    with ValkeyCluster() as cluster:
        ids = node_ids(cluster)
        model = new_model()
        keys = [CacheKey(model, 1, 0, n) for n in range(KEYS)]
        prefix = "reshard:"
        slots = sorted({valkey.crc.key_slot((prefix + key.to_string()).encode()) for key in keys})

        async def main() -> tuple[Counter[str], bool]:
            backend = await kvplug.open_backend(cluster.url, key_prefix=prefix, timeout=5)
            stop = asyncio.Event()
            running = asyncio.ensure_future(load(backend, keys, stop))
            try:
                for _ in range(MOVES):
                    for slot in slots:
                        source = await asyncio.to_thread(owner, cluster, slot)
                        target = (source + 1) % len(cluster.nodes)
                        await asyncio.to_thread(move_slot, cluster, ids, slot, source, target)
                    await asyncio.sleep(0.05)
            finally:
                stop.set()
                seen = await running
            objs = [make_obj(1000 + n) for n in range(len(keys))]
            try:
                await asyncio.wait_for(backend.batched_put(keys, objs), 30)
                got = await asyncio.wait_for(backend.batched_get(keys), 30)
                intact = all(same(o, g) for o, g in zip(objs, got, strict=True))
                for g in got:
                    if g is not None:
                        g.release()
            finally:
                for obj in objs:
                    obj.release()
                await backend.close()
            return seen, intact

        seen, intact = run(main())
    wrong = {name: count for name, count in seen.items() if name.startswith(("raw ", "long "))}
    assert wrong == {}, f"errors that are not kvplug's, or too long to show: {wrong}"
    assert seen["operations"] > 10 * TASKS, seen
    assert intact, "after the reshard, a batched put and get did not round-trip"


def test_a_cluster_client_that_lost_every_node_finds_the_cluster_again() -> None:
    """valkey-py's cluster client drops a node from its startup nodes on each connection error
    or timeout; with every node down for a moment (as a reshard on a busy machine once made
    them time out) it dropped them all and failed every later operation with "Please provide
    at least one reachable node". kvplug puts the configured nodes back after a failure."""
    with ValkeyCluster() as cluster:
        keys = [CacheKey(new_model(), 1, 0, n) for n in range(KEYS)]  # spread over every node

        async def main() -> bool:
            backend = await kvplug.open_backend(cluster.url, timeout=2)
            objs = [make_obj(n) for n in range(len(keys))]
            try:
                await backend.batched_put(keys, objs)
                await asyncio.to_thread(cluster.stop)
                # At once, so that operations on every node fail before any rediscovery.
                failed = await asyncio.gather(
                    *(backend.put(k, o) for k, o in zip(keys, objs, strict=True)),
                    return_exceptions=True,
                )
                assert all(isinstance(f, (BackendUnavailable, BackendTimeout)) for f in failed)
                await asyncio.to_thread(cluster.start)
                deadline = asyncio.get_running_loop().time() + 30
                while True:  # the restarted nodes agree on the cluster again
                    try:
                        await backend.batched_put(keys, objs)
                        break
                    except (BackendUnavailable, BackendTimeout):
                        if asyncio.get_running_loop().time() > deadline:
                            raise
                        await asyncio.sleep(0.2)
                got = await backend.batched_get(keys)
                intact = all(same(o, g) for o, g in zip(objs, got, strict=True))
                for g in got:
                    if g is not None:
                        g.release()
                return intact
            finally:
                for obj in objs:
                    obj.release()
                await backend.close()

        assert run(main()), "after the restart, a batched put and get did not round-trip"
