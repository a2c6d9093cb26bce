"""A time-bounded fuzz run of lm:// frame handling: the wire parsers and a live server.

Two targets, each run for ``--seconds``:

* ``wire``: every parser of :mod:`kvplug_lm.wire` on the input, in process. A crash is any
  exception other than :class:`~kvplug_lm.wire.WireError`, or a frame that passes its check
  but does not survive a pack/unpack round trip.
* ``server``: an in-process ``kvplug lm-server`` (its own loop thread, small limits) fed each
  input on a fresh connection, half-closed after it. A crash is: the connection is not
  closed after the client's EOF, a fresh connection's HEALTH no longer answers, the server
  logged an error, or the allocator holds bytes beyond the stored objects (a leaked receive
  buffer) once the connection is gone.

The engine is atheris (coverage-guided libFuzzer, ``pip install atheris``) when it imports,
otherwise a seeded mutation fuzzer of valid frames (``--engine mutate`` forces it). Seeds
are valid frames of both modes. Each target prints one summary line (inputs, inputs/s), and
a crash prints the reason and writes the input to ``--crash-dir``; the exit status is then 1.

    python scripts/fuzz_lm.py --seconds 60                 # both targets, 60 s each
    python scripts/fuzz_lm.py --target server --engine mutate --seconds 30
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "plugins" / "lm" / "tests"))

# Imported before atheris instruments anything, so that only kvplug_lm is instrumented.
import torch  # noqa: E402,F401
import xxhash  # noqa: E402,F401

import kvplug.memory  # noqa: E402,F401

try:
    import atheris
except ImportError:  # the mutation engine needs nothing more
    atheris = None

if atheris is not None:
    with atheris.instrument_imports(include=["kvplug_lm"]):
        from kvplug_lm import server as lm_server
        from kvplug_lm import wire
else:
    from kvplug_lm import server as lm_server
    from kvplug_lm import wire

from lm_hostile_helpers import (  # noqa: E402
    ErrorLog,
    exchange,
    inflight_bytes,
    wait_until,
)

from kvplug_testing.lm import health  # noqa: E402
from kvplug_testing.ports import free_port  # noqa: E402

Command = wire.Command
Op = wire.Op


class Crash(Exception):
    """What the target saw go wrong on one input."""


# -- seeds ------------------------------------------------------------------------------------


def seeds() -> list[bytes]:
    """Valid frames of both modes (and a few invalid ones) to start mutating from."""
    key = b"fuzz-model@1@0@1f2e@half"
    payload = bytes(range(256)) * 2
    put = wire.pack_plain_request(
        Command.PUT, key, length=len(payload), fmt=1, dtype=2, shape=(2, 128)
    )
    hello = wire.pack_plain_request(Command.HEALTH, wire.HELLO_KEY)
    meta = wire.pack_meta(wire.Meta(1, 2, (2, 4, 8)))
    ext_put = wire.pack_ext_request(
        Op.PUT, request_id=1, key=key, meta=meta, payload_len=64, checksum=wire.checksum(bytes(64))
    )
    keys = wire.pack_keys([key, b"other@1@0@0@half"])
    return [
        put + payload,
        put + payload + wire.pack_plain_request(Command.GET, key),
        wire.pack_plain_request(Command.EXIST, key),
        wire.pack_plain_request(Command.HEALTH, b"health@1@0@0@half"),
        wire.pack_plain_request(Command.LIST, b""),
        hello + ext_put + bytes(64) + wire.pack_ext_request(Op.GET, request_id=2, key=key),
        hello + wire.pack_ext_request(Op.EXISTS_MANY, request_id=3, payload_len=len(keys)) + keys,
        hello + wire.pack_ext_request(Op.DELETE, request_id=4, key=key),
        hello + wire.pack_ext_request(Op.LIST, request_id=5),
        hello + wire.pack_ext_request(Op.PING, request_id=6),
        hello + wire.pack_ext_request(Op.AUTH, request_id=7, payload_len=32) + bytes(32),
        meta,
        keys,
        wire.pack_plain_reply(wire.Code.SUCCESS, length=8, shape=(4,)),
        wire.pack_hello_reply(wire.Hello(bytes(32), 150, 1 << 20, False)),
        wire.pack_ext_reply(wire.Status.OK, request_id=9, meta=meta, payload_len=8),
    ]


INTERESTING = [
    0,
    1,
    -1,
    2,
    5,
    6,
    7,
    8,
    9,
    150,
    151,
    186,
    200,
    400,
    0x7FFFFFFF,
    -0x80000000,
    0xFFFF,
    1 << 20,
    (1 << 20) + 1,
    1 << 24,
]


def mutate(rng: random.Random, corpus: list[bytes]) -> bytes:
    """A mutation of one corpus entry: one to four byte-level edits, or a splice."""
    data = bytearray(rng.choice(corpus))
    for _ in range(rng.randint(1, 4)):
        choice = rng.randrange(8)
        if choice == 0 and data:  # flip bits
            index = rng.randrange(len(data))
            data[index] ^= 1 << rng.randrange(8)
        elif choice == 1 and data:  # a random byte
            data[rng.randrange(len(data))] = rng.randrange(256)
        elif choice == 2 and len(data) >= 4:  # an interesting int32 at a field boundary
            offset = (
                rng.randrange(0, len(data) - 3, 4)
                if rng.random() < 0.8
                else rng.randrange(len(data) - 3)
            )
            value = rng.choice(INTERESTING) & 0xFFFFFFFF
            data[offset : offset + 4] = struct.pack("<I", value)
        elif choice == 3:  # truncate
            del data[rng.randrange(len(data) + 1) :]
        elif choice == 4 and data:  # delete a range
            start = rng.randrange(len(data))
            del data[start : start + rng.randint(1, 64)]
        elif choice == 5:  # insert random bytes
            start = rng.randrange(len(data) + 1)
            data[start:start] = rng.randbytes(rng.randint(1, 64))
        elif choice == 6:  # splice with another entry
            other = rng.choice(corpus)
            data = data[: rng.randrange(len(data) + 1)] + other[rng.randrange(len(other) + 1) :]
        elif data:  # duplicate a range
            start = rng.randrange(len(data))
            data[start:start] = data[start : start + rng.randint(1, 200)]
    return bytes(data[: 1 << 16])


# -- targets ---------------------------------------------------------------------------------


def _fails_only_with_wire_error(parse: Callable[[], object]) -> object | None:
    try:
        return parse()
    except wire.WireError:
        return None


def wire_target(data: bytes) -> None:
    """Every parser of the wire module on ``data``; properties on what parses."""
    plain_size, ext_size = wire.PLAIN_REQUEST.size, wire.EXT_REQUEST.size
    header = data[:plain_size].ljust(plain_size, b"\0")
    request = wire.unpack_plain_request(header)
    limit = data[0] if data else 150
    try:
        wire.check_plain_request(request, max(limit, 1))
    except wire.WireError:
        pass
    else:
        again = wire.unpack_plain_request(
            wire.pack_plain_request(
                request.command,
                request.key,
                length=request.length,
                fmt=request.fmt,
                dtype=request.dtype,
                shape=request.shape,
            )
        )
        if again != request._replace(location=0):
            raise Crash(f"plain request does not round-trip: {request} -> {again}")
    _fails_only_with_wire_error(lambda: wire.unpack_ext_request(data[:ext_size].ljust(ext_size)))
    meta = _fails_only_with_wire_error(lambda: wire.unpack_meta(data))
    if isinstance(meta, wire.Meta) and wire.pack_meta(meta) != data:
        raise Crash(f"meta {meta} does not round-trip")
    keys = _fails_only_with_wire_error(lambda: wire.unpack_keys(data, 150))
    if isinstance(keys, list) and wire.pack_keys(keys) != data:
        raise Crash(f"keys {keys!r} do not round-trip")
    _fails_only_with_wire_error(lambda: wire.check_key(data, 150))
    reply_size = wire.PLAIN_REPLY.size
    reply = wire.unpack_plain_reply(data[:reply_size].ljust(reply_size, b"\0"))
    if wire.is_kvplug_hello(reply):
        body = data[reply_size : reply_size + wire.HELLO_BODY.size].ljust(wire.HELLO_BODY.size)
        hello = wire.unpack_hello_body(body)
        if wire.unpack_hello_body(wire.pack_hello_reply(hello)[reply_size:]) != hello:
            raise Crash(f"hello {hello} does not round-trip")
    size = wire.EXT_REPLY.size
    _fails_only_with_wire_error(lambda: wire.unpack_ext_reply(data[:size].ljust(size)))


class ServerTarget:
    """A live in-process server with small limits, checked after every input."""

    def __init__(self) -> None:
        self.errors = ErrorLog().__enter__()
        options = lm_server.ServerOptions(
            host="127.0.0.1",
            port=free_port(),
            max_memory=16 << 20,
            max_key_bytes=256,
            max_object_bytes=1 << 20,
            frame_timeout=2.0,
            idle_timeout=30.0,
            min_rate=64 << 10,
            max_connections=64,
        )
        self._context = lm_server.run_in_thread(options)
        self.server = self._context.__enter__()

    def __call__(self, data: bytes) -> None:
        port = self.server.port
        result = exchange(port, data, timeout=15.0)
        if not result.closed:
            raise Crash("the server kept the connection open 15 s after the client's EOF")
        if not health(port, timeout=5.0):
            raise Crash("a fresh connection's HEALTH got no 200")
        if not wait_until(lambda: inflight_bytes(self.server.stats()) == 0, timeout=10.0):
            raise Crash(f"receive buffers not freed: {self.server.stats()}")
        logged = self.errors.take()
        if logged:
            raise Crash("the server logged errors:\n" + "\n".join(logged))

    def close(self) -> None:
        self._context.__exit__(None, None, None)
        self.errors.__exit__()


# -- engines ---------------------------------------------------------------------------------


class Run:
    def __init__(self, name: str, engine: str, seconds: float, crash_dir: Path) -> None:
        self.name = name
        self.engine = engine
        self.seconds = seconds
        self.crash_dir = crash_dir
        self.inputs = 0
        self.started = time.monotonic()

    def summary(self, crashed: bool) -> str:
        elapsed = time.monotonic() - self.started
        return json.dumps(
            {
                "target": self.name,
                "engine": self.engine,
                "inputs": self.inputs,
                "seconds": round(elapsed, 1),
                "inputs_per_second": round(self.inputs / elapsed, 1) if elapsed else 0,
                "crashed": crashed,
            }
        )

    def crash(self, data: bytes, error: BaseException) -> None:
        self.crash_dir.mkdir(parents=True, exist_ok=True)
        path = self.crash_dir / f"crash-{self.name}-{hashlib.sha1(data).hexdigest()[:16]}"
        path.write_bytes(data)
        print(f"CRASH in target {self.name} after {self.inputs} inputs: {error}", flush=True)
        if not isinstance(error, Crash):
            traceback.print_exception(error)
        print(f"input ({len(data)} bytes) saved to {path}: {data[:300].hex()}", flush=True)
        print(self.summary(crashed=True), flush=True)

    def one(self, target: Callable[[bytes], None], data: bytes) -> bool:
        """Run one input; False after a crash."""
        self.inputs += 1
        try:
            target(data)
        except Exception as error:
            self.crash(data, error)
            return False
        return True


def run_mutate(run: Run, target: Callable[[bytes], None], seed: int) -> int:
    rng = random.Random(seed)
    corpus = seeds()
    for data in corpus:
        if not run.one(target, data):
            return 1
    deadline = run.started + run.seconds
    while time.monotonic() < deadline:
        if not run.one(target, mutate(rng, corpus)):
            return 1
    print(run.summary(crashed=False), flush=True)
    return 0


def run_atheris(run: Run, target: Callable[[bytes], None], seed: int) -> int:
    assert atheris is not None
    corpus_dir = Path(tempfile.mkdtemp(prefix=f"fuzz-lm-{run.name}-"))
    for index, data in enumerate(seeds()):
        (corpus_dir / f"seed-{index}").write_bytes(data)
    deadline = run.started + run.seconds

    def test_one_input(data: bytes) -> None:
        # libFuzzer never returns from Fuzz(): end the process here, with the summary.
        if time.monotonic() >= deadline:
            print(run.summary(crashed=False), flush=True)
            shutil.rmtree(corpus_dir, ignore_errors=True)
            os._exit(0)
        if not run.one(target, data):
            shutil.rmtree(corpus_dir, ignore_errors=True)
            os._exit(1)

    atheris.Setup(
        [sys.argv[0], f"-seed={seed}", "-max_len=65536", "-rss_limit_mb=8192", str(corpus_dir)],
        test_one_input,
    )
    atheris.Fuzz()
    return 0


def run_target(name: str, engine: str, seconds: float, seed: int, crash_dir: Path) -> int:
    run = Run(name, engine, seconds, crash_dir)
    server: ServerTarget | None = None
    if name == "wire":
        target: Callable[[bytes], None] = wire_target
    else:
        server = ServerTarget()
        target = server
    try:
        if engine == "atheris":
            return run_atheris(run, target, seed)
        return run_mutate(run, target, seed)
    finally:
        if server is not None:
            server.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="per target")
    parser.add_argument("--target", choices=("wire", "server", "both"), default="both")
    parser.add_argument(
        "--engine",
        choices=("auto", "atheris", "mutate"),
        default="auto",
        help="atheris when it imports (auto), or the seeded mutation fuzzer",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--crash-dir", type=Path, default=Path(tempfile.gettempdir()) / "kvplug-fuzz-lm"
    )
    args = parser.parse_args()
    engine = args.engine
    if engine == "auto":
        engine = "atheris" if atheris is not None else "mutate"
    if engine == "atheris" and atheris is None:
        parser.error("atheris is not installed: pip install atheris, or use --engine mutate")
    if args.target != "both":
        return run_target(args.target, engine, args.seconds, args.seed, args.crash_dir)
    # libFuzzer owns its process until it exits, so each target runs in a child of its own.
    status = 0
    for name in ("wire", "server"):
        child = subprocess.run(
            [
                sys.executable,
                __file__,
                "--target",
                name,
                "--engine",
                engine,
                "--seconds",
                str(args.seconds),
                "--seed",
                str(args.seed),
                "--crash-dir",
                str(args.crash_dir),
            ],
            check=False,
        )
        status = status or child.returncode
    return status


if __name__ == "__main__":
    sys.exit(main())
