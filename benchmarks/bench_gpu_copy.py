"""kvplug's CUDA copy kernel against plain copies of the same bytes, side by side in one run.

A vLLM flash cache of 32 layers, each ``[2, num_blocks, 16, 8, 128]`` fp16, and a chunk of 256
tokens whose 16 blocks are picked in random order: ``[2, 32, 256, 1024]`` fp16, 32 MiB (and the
first 24 layers: ``[2, 24, 256, 1024]``, 24 MiB). For each shape:

* gather into pinned host memory (offload) against one pinned ``copy_`` of a 32 MiB GPU buffer
  into host memory, and scatter from pinned host memory (load) against the reverse copy;
* gather into a GPU buffer against a plain device-to-device ``copy_`` of the same bytes;
* the same gathers and scatters through the pure-torch path (``impl="torch"``) for comparison.

The kernel is timed alone (``load_kernel().transfer``, what gather and scatter launch) and
through ``kvplug.runtime.gpu.gather``/``scatter`` as an engine's hot path calls them
(``synchronize=False, validate=False``), which adds their Python overhead per call. Each
repetition times a batch of copies with CUDA events; the median over repetitions is reported.
Ratio = kvplug GB/s / plain copy GB/s (target >= 0.9).

    python benchmarks/bench_gpu_copy.py [--repeat 15] [--batch 8]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch

from kvplug.runtime.gpu import Impl, PagedKVCache, gather, scatter
from kvplug.runtime.gpu.kernel import load_kernel

BLOCK_SIZE = 16
HEADS = 8
HEAD_SIZE = 128
TOKENS = 256


def timed(op: Callable[[], object], repeat: int, batch: int) -> float:
    """Median seconds of one ``op``, over ``repeat`` batches of ``batch`` back-to-back calls."""
    for _ in range(2):
        op()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        for _ in range(batch):
            op()
        end.record()
        end.synchronize()
        times.append(float(start.elapsed_time(end)) / 1000 / batch)
    return float(statistics.median(times))


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def report(name: str, nbytes: int, ours: float, plain: float, plain_name: str) -> None:
    ratio = plain / ours
    print(
        f"    {name:<24} {gbps(nbytes, ours):8.2f} GB/s   plain {plain_name} copy_ "
        f"{gbps(nbytes, plain):8.2f} GB/s   {ratio:5.2f}x of plain copy"
    )


def vec_bytes(cache: PagedKVCache, chunk: torch.Tensor) -> int:
    """The widest access (up to 16 bytes) that every row, stride and address is aligned to."""
    width = 16
    addresses = [a for plane in cache.plane_addresses for a in plane]
    for value in (cache.row_bytes, cache.slot_stride_bytes, chunk.data_ptr(), *addresses):
        while value % width:
            width //= 2
    return width


def run_shape(
    layers: list[torch.Tensor], num_layers: int, slots: torch.Tensor, repeat: int, batch: int
) -> None:
    cache = PagedKVCache.vllm_flash(layers[:num_layers])
    shape = cache.chunk_shape(TOKENS)
    host = torch.empty(shape, dtype=torch.float16, pin_memory=True)
    device_chunk = torch.empty(shape, dtype=torch.float16, device="cuda")
    flat = torch.empty(shape, dtype=torch.float16, device="cuda")
    flat_copy = torch.empty_like(flat)
    nbytes = host.numel() * host.element_size()
    print(f"chunk {list(shape)} fp16, {nbytes / 2**20:.0f} MiB, {TOKENS // BLOCK_SIZE} blocks")

    kernel = load_kernel()
    pointers = cache.plane_pointers()
    stride = cache.slot_stride_bytes

    def raw(chunk: torch.Tensor, to_chunk: bool) -> Callable[[], object]:
        vec = vec_bytes(cache, chunk)
        return lambda: kernel.transfer(chunk, pointers, slots, stride, vec, to_chunk)

    def via_gather(out: torch.Tensor, impl: Impl) -> Callable[[], None]:
        return lambda: gather(cache, slots, out, impl=impl, synchronize=False, validate=False)

    def via_scatter(src: torch.Tensor, impl: Impl) -> Callable[[], None]:
        return lambda: scatter(src, cache, slots, impl=impl, synchronize=False, validate=False)

    d2h = timed(lambda: host.copy_(flat, non_blocking=True), repeat, batch)
    h2d = timed(lambda: flat.copy_(host, non_blocking=True), repeat, batch)
    d2d = timed(lambda: flat_copy.copy_(flat), repeat, batch)
    print("  the kernel alone (kernel.transfer, what gather/scatter launch):")
    report("gather -> pinned host", nbytes, timed(raw(host, True), repeat, batch), d2h, "D2H")
    report("scatter <- pinned host", nbytes, timed(raw(host, False), repeat, batch), h2d, "H2D")
    report(
        "gather -> GPU buffer", nbytes, timed(raw(device_chunk, True), repeat, batch), d2d, "D2D"
    )
    report(
        "scatter <- GPU buffer", nbytes, timed(raw(device_chunk, False), repeat, batch), d2d, "D2D"
    )
    impls: tuple[Impl, ...] = ("cuda", "torch")
    for impl in impls:
        print(f"  kvplug.gpu.gather/scatter(impl={impl!r}, synchronize=False, validate=False):")
        gather_host = timed(via_gather(host, impl), repeat, batch)
        report("gather -> pinned host", nbytes, gather_host, d2h, "D2H")
        scatter_host = timed(via_scatter(host, impl), repeat, batch)
        report("scatter <- pinned host", nbytes, scatter_host, h2d, "H2D")
        gather_device = timed(via_gather(device_chunk, impl), repeat, batch)
        report("gather -> GPU buffer", nbytes, gather_device, d2d, "D2D")

    # The kernel's bytes are the torch path's bytes.
    check = torch.empty_like(host)
    gather(cache, slots, host, impl="cuda")
    gather(cache, slots, check, impl="torch")
    assert torch.equal(host.view(torch.uint8), check.view(torch.uint8)), "gather differs"
    print("  kernel and torch gathers are bit-identical")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=15, help="timed batches (median)")
    parser.add_argument("--batch", type=int, default=8, help="copies per timed batch")
    parser.add_argument("--num-blocks", type=int, default=1024, help="blocks per layer")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_gpu_copy.py needs a CUDA GPU: nothing measured.")
        return
    props = torch.cuda.get_device_properties(0)
    print(
        f"device {props.name} ({props.total_memory / 2**30:.0f} GiB), torch {torch.__version__}, "
        f"CUDA {torch.version.cuda}"
    )
    num_blocks = max(args.num_blocks, TOKENS // BLOCK_SIZE)
    layers = [
        torch.randn(2, num_blocks, BLOCK_SIZE, HEADS, HEAD_SIZE, device="cuda").half()
        for _ in range(32)
    ]
    generator = torch.Generator().manual_seed(0)
    blocks = torch.randperm(num_blocks, generator=generator)[: TOKENS // BLOCK_SIZE]
    slots = (blocks[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)).flatten().cuda()
    print(
        f"cache: 32 layers of [2, {num_blocks}, {BLOCK_SIZE}, {HEADS}, {HEAD_SIZE}] fp16; "
        f"medians of {args.repeat} batches of {args.batch} copies"
    )
    for num_layers in (32, 24):
        run_shape(layers, num_layers, slots, args.repeat, args.batch)


if __name__ == "__main__":
    main()
