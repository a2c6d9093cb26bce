"""The GPUDirect Storage tier, gds:// and weka:// (kvplug_disk.gds), on a machine without a GPU.

Everything around the data movement is checked here, with the payloads moved by
``gds_standin.PosixStandIn`` (pread/pwrite on host memory) in place of cuFile: the
plugin imports and is discovered without a GPU or libcufile, opening it there is a clear
error, URLs and options are validated, the file format is file://'s (each reads the other's
files), objects of other instances are found on demand, torn and damaged files read as
counted misses, sharding by GPU, cuFile's mode detection and WekaFS mount checks (the
contract suite: test_gds_contract.py). What gds:// shares with file:// (the layout, staging,
the index rebuilt at open, sharing a directory, sharding by hash, hostile keys) is checked for
both schemes in test_disk_schemes.py. The real cuFile path is test_gds_cuda.py, on a GPU
machine.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from disk_helpers import (
    fill,
    key,
    leak_checked_allocator,
    object_files,
    put_seeded,
    read_back,
    run,
    seeded_bytes,
    small_filesystem,
)
from gds_standin import PosixStandIn

import kvplug
from kvplug import CacheKey, ConfigError, FreeListAllocator, MemoryFormat
from kvplug.errors import InvalidBackendURL, UnknownOption
from kvplug.frame import encode_header
from kvplug_disk.backend import DiskBackend
from kvplug_disk.fileio.cufile import CuFileError, _signed
from kvplug_disk.gds import scheme as gds_scheme
from kvplug_disk.gds.backend import GdsBackend, GdsUnavailable, WekaBackend
from kvplug_disk.gds.environment import detect_mode, mount_of, strip_json_comments, udev_hint
from kvplug_disk.gds.scheme import GdsScheme
from kvplug_disk.layout import (
    BLOCK,
    FLAG_NO_PAYLOAD_CHECKSUM,
    TEMP_NAME,
    WRITER_LOCK_NAME,
    decode_block,
    digest,
    encode_block,
    file_length,
    object_name,
)

MiB = 1 << 20
NO_GPU = not torch.cuda.is_available()


allocator = pytest.fixture(leak_checked_allocator, name="allocator")


async def open_gds(
    url: str, allocator: FreeListAllocator, io: PosixStandIn | None = None, **options: Any
) -> GdsBackend:
    backend = await kvplug.open_backend(
        url, allocator=allocator, file_io=io or PosixStandIn(), **options
    )
    assert isinstance(backend, GdsBackend)
    return backend


# -- without a GPU -----------------------------------------------------------------------------


def test_the_plugin_imports_and_is_discovered_without_a_gpu_or_cufile() -> None:
    import kvplug_disk

    assert kvplug_disk.GdsBackend is GdsBackend
    assert {"gds", "weka"} <= set(kvplug.available_schemes())
    fresh = subprocess.run(  # a process of its own: another test may have loaded cuFile here
        [
            sys.executable,
            "-c",
            "import sys, kvplug, kvplug_disk.gds.backend; kvplug.available_schemes(); "
            "print('cufile' in sys.modules)",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert fresh.stdout.strip() == "False"  # cuFile is loaded only when a URL is opened
    assert GdsBackend.capabilities.device_memory
    assert GdsBackend.capabilities.shared_across_processes


@pytest.mark.skipif(not NO_GPU, reason="checks the error on a machine without a CUDA GPU")
@pytest.mark.parametrize("scheme", ["gds", "weka"])
def test_opening_without_a_gpu_says_what_is_missing_and_points_to_file(
    tmp_path: Path, scheme: str
) -> None:
    query = "?allow_non_weka=true" if scheme == "weka" else ""
    with pytest.raises(GdsUnavailable) as refused:
        run(kvplug.open_backend(f"{scheme}://{tmp_path}/kv{query}"))
    message = str(refused.value)
    assert "no CUDA GPU" in message
    assert "cufile-python" in message and "libcufile" in message
    assert "file:///dir" in message
    assert isinstance(refused.value, ConfigError)
    assert not (tmp_path / "kv").exists()


def test_a_missing_libcufile_is_named_with_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = tmp_path / "site" / "cufile"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        "raise OSError('libcufile.so: cannot open shared object file: No such file')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, "cufile", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(GdsUnavailable) as refused:
        run(kvplug.open_backend(f"gds://{tmp_path}/kv"))
    message = str(refused.value)
    assert "could not load libcufile.so" in message and "LD_LIBRARY_PATH" in message
    assert "file:///dir" in message


def test_a_missing_cufile_python_is_named_with_its_pip_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "cufile", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(GdsUnavailable, match=r"pip install 'kvplug-disk\[gds\]'"):
        run(kvplug.open_backend(f"gds://{tmp_path}/kv"))


def test_bad_urls_and_options_are_clear_errors(tmp_path: Path) -> None:
    for url, error, words in (
        ("gds://", InvalidBackendURL, "gds:///var/cache/kvplug"),
        ("gds://host/dir", InvalidBackendURL, "three slashes"),
        (f"gds://{tmp_path},relative", InvalidBackendURL, "not an absolute path"),
        (f"gds://{tmp_path}?shard=round_robin", UnknownOption, "'hash'.*'by_gpu'"),
        (f"gds://{tmp_path}?device=gpu0", UnknownOption, "'cuda' or 'cuda:N'"),
        (f"gds://{tmp_path}?buffer_size=1KiB", UnknownOption, "at least"),
        (f"gds://{tmp_path}?buffer_sise=1GiB", UnknownOption, "Did you mean 'buffer_size'"),
        (f"gds://{tmp_path}?allow_non_weka=true", UnknownOption, "allow_non_weka"),
        (f"weka://{tmp_path}?o_direct=false", ConfigError, "always uses O_DIRECT"),
    ):
        with pytest.raises(error, match=words):
            kvplug.create_backend(url)
    backend = kvplug.create_backend(f"gds://{tmp_path}?shard=BY_GPU&device=cuda:3")
    assert isinstance(backend, GdsBackend)
    assert backend.options.shard == "by_gpu" and backend.device_index == 3


# -- the file format through the stand-in ------------------------------------------------------


@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.uint8]
)
def test_every_kv_dtype_and_shape_round_trips_bit_exact(
    tmp_path: Path, allocator: FreeListAllocator, dtype: torch.dtype
) -> None:
    async def scenario() -> None:
        gds = await open_gds(f"gds://{tmp_path}", allocator)
        for n, shape in enumerate([(2, 4, 1, 8), (2, 4, 256, 128), (0,)]):
            obj = allocator.allocate(shape, dtype, MemoryFormat.KV_2LTD)
            assert obj is not None
            obj.raw.copy_(seeded_bytes(obj.nbytes, n))
            await gds.put(key(n), obj)
            got = await gds.get(key(n))
            assert got is not None
            assert (got.shape, got.dtype, got.fmt) == (obj.shape, dtype, MemoryFormat.KV_2LTD)
            assert torch.equal(got.raw, obj.raw)
            got.release()
            obj.release()
        await gds.close()

    run(scenario())


def test_file_and_gds_read_each_others_objects(
    tmp_path: Path, allocator: FreeListAllocator
) -> None:
    async def scenario() -> None:
        gds = await open_gds(f"gds://{tmp_path}", allocator)
        await put_seeded(gds, allocator, key(1), 5000, seed=1)
        await gds.close()
        disk = await kvplug.open_backend(f"file://{tmp_path}", allocator=allocator)
        assert isinstance(disk, DiskBackend)
        back = await read_back(disk, key(1))
        assert back is not None and torch.equal(back, seeded_bytes(5000, 1))
        await put_seeded(disk, allocator, key(2), 7000, seed=2)
        await disk.close()
        gds = await open_gds(f"gds://{tmp_path}", allocator)
        back = await read_back(gds, key(2))
        assert back is not None and torch.equal(back, seeded_bytes(7000, 2))
        await gds.close()

    run(scenario())


def write_unchecksummed(root: Path, k: CacheKey, payload: bytes, *, cut: int = 0) -> Path:
    """An object file as gds:// writes one from GPU memory: payload checksum not computed."""
    text = k.to_string()
    subdir, name = object_name(text)
    frame = encode_header(
        (len(payload),), torch.uint8, MemoryFormat.BINARY_BUFFER, "naive", payload, 0
    )
    block = encode_block(frame, text, FLAG_NO_PAYLOAD_CHECKSUM)
    body = payload + bytes(file_length(len(payload)) - BLOCK - len(payload))
    path = root / subdir / name
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    data = block + body
    path.write_bytes(data[: len(data) - cut] if cut else data)
    return path


