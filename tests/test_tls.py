"""kvplug.tls: the TLS options every TLS scheme shares, the contexts built from them, and
TLSChannel, TLS over a socket driven with the event loop's sock_* calls (real certificates
from kvplug_testing.tls, a connected socket pair)."""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
from pathlib import Path

import pytest

from kvplug.options import BackendOptions
from kvplug.tls import TLSChannel, TLSFilesError, TLSOptions, client_context, server_context
from kvplug_testing.tls import TLSFiles, make_tls_files


class Options(BackendOptions, TLSOptions):
    pass


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TLSFiles:
    return make_tls_files(tmp_path_factory.mktemp("tls"))


def test_the_options_decide_how_the_server_is_checked(tls_files: TLSFiles) -> None:
    strict = client_context(Options(ssl_ca_certs=str(tls_files.ca_cert)))
    assert strict.verify_mode == ssl.CERT_REQUIRED and strict.check_hostname
    loose = client_context(Options(ssl_cert_reqs="optional", ssl_check_hostname=False))
    assert loose.verify_mode == ssl.CERT_OPTIONAL and not loose.check_hostname
    unchecked = client_context(Options(ssl_cert_reqs="none"))
    assert unchecked.verify_mode == ssl.CERT_NONE and not unchecked.check_hostname


def test_a_pem_file_that_is_missing_or_wrong_is_named(tls_files: TLSFiles, tmp_path: Path) -> None:
    with pytest.raises(TLSFilesError) as missing:
        client_context(Options(ssl_certfile=str(tmp_path / "client.pem")))
    assert missing.value.fact.startswith("ssl_certfile") and "client.pem" in str(missing.value)
    with pytest.raises(TLSFilesError, match="could not be loaded"):  # a key as the certificate
        client_context(Options(ssl_certfile=str(tls_files.client_key)))
    with pytest.raises(TLSFilesError, match="is not a readable file"):
        server_context(str(tls_files.server_cert), str(tmp_path / "server.key"))
    with pytest.raises(TLSFilesError, match="could not be loaded"):  # another certificate's key
        server_context(str(tls_files.server_cert), str(tls_files.client_key))


def channels(
    tls_files: TLSFiles, *, client_certificate: bool = True
) -> tuple[TLSChannel, TLSChannel]:
    """A client and a server channel over a connected pair of non-blocking sockets."""
    ours, theirs = socket.socketpair()
    for sock in (ours, theirs):
        sock.setblocking(False)
    client = Options(
        ssl_ca_certs=str(tls_files.ca_cert),
        ssl_certfile=str(tls_files.client_cert) if client_certificate else None,
        ssl_keyfile=str(tls_files.client_key) if client_certificate else None,
    )
    server = server_context(
        str(tls_files.server_cert), str(tls_files.server_key), str(tls_files.ca_cert)
    )
    return (
        TLSChannel(ours, client_context(client), server_hostname="127.0.0.1"),
        TLSChannel(theirs, server, server_side=True),
    )


async def receive_exactly(channel: TLSChannel, size: int) -> bytes:
    buffer = bytearray(size)
    view, received = memoryview(buffer), 0
    while received < size:
        count = await channel.recv_into(view[received:])
        assert count > 0, "the peer closed early"
        received += count
    return bytes(buffer)


def test_bytes_cross_both_ways_exactly_in_pieces_of_any_size(tls_files: TLSFiles) -> None:
    payload = os.urandom(3 * 1024 * 1024 + 17)  # several write chunks and many records

    async def main() -> None:
        client, server = channels(tls_files)
        try:
            await asyncio.gather(client.handshake(), server.handshake())
            assert client.version == server.version and client.version is not None
            sent = asyncio.create_task(client.sendall(memoryview(payload)))
            assert await receive_exactly(server, len(payload)) == payload
            await sent
            await server.sendall(b"reply")
            assert await receive_exactly(client, 5) == b"reply"
            assert await client.recv_into(memoryview(bytearray(0))) == 0
        finally:
            client.close()
            server.close()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_closed_peer_reads_as_zero_bytes(tls_files: TLSFiles) -> None:
    async def main() -> int:
        client, server = channels(tls_files)
        try:
            await asyncio.gather(client.handshake(), server.handshake())
            client.sock.shutdown(socket.SHUT_WR)  # its FIN, without close_notify
            return await server.recv_into(memoryview(bytearray(10)))
        finally:
            client.close()
            server.close()

    assert asyncio.run(asyncio.wait_for(main(), 30)) == 0


def test_a_damaged_record_is_an_ssl_error_never_data(tls_files: TLSFiles) -> None:
    async def main() -> None:
        client, server = channels(tls_files)
        try:
            await asyncio.gather(client.handshake(), server.handshake())
            client._tls.write(b"secret data")  # encrypt it, then damage it on the wire
            record = bytearray(client._outgoing.read())
            record[-1] ^= 0x01
            await asyncio.get_running_loop().sock_sendall(client.sock, record)
            with pytest.raises(ssl.SSLError):
                await server.recv_into(memoryview(bytearray(64)))
        finally:
            client.close()
            server.close()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_a_server_that_requires_a_client_certificate_tells_the_client_why(
    tls_files: TLSFiles,
) -> None:
    async def main() -> tuple[BaseException | None, BaseException | None]:
        client, server = channels(tls_files, client_certificate=False)
        try:
            # TLS 1.3: the client's side completes; it learns of the refusal at its first read.
            outcomes = await asyncio.gather(
                client.handshake(), server.handshake(), return_exceptions=True
            )
            refused = outcomes[1]
            try:
                await client.recv_into(memoryview(bytearray(10)))
            except ssl.SSLError as error:
                return refused, error
            return refused, None
        finally:
            client.close()
            server.close()

    refused, told = asyncio.run(asyncio.wait_for(main(), 30))
    assert isinstance(refused, ssl.SSLError)
    assert isinstance(told, ssl.SSLError) and "CERTIFICATE_REQUIRED" in str(told).upper()
