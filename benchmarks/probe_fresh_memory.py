"""What fresh memory costs on this machine, and what that does to redis-server's large GETs.

Not a kvplug benchmark: a probe of the machine, run to explain a limit that issue 19's peer
benchmark met (docs/benchmarks.md, "redis batched gets"). Two parts:

1. **first touch:** map anonymous memory 1 GiB at a time, keep it, write one byte per 4 KiB
   page, and print the milliseconds per GiB with the machine's memory in use. On a virtual
   machine whose host backs only part of the guest's memory, the cost steps up where the
   untouched part begins.
2. **redis-server:** store ``--values`` values of ``--value-mib`` MiB, then read them back in
   pipelined ``GET`` batches of 8, a few passes, and print the server's CPU seconds and minor
   page faults per GiB served, first alone, then while a child process keeps ``--hold-gib`` GiB
   touched. redis-server copies every large reply into newly allocated memory, so each GiB
   served takes about 262,144 page faults; what they cost is the machine's.

    .venv/bin/python benchmarks/probe_fresh_memory.py [--touch-gib 10] [--hold-gib 14]
        [--value-mib 32] [--values 32] [--passes 3]
"""

from __future__ import annotations

import argparse
import mmap
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil

from kvplug_testing import RedisServer

MiB = 1 << 20
GiB = 1 << 30
PAGE = mmap.PAGESIZE
BATCH = 8


def memory_in_use_gib() -> float:
    """Total - free memory: what the guest's kernel has handed out, page cache included."""
    memory = psutil.virtual_memory()
    return (memory.total - memory.free) / GiB


def touch(region: mmap.mmap) -> None:
    view = memoryview(region)
    for offset in range(0, len(region), PAGE):
        view[offset] = 1
    view.release()


def first_touch(gib: int) -> None:
    print("first touch, 1 GiB at a time, kept:")
    kept = []
    for index in range(gib):
        before = memory_in_use_gib()
        system = resource.getrusage(resource.RUSAGE_SELF).ru_stime
        start = time.perf_counter()
        region = mmap.mmap(-1, GiB)
        touch(region)
        elapsed = time.perf_counter() - start
        system = resource.getrusage(resource.RUSAGE_SELF).ru_stime - system
        kept.append(region)
        print(
            f"  GiB {index + 1:>3}: {elapsed * 1000:7.0f} ms ({system * 1000:6.0f} ms in the "
            f"kernel); memory in use before it {before:5.1f} GiB",
            flush=True,
        )
    for region in kept:
        region.close()


def server_cost(process: psutil.Process) -> tuple[float, int]:
    """(user + system CPU seconds, minor page faults) of ``process``; psutil has no page
    fault counts on Linux, so those come from ``/proc/<pid>/stat``."""
    times = process.cpu_times()
    fields = Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return times.user + times.system, int(fields[7])


def hold(gib: int) -> subprocess.Popen[bytes]:
    """A child that touches ``gib`` GiB and keeps it until killed; returns once it holds it."""
    child = subprocess.Popen(
        [sys.executable, __file__, "--hold-only", str(gib)], stdout=subprocess.PIPE
    )
    assert child.stdout is not None
    if child.stdout.readline() != b"held\n":
        child.kill()
        raise RuntimeError(f"the child could not hold {gib} GiB")
    return child


def redis_gets(value_mib: int, values: int, passes: int, hold_gib: int) -> None:
    payload = os.urandom(value_mib * MiB)
    served_gib = value_mib * values / 1024
    with RedisServer(maxmemory=2 * values * value_mib * MiB + 256 * MiB) as server:
        client = server.client()
        process = psutil.Process(int(client.info()["process_id"]))
        for label, held in (("alone", 0), (f"{hold_gib} GiB held elsewhere", hold_gib)):
            holder = hold(held) if held else None
            try:
                per_gib = []
                for index in range(passes):
                    client.flushall()
                    for number in range(values):
                        client.set(f"v{number}", payload)
                    cpu, faults = server_cost(process)
                    start = time.perf_counter()
                    for first in range(0, values, BATCH):
                        pipe = client.pipeline(transaction=False)
                        for number in range(first, min(first + BATCH, values)):
                            pipe.get(f"v{number}")
                        if any(got != payload for got in pipe.execute()):
                            raise RuntimeError("a value came back different")
                    elapsed = time.perf_counter() - start
                    cpu_after, faults_after = server_cost(process)
                    per_gib.append((cpu_after - cpu) / served_gib)
                    print(
                        f"  {label}, pass {index + 1}: server CPU "
                        f"{per_gib[-1]:.2f} s/GiB, {(faults_after - faults) / served_gib:,.0f} "
                        f"minor faults/GiB; pass {elapsed:.2f} s",
                        flush=True,
                    )
                print(f"  {label}: median server CPU {statistics.median(per_gib):.2f} s/GiB")
            finally:
                if holder is not None:
                    holder.kill()
                    holder.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--touch-gib", type=int, default=10, help="GiB the first part touches")
    parser.add_argument("--hold-gib", type=int, default=14, help="GiB the child keeps touched")
    parser.add_argument("--value-mib", type=int, default=32)
    parser.add_argument("--values", type=int, default=32)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--hold-only", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hold_only is not None:
        region = mmap.mmap(-1, args.hold_only * GiB)
        touch(region)
        print("held", flush=True)
        parent = os.getppid()
        while os.getppid() == parent:  # until killed, or orphaned
            time.sleep(0.5)
        return
    first_touch(args.touch_gib)
    print(f"redis-server, {args.values} x {args.value_mib} MiB read back in GETs of {BATCH}:")
    redis_gets(args.value_mib, args.values, args.passes, args.hold_gib)


if __name__ == "__main__":
    main()
