"""Runs kvplug's CUDA copy kernel once per layout, direction and chunk location, for memcheck.

scripts/gpu-test.sh runs it under ``compute-sanitizer --tool memcheck`` with torch's caching
allocator off (``PYTORCH_NO_CUDA_MEMORY_CACHING=1``), so that every tensor is its own CUDA
allocation and an access past a cache's or chunk's end is reported. Each copy is also
compared with the pure-torch path. Exits non-zero on any difference.

    compute-sanitizer --tool memcheck --error-exitcode 1 python scripts/sanitize_kernel.py
"""

from __future__ import annotations

import sys

import torch

from kvplug.runtime.gpu import PagedKVCache, gather, scatter

LAYOUTS = ("vllm_flash", "vllm_flash_permuted", "mla", "sglang")
# (layers, num_blocks, block_size, heads, head_size): 16-byte vectors, and odd rows (vec 1 or 2).
GEOMETRIES = ((2, 4, 16, 2, 64), (2, 3, 4, 3, 5))


def random_cache(
    layout: str, dtype: torch.dtype, geometry: tuple[int, int, int, int, int], seed: int
) -> tuple[PagedKVCache, list[torch.Tensor]]:
    layers, nb, bs, heads, size = geometry
    row = heads * size
    generator = torch.Generator().manual_seed(seed)
    owners: list[torch.Tensor] = []

    def owned(numel: int) -> torch.Tensor:
        itemsize = torch.empty((), dtype=dtype).element_size()
        raw = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=generator)
        tensor = raw.cuda().view(dtype)
        owners.append(tensor)
        return tensor

    if layout == "vllm_flash":
        return PagedKVCache.vllm_flash(
            [owned(2 * nb * bs * row).view(2, nb, bs, heads, size) for _ in range(layers)]
        ), owners
    if layout == "vllm_flash_permuted":
        return PagedKVCache.vllm_flash(
            [
                owned(2 * nb * bs * row).view(nb, bs, 2, heads, size).permute(2, 0, 1, 3, 4)
                for _ in range(layers)
            ]
        ), owners
    if layout == "mla":
        return PagedKVCache.mla([owned(nb * bs * row).view(nb, bs, row) for _ in range(layers)]), (
            owners
        )
    ks = [owned(nb * bs * row).view(nb * bs, heads, size) for _ in range(layers)]
    vs = [owned(nb * bs * row).view(nb * bs, heads, size) for _ in range(layers)]
    return PagedKVCache.sglang(ks, vs), owners


def main() -> int:
    if not torch.cuda.is_available():
        print("sanitize_kernel.py needs a CUDA GPU")
        return 1
    failures = 0
    runs = 0
    for layout in LAYOUTS:
        for dtype in (torch.float16, torch.float8_e4m3fn):
            for geometry in GEOMETRIES:
                for location in ("pinned", "cuda"):
                    cache, _ = random_cache(layout, dtype, geometry, seed=1)
                    tokens = min(cache.num_slots, 13)
                    slots = torch.randperm(cache.num_slots)[:tokens]
                    slots[::4] = -1
                    slots = slots.cuda()
                    shape = cache.chunk_shape(tokens)
                    fast = torch.zeros(shape, dtype=dtype, device="cuda")
                    if location == "pinned":
                        fast = fast.cpu().pin_memory()
                    slow = torch.zeros(shape, dtype=dtype, device=fast.device)
                    gather(cache, slots, fast, impl="cuda")
                    gather(cache, slots, slow, impl="torch")
                    ok = torch.equal(fast.view(torch.uint8).cpu(), slow.view(torch.uint8).cpu())

                    target, target_mem = random_cache(layout, dtype, geometry, seed=2)
                    reference, reference_mem = random_cache(layout, dtype, geometry, seed=2)
                    scatter(fast, target, slots, impl="cuda")
                    scatter(fast, reference, slots, impl="torch")
                    torch.cuda.synchronize()
                    ok = ok and all(
                        torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                        for a, b in zip(target_mem, reference_mem, strict=True)
                    )
                    runs += 2
                    if not ok:
                        failures += 1
                        print(f"MISMATCH {layout} {dtype} {geometry} {location}")
    print(f"sanitize_kernel: {runs} kernel launches, {failures} mismatching cases")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
