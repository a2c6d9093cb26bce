"""``lms://``: the lm:// client and ``kvplug lm-server`` over TLS, with real certificates (a test
CA, a server and a client certificate from :func:`kvplug_testing.tls.make_tls_files`), on
127.0.0.1. The contract suite over TLS is in test_lm_contract.py."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import kvplug
from kvplug.errors import BackendUnavailable, InvalidBackendURL
from kvplug.memory import MemoryFormat, MemoryObj
from kvplug.tls import TLSFilesError
from kvplug_lm.backend import LMBackend
from kvplug_lm.server import LMServer, ServerOptions, run_in_thread
from kvplug_testing.lm import LMServerProcess, health
from kvplug_testing.tls import TLSFiles, make_tls_files, tls_query


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TLSFiles:
    return make_tls_files(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> TLSFiles:
    """Certificates of a CA the servers here do not trust."""
    return make_tls_files(tmp_path_factory.mktemp("other-tls"))


def tls_options(files: TLSFiles, **changes: Any) -> ServerOptions:
    settings: dict[str, Any] = {
        "port": 0,
        "max_memory": 64 << 20,
        "tls_cert_file": str(files.server_cert),
        "tls_key_file": str(files.server_key),
        **changes,
    }
    return ServerOptions(**settings)


@pytest.fixture(scope="module")
def tls_server(tls_files: TLSFiles) -> Iterator[LMServer]:
    """A TLS server that requires client certificates signed by the test CA."""
    with run_in_thread(tls_options(tls_files, tls_ca_cert_file=str(tls_files.ca_cert))) as server:
        yield server


def lms_url(server: LMServer, files: TLSFiles, *, client_certificate: bool = True) -> str:
    return f"lms://127.0.0.1:{server.port}?" + tls_query(
        files, client_certificate=client_certificate
    )


def random_obj(nbytes: int, seed: int) -> MemoryObj:
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)
    return MemoryObj(raw, (nbytes,), torch.uint8, MemoryFormat.BINARY)


def run(coroutine: Any, timeout: float = 60.0) -> Any:
    async def bounded() -> Any:
        return await asyncio.wait_for(coroutine, timeout)

    return asyncio.run(bounded())


def errors_of(server: LMServer, kind: str) -> int:
    async def read() -> int:
        return server.protocol_errors[kind]

    return int(asyncio.run_coroutine_threadsafe(read(), server.loop).result(10))


# -- round trips ----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["extended", "plain"])
def test_objects_round_trip_bit_exact_over_tls(
    tls_server: LMServer, tls_files: TLSFiles, mode: str
) -> None:
    """Sizes around the channel's read and write chunks (64 KiB records read, 256 KiB
    encrypted at a time) and a large object, single and batched, both modes."""
    sizes = [1, 16 * 1024 - 1, 64 * 1024 + 7, 256 * 1024 + 1, 8 * 1024 * 1024 + 3]
    keys = [kvplug.CacheKey(f"tls-{mode}", 1, 0, n) for n in range(len(sizes))]

    async def main() -> None:
        backend = await kvplug.open_backend(lms_url(tls_server, tls_files), mode=mode)
        assert isinstance(backend, LMBackend) and backend.mode == mode
        try:
            objects = [random_obj(size, seed) for seed, size in enumerate(sizes)]
            await backend.put(keys[0], objects[0])
            await backend.batched_put(keys[1:], objects[1:])
            got = [await backend.get(keys[0]), *await backend.batched_get(keys[1:])]
            for expected, read in zip(objects, got, strict=True):
                assert read is not None and torch.equal(read.raw, expected.raw)
                read.release()
            into = torch.zeros(sizes[-1], dtype=torch.uint8)
            target = MemoryObj(into, (sizes[-1],), torch.uint8, MemoryFormat.BINARY)
            assert await backend.get_into(keys[-1], target)
            assert torch.equal(into, objects[-1].raw)
            assert await backend.batched_exists([*keys, kvplug.CacheKey("absent", 1, 0, 0)]) == [
                *[True] * len(keys),
                False,
            ]
        finally:
            await backend.close()

    run(main())


def test_the_connection_is_tls_with_the_certificates_checked(
    tls_server: LMServer, tls_files: TLSFiles
) -> None:
    async def main() -> tuple[str | None, Any]:
        backend = await kvplug.open_backend(lms_url(tls_server, tls_files))
        try:
            async with backend._pool.lease() as connection:  # type: ignore[attr-defined]
                assert connection is not None and connection.tls is not None
                return connection.tls.version, connection.tls.peer_certificate()
        finally:
            await backend.close()

    version, certificate = run(main())
    assert version in ("TLSv1.2", "TLSv1.3")
    assert ("IP Address", "127.0.0.1") in certificate["subjectAltName"]


# -- refusals -------------------------------------------------------------------------------


def test_a_server_certificate_of_an_unknown_ca_fails_the_open_naming_the_cause(
    tls_server: LMServer, other_ca: TLSFiles, tls_files: TLSFiles
) -> None:
    url = f"lms://127.0.0.1:{tls_server.port}?ssl_ca_certs={other_ca.ca_cert}"
    url += f"&ssl_certfile={tls_files.client_cert}&ssl_keyfile={tls_files.client_key}"
    with pytest.raises(BackendUnavailable) as refused:
        run(kvplug.open_backend(url))
    text = str(refused.value)
    assert "TLS handshake" in text and "the server's certificate failed the check" in text
    assert "ssl_ca_certs" in text


def test_a_client_without_a_certificate_is_refused_and_counted(
    tls_server: LMServer, tls_files: TLSFiles
) -> None:
    before = errors_of(tls_server, "tls")
    with pytest.raises(BackendUnavailable) as refused:
        run(kvplug.open_backend(lms_url(tls_server, tls_files, client_certificate=False)))
    assert "ssl_certfile" in str(refused.value)
    assert errors_of(tls_server, "tls") == before + 1


def test_a_client_certificate_of_another_ca_is_refused(
    tls_server: LMServer, tls_files: TLSFiles, other_ca: TLSFiles
) -> None:
    url = f"lms://127.0.0.1:{tls_server.port}?ssl_ca_certs={tls_files.ca_cert}"
    url += f"&ssl_certfile={other_ca.client_cert}&ssl_keyfile={other_ca.client_key}"
    with pytest.raises(BackendUnavailable):
        run(kvplug.open_backend(url))


def test_a_plain_client_of_a_tls_server_fails_and_the_server_keeps_serving(
    tls_server: LMServer, tls_files: TLSFiles
) -> None:
    before = errors_of(tls_server, "tls")
    with pytest.raises(BackendUnavailable):
        run(kvplug.open_backend(f"lm://127.0.0.1:{tls_server.port}?connect_timeout=5"))
    assert errors_of(tls_server, "tls") == before + 1

    async def still_serving() -> bool:
        backend = await kvplug.open_backend(lms_url(tls_server, tls_files))
        try:
            return await backend.batched_exists([kvplug.CacheKey("x", 1, 0, 1)]) == [False]
        finally:
            await backend.close()

    assert run(still_serving())


def test_a_tls_client_of_a_plain_server_fails_its_handshake(tls_files: TLSFiles) -> None:
    with run_in_thread(ServerOptions(port=0, max_memory=1 << 20)) as plain:
        url = f"lms://127.0.0.1:{plain.port}?" + tls_query(tls_files, client_certificate=True)
        with pytest.raises(BackendUnavailable) as refused:
            run(kvplug.open_backend(url))
    assert "TLS handshake" in str(refused.value)


def test_a_client_that_never_finishes_its_handshake_is_dropped(tls_files: TLSFiles) -> None:
    options = tls_options(tls_files, frame_timeout=0.5)
    with run_in_thread(options) as server:

        async def stall() -> bytes:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(b"\x16\x03\x01")  # the start of a ClientHello, then nothing
            try:
                return await asyncio.wait_for(reader.read(), 10)
            finally:
                writer.close()

        assert run(stall()) == b""  # closed by the server after --frame-timeout


# -- options --------------------------------------------------------------------------------


def test_tls_options_on_a_plain_url_are_refused_not_ignored(tls_files: TLSFiles) -> None:
    with pytest.raises(InvalidBackendURL) as refused:
        LMBackend(f"lm://127.0.0.1:1?ssl_ca_certs={tls_files.ca_cert}")
    assert "ssl_ca_certs" in str(refused.value) and "lms://" in str(refused.value)


def test_a_missing_pem_file_fails_at_creation_naming_the_option(tmp_path: Path) -> None:
    with pytest.raises(InvalidBackendURL) as refused:
        LMBackend(f"lms://127.0.0.1:1?ssl_ca_certs={tmp_path}/nothing.pem")
    assert "ssl_ca_certs" in str(refused.value) and "nothing.pem" in str(refused.value)
    assert isinstance(refused.value, InvalidBackendURL)


def test_the_server_needs_both_certificate_and_key(tls_files: TLSFiles) -> None:
    with pytest.raises(ValueError, match="tls_cert_file and tls_key_file"):
        ServerOptions(tls_cert_file=str(tls_files.server_cert))
    with pytest.raises(ValueError, match="tls_ca_cert_file"):
        ServerOptions(tls_ca_cert_file=str(tls_files.ca_cert))


def test_the_server_refuses_to_start_with_unreadable_tls_files(
    tls_files: TLSFiles, tmp_path: Path
) -> None:
    missing_key = tls_options(tls_files, tls_key_file=str(tmp_path / "none.key"))
    with pytest.raises(TLSFilesError, match="is not a readable file"), run_in_thread(missing_key):
        pass
    wrong_key = tls_options(tls_files, tls_key_file=str(tls_files.client_key))
    with pytest.raises(TLSFilesError, match="could not be loaded"), run_in_thread(wrong_key):
        pass


def test_the_command_line_serves_tls_and_says_so(tls_files: TLSFiles) -> None:
    with LMServerProcess(tls=tls_files, client_certificates=True) as server:
        assert server.url.startswith("lms://")
        assert not health(server.port)  # a plain HEALTH gets no answer
        assert "TLS on, client certificates required" in server.log_path.read_text()

        async def main() -> bool:
            backend = await kvplug.open_backend(server.url)
            try:
                key = kvplug.CacheKey("cli", 1, 0, 1)
                await backend.put(key, random_obj(1000, 5))
                return await backend.contains(key)
            finally:
                await backend.close()

        assert run(main())


def test_a_bad_tls_file_on_the_command_line_exits_with_the_cause(
    tls_files: TLSFiles, tmp_path: Path
) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvplug_lm.server",
            "--port",
            "0",
            "--tls-cert-file",
            str(tls_files.server_cert),
            "--tls-key-file",
            str(tmp_path / "missing.key"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "missing.key" in done.stderr and "is not a readable file" in done.stderr
    done = subprocess.run(
        [sys.executable, "-m", "kvplug_lm.server", "--tls-cert-file", str(tls_files.server_cert)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "tls_key_file" in done.stderr