@pytest.mark.parametrize("scheme", ["file", "gds"])
def test_objects_written_from_gpu_memory_are_length_checked_not_checksummed(
    tmp_path: Path, allocator: FreeListAllocator, scheme: str
) -> None:
    payload = seeded_bytes(9000, 3).numpy().tobytes()
    root = tmp_path / "kv"
    root.mkdir(mode=0o700)
    write_unchecksummed(root, key(1), payload)
    truncated = write_unchecksummed(root, key(2), payload, cut=BLOCK)

    async def scenario() -> None:
        options: dict[str, Any] = {"file_io": PosixStandIn()} if scheme == "gds" else {}
        backend = await kvplug.open_backend(f"{scheme}://{root}", allocator=allocator, **options)
        back = await read_back(backend, key(1))
        assert back is not None and back.numpy().tobytes() == payload
        assert await read_back(backend, key(2)) is None
        await backend.close()

    run(scenario())
    assert not truncated.exists()


def test_header_flags_round_trip_and_unknown_flags_are_refused() -> None:
    frame = encode_header((4,), torch.uint8, MemoryFormat.BINARY_BUFFER, "naive", bytes(4))
    assert not decode_block(encode_block(frame, "k", FLAG_NO_PAYLOAD_CHECKSUM)).payload_checksummed
    assert decode_block(encode_block(frame, "k")).payload_checksummed
    with pytest.raises(ValueError, match="unknown header flags"):
        encode_block(frame, "k", 0x8)


