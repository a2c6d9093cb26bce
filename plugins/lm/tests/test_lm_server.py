"""kvplug lm-server, driven through raw sockets in both modes: LMCache 0.5.6's plain protocol
byte for byte, the extended mode, memory bound and eviction, spill, auth, limits, metrics,
graceful shutdown and restart on the same port."""

from __future__ import annotations

import os
import signal
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from lm_server_helpers import (
    ExtClient,
    PlainClient,
    closed_by_peer,
    connect,
    key,
    recv_exact,
    wait_for,
)

from kvplug_lm import wire
from kvplug_lm.server import LMServer, ServerOptions, run_in_thread
from kvplug_testing.lm import LMServerProcess, health
from kvplug_testing.ports import free_port

MiB = 1 << 20


def options(**overrides: object) -> ServerOptions:
    values: dict[str, object] = {"port": 0, "max_memory": 64 * MiB}
    values.update(overrides)
    return ServerOptions(**values)  # type: ignore[arg-type]


@pytest.fixture
def server() -> Iterator[LMServer]:
    with run_in_thread(options()) as running:
        yield running


def payload(n: int, seed: int = 0) -> bytes:
    return (bytes(range(seed % 251, 256)) + bytes(range(256)) * (n // 256 + 2))[:n]


# -- plain mode ------------------------------------------------------------------------------


def test_plain_put_then_get_returns_the_stored_metadata_and_bytes_unchanged(
    server: LMServer,
) -> None:
    client = PlainClient(server.port)
    data = os.urandom(3 * MiB + 17)
    client.put(key(1), data, fmt=1, dtype=3, shape=(2, 4, 64, 3 * MiB // 512 + 17))
    reply, got = client.get(key(1))
    assert reply == wire.PlainReply(200, len(data), 1, 3, (2, 4, 64, 3 * MiB // 512 + 17), 0)
    assert got == data


@pytest.mark.parametrize(
    ("fmt", "dtype", "shape"),
    [(7, 2, (5, 3)), (8, 0, (96,)), (5, 0, (96, 0, 0, 0)), (6, 8, (1, 2, 3, 16))],
)
def test_plain_metadata_of_newer_formats_dtype_none_and_short_shapes_round_trips(
    server: LMServer, fmt: int, dtype: int, shape: tuple[int, ...]
) -> None:
    client = PlainClient(server.port)
    client.put(key(2), b"x" * 96, fmt=fmt, dtype=dtype, shape=shape)
    reply, got = client.get(key(2))
    assert (reply.code, reply.fmt, reply.dtype, reply.shape) == (
        200,
        fmt,
        dtype,
        wire.pad_shape(shape),
    )
    assert got == b"x" * 96


def test_plain_miss_exist_health_and_list_replies_are_lmcache_s_bytes(server: LMServer) -> None:
    client = PlainClient(server.port)
    fail = wire.pack_plain_reply(wire.Code.FAIL)
    ok = wire.pack_plain_reply(wire.Code.SUCCESS)
    for command, expected in (
        (wire.Command.GET, fail),
        (wire.Command.EXIST, fail),
        (wire.Command.HEALTH, ok),
        (wire.Command.LIST, fail),
    ):
        client.sock.sendall(wire.pack_plain_request(command, key(3)))
        assert recv_exact(client.sock, 36) == expected, command
    client.put(key(3), b"abcd")
    assert client.request(wire.Command.EXIST, key(3)).code == 200


def test_plain_put_overwrites_and_keys_are_padding_insensitive(server: LMServer) -> None:
    client = PlainClient(server.port)
    client.put(key(4), b"old-value")
    client.put(key(4), b"new")
    assert client.get(key(4))[1] == b"new"
    assert server.stats()["objects"] == 1


def test_hello_answers_kvplug_s_magic_limits_and_a_fresh_nonce(server: LMServer) -> None:
    first = PlainClient(server.port).hello()
    second = PlainClient(server.port).hello()
    assert first.max_key_bytes == 1024
    assert first.max_object_bytes == server.object_limit < 64 * MiB
    assert not first.auth_required
    assert len(first.nonce) == wire.NONCE_BYTES and first.nonce != second.nonce


def test_plain_protocol_error_replies_400_closes_and_spares_other_clients(
    server: LMServer,
) -> None:
    bystander = PlainClient(server.port)
    bystander.put(key(5), b"kept")
    bad = connect(server.port)
    header = bytearray(wire.pack_plain_request(wire.Command.GET, key(5)))
    header[36:40] = b"a\tb\n"  # whitespace inside the key
    bad.sendall(bytes(header))
    assert recv_exact(bad, 36) == wire.pack_plain_reply(wire.Code.FAIL)
    assert closed_by_peer(bad)
    unknown = connect(server.port)
    unknown.sendall(wire.PLAIN_REQUEST.pack(9, 0, 1, 2, 0, 0, 0, 0, 0, key(5).ljust(150)))
    assert closed_by_peer(unknown)
    assert bystander.get(key(5))[1] == b"kept"
    errors = server.stats()["protocol_errors"]
    assert errors["bad_key"] == 1 and errors["unknown_command"] == 1


# -- extended mode ---------------------------------------------------------------------------


def test_extended_put_get_exists_delete_list_and_ping(server: LMServer) -> None:
    client = ExtClient(server.port)
    data = os.urandom(MiB)
    meta = wire.Meta(1, 3, (2, 2, 16, 8, 1024))
    assert client.put(key(10), data, meta).status == wire.Status.OK
    reply, got_meta, got = client.get(key(10))
    assert (reply.status, got_meta, got) == (wire.Status.OK, meta, data)
    assert reply.flags & wire.FLAG_CHECKSUM and reply.checksum == wire.checksum(data)
    assert client.call(wire.Op.EXISTS, key=key(10))[0].status == wire.Status.OK
    assert client.call(wire.Op.EXISTS, key=key(11))[0].status == wire.Status.NOT_FOUND
    assert client.call(wire.Op.PING)[0].status == wire.Status.OK
    client.put(key(12), b"small")
    listed = client.call(wire.Op.LIST)[2]
    assert sorted(listed.split(b"\n")) == [key(10), key(12)]
    assert client.call(wire.Op.DELETE, key=key(10))[0].status == wire.Status.OK
    assert client.call(wire.Op.DELETE, key=key(10))[0].status == wire.Status.NOT_FOUND
    assert client.get(key(10))[0].status == wire.Status.NOT_FOUND


def test_extended_exists_many_answers_each_key(server: LMServer) -> None:
    client = ExtClient(server.port)
    client.put(key(20), b"a")
    client.put(key(22), b"c")
    keys = [key(20), key(21), key(22), key(23)]
    reply, _, answer = client.call(wire.Op.EXISTS_MANY, payload=wire.pack_keys(keys))
    assert reply.status == wire.Status.OK and answer == bytes([1, 0, 1, 0])


def test_extended_requests_pipelined_get_replies_in_order(server: LMServer) -> None:
    client = ExtClient(server.port)
    values = {n: payload(1000 + n * 997, n) for n in range(40)}
    sent = []
    for n, value in values.items():
        meta = wire.pack_meta(wire.Meta(4, 6, (len(value),)))
        sent.append(client.send(wire.Op.PUT, key=key(n), meta=meta, payload=value))
    for n in values:
        sent.append(client.send(wire.Op.GET, key=key(n)))
    replies = [client.receive() for _ in sent]
    assert [r[0].request_id for r in replies] == sent
    assert all(r[0].status == wire.Status.OK for r in replies)
    assert [r[2] for r in replies[len(values) :]] == list(values.values())


def test_extended_and_plain_share_one_keyspace(server: LMServer) -> None:
    ext = ExtClient(server.port)
    plain = PlainClient(server.port)
    plain.put(key(30), b"p" * 64, fmt=5, dtype=0, shape=(64,))
    _, meta, got = ext.get(key(30))
    assert (meta, got) == (wire.Meta(5, 0, (64,)), b"p" * 64)
    ext.put(key(31), b"e" * 32, wire.Meta(1, 2, (2, 1, 2, 4)))
    plain_reply, plain_got = plain.get(key(31))
    assert (plain_reply.fmt, plain_reply.dtype, plain_reply.shape) == (1, 2, (2, 1, 2, 4))
    assert plain_got == b"e" * 32
    ext.put(key(32), b"f" * 64, wire.Meta(1, 2, (2, 1, 2, 2, 4)))
    assert plain.get(key(32))[0].code == 400  # five dims do not fit a plain header


def test_extended_checksum_mismatch_stores_nothing(server: LMServer) -> None:
    client = ExtClient(server.port)
    data = payload(4096)
    reply = client.put(key(40), data, checksum=wire.checksum(data) ^ 1)
    assert reply.status == wire.Status.BAD_CHECKSUM
    assert client.get(key(40))[0].status == wire.Status.NOT_FOUND
    assert server.stats()["allocator_used"] == 0
    assert client.put(key(40), data).status == wire.Status.OK  # the connection goes on


def test_extended_unknown_op_gets_bad_request_with_a_reason_then_close(server: LMServer) -> None:
    client = ExtClient(server.port)
    reply, _, reason = client.call(99)  # type: ignore[arg-type]
    assert reply.status == wire.Status.BAD_REQUEST and b"unknown extended op" in reason
    assert closed_by_peer(client.sock)


# -- memory, eviction, spill -----------------------------------------------------------------


def test_lru_eviction_keeps_memory_under_the_cap() -> None:
    with run_in_thread(options(max_memory=8 * MiB)) as server:
        client = ExtClient(server.port)
        for n in range(6):
            assert client.put(key(n), payload(2 * MiB, n)).status == wire.Status.OK
            if n == 2:
                client.get(key(0))  # 0 is now used more recently than 1 and 2
        stats = server.stats()
        assert stats["allocator_used"] <= 8 * MiB and stats["evictions"] >= 3
        present = [client.get(key(n))[0].status == wire.Status.OK for n in range(6)]
        assert present[5] and not present[1] and not present[2]
        assert client.get(key(5))[2] == payload(2 * MiB, 5)


def test_an_object_being_sent_survives_its_eviction() -> None:
    with run_in_thread(options(max_memory=64 * MiB)) as server:
        writer = ExtClient(server.port)
        big = os.urandom(24 * MiB)
        writer.put(key(1), big)
        slow_reader = PlainClient(server.port, rcvbuf=64 * 1024)
        slow_reader.sock.sendall(wire.pack_plain_request(wire.Command.GET, key(1)))
        wait_for(
            lambda: (
                server.stats()["requests"].get(("plain", "GET", "200")) is not None
                or server.stats()["bytes_sent"] > 0
            ),
            "the GET to start sending",
        )
        assert writer.put(key(2), payload(24 * MiB, 2)).status == wire.Status.OK
        assert writer.put(key(3), payload(24 * MiB, 3)).status == wire.Status.OK
        assert writer.get(key(1))[0].status == wire.Status.NOT_FOUND  # evicted...
        reply = slow_reader.reply()
        assert reply.length == len(big) and recv_exact(slow_reader.sock, len(big)) == big
        wait_for(lambda: server.stats()["allocator_objects"] == 1, "the sent block to be released")


def test_spill_to_file_reads_evicted_objects_back_bit_exact(tmp_path: Path) -> None:
    spill = f"file://{tmp_path / 'spill'}"
    with run_in_thread(options(max_memory=8 * MiB, spill=spill)) as server:
        ext = ExtClient(server.port)
        plain = PlainClient(server.port)
        values = {n: os.urandom(3 * MiB) for n in range(4)}
        plain.put(key(0), values[0], fmt=7, dtype=0, shape=(3 * MiB,))
        for n in range(1, 4):
            assert ext.put(key(n), values[n], wire.Meta(1, 2, (3, MiB // 2))).status == 0
        wait_for(lambda: server.stats()["spilled"] >= 2, "two objects to be spilled")
        reply, got = plain.get(key(0))
        assert (reply.fmt, reply.dtype, reply.shape, got) == (7, 0, (3 * MiB, 0, 0, 0), values[0])
        for n in range(1, 4):
            got_reply, meta, data = ext.get(key(n))
            assert (got_reply.status, meta, data) == (0, wire.Meta(1, 2, (3, MiB // 2)), values[n])
        stats = server.stats()
        assert stats["spill_hits"] >= 2 and stats["allocator_used"] <= 8 * MiB
        assert ext.call(wire.Op.DELETE, key=key(0))[0].status == wire.Status.OK
        wait_for(lambda: not server.stats()["spilling"], "spill writes to end")
        assert ext.get(key(0))[0].status == wire.Status.NOT_FOUND


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_spill_file_reads_as_a_miss_and_is_removed(tmp_path: Path, damage: str) -> None:
    from kvplug.backend import StoredFiles
    from kvplug_lm.memstore import spill_key

    spill = f"file://{tmp_path / 'spill'}"
    with run_in_thread(options(max_memory=8 * MiB, spill=spill)) as server:
        ext = ExtClient(server.port)
        for n in range(4):
            assert ext.put(key(n), payload(3 * MiB, n), wire.Meta(5, 6, (3 * MiB,))).status == 0
        wait_for(lambda: server.stats()["spilled"] >= 2, "two objects to be spilled")
        wait_for(lambda: not server.stats()["spilling"], "spill writes to end")
        assert server.store is not None and isinstance(server.store.spill, StoredFiles)
        files = [Path(p) for p in server.store.spill.stored_files(spill_key(key(0)))]
        assert files and all(f.exists() for f in files), "key 0 (least recent) was not spilled"
        for file in files:
            data = bytearray(file.read_bytes())
            if damage == "truncate":
                del data[len(data) // 2 :]
            else:
                data[len(data) // 2] ^= 0x10
            file.write_bytes(bytes(data))
        assert ext.get(key(0))[0].status == wire.Status.NOT_FOUND
        wait_for(lambda: not any(f.exists() for f in files), "the damaged spill file to go")
        assert ext.get(key(1))[1:] == (wire.Meta(5, 6, (3 * MiB,)), payload(3 * MiB, 1))


# -- auth ------------------------------------------------------------------------------------


def test_auth_required_wrong_proof_right_proof_and_plain_denied() -> None:
    secret = b"s3cret-value"
    with run_in_thread(options(secret=secret)) as server:
        client = ExtClient(server.port)
        assert client.server_hello.auth_required
        assert client.call(wire.Op.PING)[0].status == wire.Status.AUTH_REQUIRED
        wrong = wire.auth_proof(b"not-it", client.server_hello.nonce)
        assert client.call(wire.Op.AUTH, payload=wrong)[0].status == wire.Status.AUTH_FAILED
        other_nonce = PlainClient(server.port).hello().nonce
        replayed = wire.auth_proof(secret, other_nonce)
        assert client.call(wire.Op.AUTH, payload=replayed)[0].status == wire.Status.AUTH_FAILED
        right = wire.auth_proof(secret, client.server_hello.nonce)
        assert client.call(wire.Op.AUTH, payload=right)[0].status == wire.Status.OK
        assert client.put(key(1), b"after-auth").status == wire.Status.OK
        plain = PlainClient(server.port)
        assert plain.request(wire.Command.HEALTH).code == 200  # health checks still work
        plain.sock.sendall(wire.pack_plain_request(wire.Command.GET, key(1)))
        assert closed_by_peer(plain.sock)
        assert server.stats()["auth_failures"] == 3
        assert "s3cret" not in repr(server.options)


# -- limits ----------------------------------------------------------------------------------


def test_too_large_objects_are_refused_and_the_connection_goes_on() -> None:
    with run_in_thread(options(max_memory=4 * MiB, max_object_bytes=2 * MiB)) as server:
        ext = ExtClient(server.port)
        assert ext.server_hello.max_object_bytes == 2 * MiB
        assert ext.put(key(1), bytes(3 * MiB)).status == wire.Status.TOO_LARGE
        assert ext.call(wire.Op.PING)[0].status == wire.Status.OK
        plain = PlainClient(server.port)
        plain.put(key(2), bytes(3 * MiB))  # no reply in plain mode: read and dropped
        assert plain.get(key(2))[0].code == 400
        assert server.stats()["protocol_errors"]["too_large"] == 2
        assert server.stats()["allocator_used"] == 0


def test_a_key_over_the_limit_is_too_large() -> None:
    with run_in_thread(options(max_key_bytes=64)) as server:
        client = ExtClient(server.port)
        long_key = b"m" * 60 + b"@1@0@1@half"
        assert client.put(long_key, b"v").status == wire.Status.TOO_LARGE
        assert client.put(key(1), b"v").status == wire.Status.OK


def test_idle_connections_are_closed_after_the_idle_timeout() -> None:
    with run_in_thread(options(idle_timeout=0.3)) as server:
        client = PlainClient(server.port)
        assert client.request(wire.Command.HEALTH).code == 200
        assert closed_by_peer(client.sock)
        assert server.stats()["idle_timeouts"] == 1


def test_a_client_trickling_a_header_is_dropped_after_the_frame_timeout() -> None:
    with run_in_thread(options(frame_timeout=0.3)) as server:
        slow = connect(server.port)
        slow.sendall(wire.pack_plain_request(wire.Command.PUT, key(1), length=100)[:20])
        assert closed_by_peer(slow)
        assert server.stats()["protocol_errors"]["timeout"] == 1


def test_a_payload_slower_than_min_rate_is_dropped_and_its_buffer_freed() -> None:
    with run_in_thread(options(frame_timeout=0.3, min_rate=4 * MiB)) as server:
        slow = connect(server.port)
        slow.sendall(wire.pack_plain_request(wire.Command.PUT, key(1), length=MiB) + b"x" * 10)
        assert closed_by_peer(slow)
        wait_for(lambda: server.stats()["allocator_used"] == 0, "the buffer to be freed")


def test_a_payload_trickling_under_min_rate_without_stalling_is_dropped() -> None:
    with run_in_thread(options(frame_timeout=0.5, min_rate=MiB)) as server:
        slow = connect(server.port)
        slow.sendall(wire.pack_plain_request(wire.Command.PUT, key(1), length=MiB))
        stop = threading.Event()

        def trickle() -> None:  # 1 KiB/s, never silent for a whole frame_timeout
            while not stop.wait(0.05):
                try:
                    slow.sendall(b"t" * 50)
                except OSError:
                    return

        threading.Thread(target=trickle, daemon=True).start()
        try:
            assert closed_by_peer(slow)
        finally:
            stop.set()
        wait_for(lambda: server.stats()["allocator_used"] == 0, "the buffer to be freed")
        assert server.stats()["protocol_errors"]["timeout"] == 1


def test_a_client_vanishing_mid_payload_leaves_allocator_usage_at_baseline(
    server: LMServer,
) -> None:
    keeper = PlainClient(server.port)
    keeper.put(key(1), b"k" * 5000)
    keeper.get(key(1))
    baseline = server.stats()["allocator_used"]
    for mode in ("plain", "extended"):
        gone = connect(server.port)
        if mode == "plain":
            gone.sendall(wire.pack_plain_request(wire.Command.PUT, key(2), length=8 * MiB))
        else:
            header = wire.pack_ext_request(
                wire.Op.PUT,
                key=key(2),
                meta=wire.pack_meta(wire.Meta(4, 6, (8 * MiB,))),
                payload_len=8 * MiB,
            )
            gone.sendall(header)
        gone.sendall(b"y" * MiB)
        wait_for(lambda: server.stats()["allocator_used"] > baseline, "the payload's buffer")
        gone.close()
        wait_for(lambda: server.stats()["allocator_used"] == baseline, "the buffer's release")
    assert keeper.get(key(2))[0].code == 400
    assert keeper.get(key(1))[1] == b"k" * 5000


def test_connections_over_the_limit_are_closed_at_once() -> None:
    with run_in_thread(options(max_connections=2)) as server:
        first, second = PlainClient(server.port), PlainClient(server.port)
        assert first.request(wire.Command.HEALTH).code == 200
        assert second.request(wire.Command.HEALTH).code == 200
        third = connect(server.port)
        assert closed_by_peer(third)
        assert server.stats()["connections_refused"] == 1
        assert first.request(wire.Command.HEALTH).code == 200


# -- metrics, shutdown, the command ----------------------------------------------------------


def test_metrics_are_exported_on_the_metrics_port(server: LMServer) -> None:
    port = free_port()
    with run_in_thread(options(metrics_port=port)) as running:
        client = PlainClient(running.port)
        client.put(key(1), b"m" * 100)
        client.get(key(1))
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as page:
            text = page.read().decode()
    assert 'kvplug_lm_requests_total{mode="plain",op="GET",status="200"} 1.0' in text
    assert "kvplug_lm_objects 1.0" in text
    assert "kvplug_lm_bytes_received_total" in text


def test_stop_finishes_a_get_in_flight_and_closes_idle_connections() -> None:
    done = threading.Event()
    big = os.urandom(16 * MiB)
    with run_in_thread(options()) as server:
        writer = PlainClient(server.port)  # kept open (idle): only the GET is in flight
        writer.put(key(1), big)
        # a plain PUT has no reply: its EXIST answers only once the payload is stored, so
        # the one request in flight below is the GET, not the end of this PUT
        assert writer.request(wire.Command.EXIST, key(1)).code == 200
        idle = PlainClient(server.port)
        assert idle.request(wire.Command.HEALTH).code == 200
        reader = PlainClient(server.port, rcvbuf=64 * 1024)
        reader.sock.sendall(wire.pack_plain_request(wire.Command.GET, key(1)))
        # Its reply header has arrived, so the server is sending the 16 MiB payload into a
        # 64 KiB receive buffer: the GET is in flight until the thread below reads it
        reply = reader.reply()
        assert reply.code == 200
        received: list[bytes] = []

        def read_slowly() -> None:
            received.append(recv_exact(reader.sock, reply.length))
            done.set()

        threading.Thread(target=read_slowly, daemon=True).start()
    assert done.wait(30) and received == [big]
    assert closed_by_peer(idle.sock) and closed_by_peer(writer.sock)


def test_command_line_sigterm_finishes_in_flight_get_exits_0_and_restarts_on_the_port() -> None:
    process = LMServerProcess(["--max-memory", "64MiB", "--shutdown-grace", "20"])
    with process:
        client = PlainClient(process.port, rcvbuf=64 * 1024)
        big = os.urandom(32 * MiB)
        client.put(key(1), big)
        client.sock.sendall(wire.pack_plain_request(wire.Command.GET, key(1)))
        reply = client.reply()
        assert reply.code == 200
        assert process.process is not None
        process.process.send_signal(signal.SIGTERM)
        assert recv_exact(client.sock, reply.length) == big
        assert process.process.wait(30) == 0
        assert "kvplug lm-server listening on 127.0.0.1:" in process.log_tail(50)
        process.process = None
        process.start()  # the same port, at once
        assert health(process.port)
        process.stop()
        process.start()  # after a SIGKILL too
        assert health(process.port)


def test_options_refuse_a_key_limit_past_the_hard_limit() -> None:
    with pytest.raises(ValueError, match="max_key_bytes"):
        ServerOptions(max_key_bytes=1 << 20)


def test_port_zero_binds_a_free_port_and_restart_on_the_same_port_works() -> None:
    with run_in_thread(options()) as first:
        port = first.port
        sock = connect(port)
        sock.sendall(wire.pack_plain_request(wire.Command.HEALTH, key(1)))
        recv_exact(sock, 36)
    with run_in_thread(options(port=port)) as second:
        assert second.port == port and health(port)
    sock.close()


def test_command_line_reads_the_secret_from_a_file_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret_file = tmp_path / "secret"
    secret_file.write_text("file-secret\n")
    with LMServerProcess(["--secret-file", str(secret_file)]) as process:
        client = ExtClient(process.port)
        proof = wire.auth_proof(b"file-secret", client.server_hello.nonce)
        assert client.call(wire.Op.AUTH, payload=proof)[0].status == wire.Status.OK
        plain = PlainClient(process.port)
        plain.sock.sendall(wire.pack_plain_request(wire.Command.EXIST, key(1)))
        assert closed_by_peer(plain.sock)
        assert "file-secret" not in process.log_tail(100)
    monkeypatch.setenv("KVPLUG_LM_SECRET", "env-secret")
    with LMServerProcess(["--plain", "allow"]) as process:
        client = ExtClient(process.port)
        assert client.call(wire.Op.PING)[0].status == wire.Status.AUTH_REQUIRED
        proof = wire.auth_proof(b"env-secret", client.server_hello.nonce)
        assert client.call(wire.Op.AUTH, payload=proof)[0].status == wire.Status.OK
        assert PlainClient(process.port).request(wire.Command.EXIST, key(1)).code == 400
