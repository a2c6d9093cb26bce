"""Memory objects and allocators where CUDA is present (run by scripts/gpu-test.sh)."""

from __future__ import annotations

import asyncio

import pytest
import torch

import kvplug
from kvplug import CacheKey, ConfigError, FreeListAllocator, MemoryFormat
from kvplug.frame import decode_frame, encode_frame

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU: run scripts/gpu-test.sh on the GPU machine",
)


def test_host_buffers_are_pinned_when_cuda_is_present() -> None:
    allocator = FreeListAllocator(1 << 24)
    assert allocator.buffer.is_pinned()
    assert allocator.buffer.data_ptr() % 4096 == 0
    assert not FreeListAllocator(1 << 24, pin=False).buffer.is_pinned()


def test_pinned_object_round_trips_through_the_gpu_bit_exact() -> None:
    allocator = FreeListAllocator(1 << 26)
    obj = allocator.allocate((2, 4, 256, 128), torch.bfloat16, MemoryFormat.KV_2LTD)
    assert obj is not None and obj.tensor.is_pinned()
    source = torch.randn(obj.shape, dtype=torch.bfloat16, device="cuda")
    obj.tensor.copy_(source, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(obj.tensor.cuda(), source)
    obj.release()
    assert allocator.stats().used == 0


def test_a_gpu_buffer_larger_than_the_gpu_names_its_setting_and_the_gpus_memory() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.mem_get_info(device)[1]
    with pytest.raises(ConfigError) as caught:
        FreeListAllocator(4 * total, device=device, sized_by="gds:// buffer_size")
    message = str(caught.value)
    assert message.startswith("gds:// buffer_size is ")
    assert f"memory on {device}" in message
    assert "free now" in message and "Lower it" in message
    assert "available now" not in message  # the host's memory says nothing about the GPU's
    assert "PYTORCH_CUDA_ALLOC_CONF" not in message


def test_device_allocator_hands_out_aligned_gpu_objects() -> None:
    allocator = FreeListAllocator(1 << 24, device="cuda")
    objs = [allocator.allocate((3, 1000), torch.float16) for _ in range(4)]
    for obj in objs:
        assert obj is not None
        assert obj.device.type == "cuda" and obj.data_ptr() % 4096 == 0
        with pytest.raises(ConfigError, match="host memory"):
            obj.memoryview()
        obj.release()
    assert allocator.memcheck() and allocator.stats().used == 0


def test_frames_decode_into_pinned_memory() -> None:
    allocator = FreeListAllocator(1 << 24)
    obj = allocator.allocate((2, 2, 16, 64), torch.float8_e4m3fn)
    assert obj is not None
    obj.raw.copy_(torch.randint(0, 256, (obj.nbytes,), dtype=torch.uint8))
    header, payload = encode_frame(obj)
    copy = decode_frame(header + bytes(payload), allocator)
    assert copy is not None and copy.tensor.is_pinned()
    assert torch.equal(copy.raw, obj.raw)
    obj.release()
    copy.release()


def test_cpu_tier_stores_a_gpu_object_as_a_host_copy() -> None:
    gpu = FreeListAllocator(1 << 24, device="cuda")
    obj = gpu.allocate((2, 2, 32, 64), torch.float16)
    assert obj is not None
    obj.tensor.normal_()
    key = CacheKey("cuda-test", 1, 0, 1)

    async def main() -> None:
        cpu = await kvplug.open_backend("cpu://?max_size=64MiB")
        await cpu.put(key, obj)
        hit = await cpu.get(key)
        assert hit is not None and hit.device.type == "cpu" and hit.tensor.is_pinned()
        assert torch.equal(hit.tensor.cuda(), obj.tensor)
        hit.release()
        await cpu.close()

    asyncio.run(main())
    obj.release()
    assert gpu.stats().used == 0