# -- sharing, damage ---------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage", "extend"])
def test_damaged_files_read_as_counted_misses_and_are_removed(
    tmp_path: Path, allocator: FreeListAllocator, damage: str
) -> None:
    async def scenario() -> None:
        gds = await open_gds(f"gds://{tmp_path}", allocator)
        await put_seeded(gds, allocator, key(1), 20_000, seed=1)
        (path,) = object_files(tmp_path)
        data = bytearray(path.read_bytes())
        if damage == "flip":
            data[BLOCK + 12_345] ^= 0x40
        elif damage == "truncate":
            del data[BLOCK + 8192 :]
        elif damage == "garbage":
            data[:BLOCK] = b"\xff" * BLOCK
        else:
            data += bytes(BLOCK)
        path.write_bytes(bytes(data))
        assert await gds.get(key(1)) is None
        assert gds.corrupt_objects == 1 and not path.exists()
        assert not await gds.contains(key(1))
        await gds.close()

    run(scenario())


def test_a_damaged_file_of_another_instance_is_removed_when_found(
    tmp_path: Path, allocator: FreeListAllocator
) -> None:
    async def scenario() -> None:
        reader = await open_gds(f"gds://{tmp_path}", allocator)
        writer = await open_gds(f"gds://{tmp_path}", allocator)
        await put_seeded(writer, allocator, key(1), 8192, seed=1)
        (path,) = object_files(tmp_path)
        with path.open("r+b") as handle:
            handle.truncate(BLOCK + 100)
        assert not await reader.contains(key(1))
        assert reader.corrupt_objects == 1 and not path.exists()
        await reader.close()
        await writer.close()

    run(scenario())


