"""Redis Clusters for tests: ``masters`` cluster nodes on 127.0.0.1 with the 16384 slots
split between them.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from urllib.parse import quote

import redis

from kvplug_testing.ports import HOST
from kvplug_testing.redis import RedisServer

SLOTS = 16384
"""The hash slots of a Redis Cluster."""


class RedisCluster:
    """A Redis Cluster of ``masters`` nodes (3 by default) on 127.0.0.1, the 16384 slots split
    evenly, no replicas. :attr:`url` is ``redis+cluster://127.0.0.1:p1,127.0.0.1:p2,...``.
    ``extra_config`` lines (``{"proto-max-bulk-len": "1mb"}``) go to every node.

    ServerControl acts on every node at once; after :meth:`stop` and :meth:`start` the nodes
    come back on the same ports with their cluster configuration (not their data), and
    :meth:`start` returns once the cluster state is ``ok`` again.
    """

    scheme = "redis+cluster"

    def __init__(
        self,
        *,
        binary: str = "redis-server",
        masters: int = 3,
        password: str | None = None,
        node_timeout_ms: int = 2000,
        extra_config: Mapping[str, str] | None = None,
        startup_timeout: float = 20.0,
    ) -> None:
        if masters < 1:
            raise ValueError("a cluster needs at least one master")
        self.password = password
        self.startup_timeout = startup_timeout
        self.nodes = [
            RedisServer(
                binary=binary,
                password=password,
                cluster=True,
                cluster_node_timeout_ms=node_timeout_ms,
                extra_config=extra_config,
            )
            for _ in range(masters)
        ]
        self._formed = False

    @property
    def url(self) -> str:
        auth = f":{quote(self.password, safe='')}@" if self.password is not None else ""
        return f"{self.scheme}://{auth}" + ",".join(f"{HOST}:{n.port}" for n in self.nodes)

    def start(self) -> None:
        """Start every node; form the cluster the first time; wait for ``cluster_state:ok``."""
        try:
            for node in self.nodes:
                node.start()
            if not self._formed:
                self._form()
                self._formed = True
            self._wait_ok()
        except BaseException:
            if not self._formed:
                self.close()
            raise

    def _form(self) -> None:
        first, *rest = self.nodes
        with first.client() as client:
            for node in rest:
                client.execute_command("CLUSTER", "MEET", HOST, node.port, node.bus_port)
        share, extra = divmod(SLOTS, len(self.nodes))
        start = 0
        for index, node in enumerate(self.nodes):
            end = start + share + (1 if index < extra else 0) - 1
            with node.client() as client:
                client.execute_command("CLUSTER", "ADDSLOTSRANGE", start, end)
            start = end + 1

    def _wait_ok(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while True:
            ok = 0
            for node in self.nodes:
                with (
                    contextlib.suppress(redis.RedisError, OSError),
                    node.client(socket_timeout=1) as client,
                ):
                    info = client.execute_command("CLUSTER", "INFO")
                    text = info.decode() if isinstance(info, bytes) else str(info)
                    fields = dict(line.split(":", 1) for line in text.split() if ":" in line)
                    if (
                        fields.get("cluster_state") == "ok"
                        and fields.get("cluster_known_nodes") == str(len(self.nodes))
                        and fields.get("cluster_slots_ok") == str(SLOTS)
                    ):
                        ok += 1
            if ok == len(self.nodes):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the cluster did not reach cluster_state:ok within {self.startup_timeout} "
                    f"s; a node's log ends with:\n{self.nodes[0].log_tail()}"
                )
            time.sleep(0.1)

    def pause(self) -> None:
        for node in self.nodes:
            node.pause()

    def resume(self) -> None:
        for node in self.nodes:
            node.resume()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def close(self) -> None:
        """Kill every node and remove the working directories."""
        for node in self.nodes:
            node.close()

    def __enter__(self) -> RedisCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["SLOTS", "RedisCluster"]