def test_temporary_files_are_removed_at_open_only_when_stale(
    tmp_path: Path, allocator: FreeListAllocator
) -> None:
    """On a shared mount a temporary file may belong to a writer on another host, whose lock
    may not be visible here: one whose writer holds no lock is removed only once it is older
    than TEMP_GRACE, whatever its pid (a reused pid, here this live process's, says nothing);
    one whose writer holds its lock is kept however old."""
    root = tmp_path / "kv"
    (root / "ab").mkdir(mode=0o700, parents=True)
    root.chmod(0o700)
    stem = "ab" + "0" * 30
    dead_pid = 2**22 + 12345
    fresh = root / "ab" / f".{stem}.{dead_pid}.{'1' * 16}.tmp"
    stale = root / "ab" / f".{stem}.{dead_pid}.{'2' * 16}.tmp"
    recycled = root / "ab" / f".{stem}.{os.getpid()}.{'3' * 16}.tmp"
    old = time.time() - gds_scheme.TEMP_GRACE - 60

    async def scenario() -> None:
        holder = await open_gds(f"gds://{root}", allocator)  # a live writer: its lock is held
        (lock,) = [p for p in root.iterdir() if WRITER_LOCK_NAME.fullmatch(p.name)]
        match = WRITER_LOCK_NAME.fullmatch(lock.name)
        assert match is not None
        live = root / "ab" / f".{stem}.{match.group(1)}.{match.group(2)}.0a0b0c0d.tmp"
        for path in (fresh, stale, recycled, live):
            path.write_bytes(b"half")
        for path in (stale, recycled, live):
            os.utime(path, (old, old))
        gds = await open_gds(f"gds://{root}", allocator)
        assert gds.rebuild_stats["temp_removed"] == 2
        assert gds.rebuild_stats["temp_in_use"] == 2
        assert gds.stats()["temp_bytes"] == 2 * len(b"half")
        assert fresh.exists() and live.exists()
        assert not stale.exists() and not recycled.exists()
        await gds.close()
        live.unlink()
        await holder.close()

    run(scenario())


# -- sharding ----------------------------------------------------------------------------------


def test_by_gpu_sharding_puts_each_gpus_objects_in_its_directory_and_reads_all(
    tmp_path: Path, allocator: FreeListAllocator
) -> None:
    dirs = [tmp_path / name for name in ("a", "b", "c")]
    url = "gds://" + ",".join(str(d) for d in dirs) + "?shard=by_gpu"

    async def scenario() -> None:
        writers = [await open_gds(f"{url}&device=cuda:{index}", allocator) for index in (4, 2)]
        for index, writer in enumerate(writers):
            for n in range(5):
                await put_seeded(writer, allocator, key(10 * index + n), 100, seed=n)
        reader = await open_gds(f"{url}&device=cuda:0", allocator)
        for index in range(2):
            for n in range(5):
                back = await read_back(reader, key(10 * index + n))
                assert back is not None and torch.equal(back, seeded_bytes(100, n))
        for backend in (*writers, reader):
            await backend.close()

    run(scenario())
    assert [len(object_files(d)) for d in dirs] == [0, 5, 5]  # cuda:4 -> 4 % 3, cuda:2 -> 2


# -- cuFile's environment ----------------------------------------------------------------------


def test_cufile_mode_is_read_from_the_driver_config_and_environment(tmp_path: Path) -> None:
    config = tmp_path / "cufile.json"
    env = {"CUFILE_ENV_PATH_JSON": str(config)}
    driver = tmp_path / "proc" / "driver" / "nvidia-fs"

    def write(text: str) -> None:
        config.write_text(text)

    write('{\n // "allow_compat_mode": false,\n "properties": {"allow_compat_mode": true}}')
    assert detect_mode(env, root=str(tmp_path)).mode == "compat"
    driver.mkdir(parents=True)
    detected = detect_mode(env, root=str(tmp_path))
    assert (detected.mode, detected.usable, detected.weka_write_compat) == ("gds", True, True)
    write(
        '{"properties": {"force_compat_mode": true}, "fs": {"weka": {"rdma_write_support": true}}}'
    )
    detected = detect_mode(env, root=str(tmp_path))
    assert detected.mode == "compat" and "force_compat_mode" in detected.reason
    assert not detected.weka_write_compat
    assert detect_mode({**env, "CUFILE_FORCE_COMPAT_MODE": "true"}, root=str(tmp_path)).mode == (
        "compat"
    )
    driver.rmdir()
    write('{"properties": {"allow_compat_mode": false}}')
    assert not detect_mode(env, root=str(tmp_path)).usable
    assert detect_mode({"CUFILE_ENV_PATH_JSON": str(tmp_path / "none")}, str(tmp_path)).usable


def test_json_comments_are_stripped_outside_strings_only() -> None:
    text = '{"path": "a//b", // note\n "x": "\\"//\\""}'
    assert strip_json_comments(text) == '{"path": "a//b", \n "x": "\\"//\\""}'


def test_the_mount_of_a_path_is_the_longest_mount_point_holding_it(tmp_path: Path) -> None:
    mounts = tmp_path / "mounts"
    mounts.write_text(
        "/dev/vda / ext4 rw 0 0\n"
        "weka0 /mnt/weka wekafs rw 0 0\n"
        "weka1 /mnt/weka\\040two wekafs rw 0 0\n"
        "tmpfs /mnt/wekaish tmpfs rw 0 0\n"
    )
    assert mount_of("/mnt/weka/kv/deeper", str(mounts)) == ("/mnt/weka", "wekafs")
    assert mount_of("/mnt/weka two/kv", str(mounts)) == ("/mnt/weka two", "wekafs")
    assert mount_of("/mnt/wekaish/kv", str(mounts)) == ("/mnt/wekaish", "tmpfs")
    assert mount_of("/srv", str(mounts)) == ("/", "ext4")
    assert mount_of("/srv", str(tmp_path / "absent")) is None


def test_a_full_disk_at_open_is_told_apart_from_a_filesystem_refusing_o_direct(
    tmp_path: Path, allocator: FreeListAllocator, caplog: pytest.LogCaptureFixture
) -> None:
    """A real filesystem with no byte free when the tier opens: the O_DIRECT probe and the
    cuFile probe cannot run, which says nothing about either. weka:// (which needs O_DIRECT)
    refuses to open saying so and to free space, never that the filesystem refuses O_DIRECT;
    gds:// opens with a warning, ``describe()`` shows the directory's state and its cause,
    and once space is freed puts and gets work."""
    with small_filesystem("tmpfs", tmp_path / "mnt") as mount:
        root = mount / "kv"
        root.mkdir(mode=0o700)
        filler = fill(mount)

        async def scenario() -> None:
            with pytest.raises(ConfigError) as refused:
                await kvplug.open_backend(
                    f"weka://{root}?allow_non_weka=true",
                    allocator=allocator,
                    file_io=PosixStandIn(),
                )
            message = str(refused.value)
            assert "could not run" in message and "ENOSPC" in message, message
            assert "free space" in message and "refuse" not in message, message
            assert "WekaFS mount" not in message, message

            caplog.clear()
            gds = await open_gds(f"gds://{root}", allocator)
            try:
                described = gds.describe()["directories"]
                assert described.startswith(str(root)) and "ENOSPC" in described, described
                assert "buffered for now" in described, described
                assert any(
                    "cuFile I/O could not be tried" in r.getMessage() for r in caplog.records
                )
                filler.unlink()
                await put_seeded(gds, allocator, key(1), 5000, seed=1)
                back = await read_back(gds, key(1))
                assert back is not None and torch.equal(back, seeded_bytes(5000, 1))
            finally:
                await gds.close()

        run(scenario())


def test_weka_refuses_a_directory_that_is_not_on_wekafs(
    tmp_path: Path, allocator: FreeListAllocator, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gds_scheme, "mount_of", lambda path: ("/", "ext4"))
    with pytest.raises(ConfigError, match="not on WekaFS") as refused:
        run(
            kvplug.open_backend(
                f"weka://{tmp_path}/kv", allocator=allocator, file_io=PosixStandIn()
            )
        )
    assert "allow_non_weka=true" in str(refused.value)

    async def allowed(url: str) -> None:
        weka = await kvplug.open_backend(url, allocator=allocator, file_io=PosixStandIn())
        assert isinstance(weka, WekaBackend)
        await put_seeded(weka, allocator, key(1), 5000, seed=1)
        back = await read_back(weka, key(1))
        assert back is not None and torch.equal(back, seeded_bytes(5000, 1))
        await weka.close()

    run(allowed(f"weka://{tmp_path}/kv?allow_non_weka=true"))
    monkeypatch.setattr(gds_scheme, "mount_of", lambda path: ("/mnt/weka", "wekafs"))
    run(allowed(f"weka://{tmp_path}/kv"))


def test_cufile_errors_name_the_status_and_the_udev_fix(tmp_path: Path) -> None:
    error = CuFileError("cuFileHandleRegister", 5027)
    assert "5027 (HANDLE_NOT_REGISTERED)" in str(error) and error.errno == 5
    hint = udev_hint(str(tmp_path), error)
    device = tmp_path.stat().st_dev
    assert f"/run/udev/data/b{os.major(device)}:{os.minor(device)}" in hint
    assert "ID_FS_USAGE=filesystem" in hint
    assert udev_hint(str(tmp_path), CuFileError("cuFileRead", 5030)) == ""
    assert _signed(2**64 - 5027) == -5027 and _signed(4096) == 4096


def test_the_mode_is_logged_once_and_described(
    tmp_path: Path, allocator: FreeListAllocator, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> dict[str, str]:
        gds = await open_gds(f"gds://{tmp_path}?shard=by_gpu&device=cuda:1", allocator)
        details = gds.describe()
        await gds.close()
        return details

    with caplog.at_level(logging.DEBUG, logger="kvplug.gds"):
        details = run(scenario())
        run(scenario())
    assert details["mode"] == "posix-stand-in" and details["device"] == "cuda:1"
    assert "O_DIRECT" in details["directories"] or "buffered" in details["directories"]
    infos = [
        r for r in caplog.records if r.levelno >= logging.INFO and "payloads move" in r.message
    ]
    assert len(infos) <= 1  # once per process (an earlier test may have logged it already)


def test_close_drops_the_registrations_of_this_backend(
    tmp_path: Path, allocator: FreeListAllocator
) -> None:
    io = PosixStandIn()

    async def scenario() -> None:
        gds = await open_gds(f"gds://{tmp_path}", allocator, io)
        await put_seeded(gds, allocator, key(1), 5000, seed=1)
        assert io.registered(allocator.buffer)
        await gds.close()
        await gds.close()

    run(scenario())
    assert not io.registered(allocator.buffer)


def test_key_digest_names_match_the_disk_layout() -> None:
    text = key(7).to_string()
    assert object_name(text) == (digest(text)[:2], digest(text) + ".kv")


def test_kvplug_check_reports_the_mode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``kvplug check gds://...`` round-trips objects and prints what describe() says."""
    from click.testing import CliRunner

    from kvplug.runtime.cli import main

    monkeypatch.setattr(GdsScheme, "default_file_io", lambda self: PosixStandIn())
    result = CliRunner().invoke(
        main, ["check", f"gds://{tmp_path}", "--shape", "2,4,16,8", "--rounds", "2"]
    )
    assert result.exit_code == 0, result.output
    output = result.output.replace("\n", "")
    assert "device_memory" in output and "mode: posix-stand-in" in output
    assert f"directories: {tmp_path}" in output


def test_a_file_replaced_while_it_is_read_is_read_through_a_link_of_its_own(
    tmp_path: Path, allocator: FreeListAllocator
) -> None:
    """cuFile refuses to register a descriptor of a deleted file (5031, GETNEWFD_FAILED). A
    read whose file a writer replaced meanwhile reads the file there now through a hard link
    of its own, which no writer can delete: here a writer replaces the file before each
    registration, and the read still returns a whole object, the second one."""
    replacements: list[Any] = []

    class RefusesDeletedFiles(PosixStandIn):
        def open(self, fd: int) -> Any:
            if replacements:
                replacements.pop(0)()
            if os.fstat(fd).st_nlink == 0:
                raise CuFileError("cuFileHandleRegister", 5031)
            return fd

    async def scenario() -> None:
        reader = await open_gds(f"gds://{tmp_path}", allocator, RefusesDeletedFiles())
        writer = await open_gds(f"gds://{tmp_path}", allocator)
        await put_seeded(writer, allocator, key(1), 5000, seed=1)
        for size, seed in ((5000, 2), (5000, 3)):
            replacements.append(
                partial(asyncio.run, put_seeded(writer, allocator, key(1), size, seed=seed))
            )
        back = await read_back(reader, key(1))
        assert back is not None and torch.equal(back, seeded_bytes(5000, 2))
        assert reader.corrupt_objects == 0 and not replacements
        back = await read_back(reader, key(1))
        assert back is not None and torch.equal(back, seeded_bytes(5000, 3))
        await reader.close()
        await writer.close()

    run(scenario())
    assert not [p for p in tmp_path.rglob("*") if TEMP_NAME.fullmatch(p.name)]
