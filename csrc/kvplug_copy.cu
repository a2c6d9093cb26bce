// kvplug's paged-KV copy kernel (see kvplug_copy.h for the contract).
//
// One launch covers a whole chunk: grid.y walks the (plane, layer) pairs, grid.x groups of
// tokens; inside a block, threadIdx.y picks the token and the threads along x stride over the
// token's row in vectors of VecBytes. Each thread issues all of its loads before its stores
// (Unroll vectors in flight), which keeps enough requests outstanding to fill PCIe when one
// side is pinned host memory that the GPU reads or writes directly (zero-copy).

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include <string>
#include <type_traits>

#include "kvplug_copy.h"

namespace kvplug {
namespace {

// Error messages are joined from std::string pieces (std::to_string for numbers) and handed to
// TORCH_CHECK as one string: on the GPU machine (torch 2.11.0+cu130, nvcc 13.0) a failed
// TORCH_CHECK whose message printed a number through the extension's own ostream crashed the
// process, and a bad argument must raise, never crash.
std::string text(const char* piece) { return piece; }
std::string text(const std::string& piece) { return piece; }
std::string text(const c10::Device& device) { return device.str(); }
std::string text(c10::ScalarType type) { return c10::toString(type); }
std::string text(c10::IntArrayRef values) {
  std::string out = "[";
  for (size_t i = 0; i < values.size(); ++i) {
    if (i > 0) out += ", ";
    out += std::to_string(values[i]);
  }
  return out + "]";
}
template <typename T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
std::string text(T value) {
  return std::to_string(value);
}

template <typename... Pieces>
[[noreturn]] void fail(const Pieces&... pieces) {
  std::string message = "kvplug transfer: ";
  ((message += text(pieces)), ...);
  TORCH_CHECK(false, message);
  __builtin_unreachable();
}

#define KVPLUG_CHECK(condition, ...)  \
  do {                                \
    if (C10_UNLIKELY(!(condition))) { \
      fail(__VA_ARGS__);              \
    }                                 \
  } while (0)

template <int VecBytes>
struct VecType;
template <>
struct VecType<1> {
  using type = uint8_t;
};
template <>
struct VecType<2> {
  using type = uint16_t;
};
template <>
struct VecType<4> {
  using type = uint32_t;
};
template <>
struct VecType<8> {
  using type = uint2;
};
template <>
struct VecType<16> {
  using type = uint4;
};

constexpr int kUnroll = 4;
constexpr int kBlockThreads = 256;
constexpr int kMaxRowThreads = 128;

template <typename V>
__device__ __forceinline__ void copy_row(const V* __restrict__ src, V* __restrict__ dst, int64_t n,
                                         int lane, int stride) {
  for (int64_t base = lane; base < n; base += static_cast<int64_t>(stride) * kUnroll) {
    V held[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + static_cast<int64_t>(u) * stride;
      if (i < n) held[u] = src[i];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + static_cast<int64_t>(u) * stride;
      if (i < n) dst[i] = held[u];
    }
  }
}

template <int VecBytes>
__global__ void __launch_bounds__(kBlockThreads)
    transfer_kernel(unsigned char* __restrict__ chunk, const int64_t* __restrict__ plane_pointers,
                    const int64_t* __restrict__ slot_mapping, int64_t num_tokens, int64_t row_bytes,
                    int64_t slot_stride_bytes, bool to_chunk) {
  using V = typename VecType<VecBytes>::type;
  const int64_t token = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (token >= num_tokens) return;
  const int64_t slot = slot_mapping[token];
  if (slot < 0) return;  // vLLM marks tokens that must not move with -1
  const int64_t plane_layer = blockIdx.y;
  unsigned char* chunk_row = chunk + (plane_layer * num_tokens + token) * row_bytes;
  unsigned char* cache_row =
      reinterpret_cast<unsigned char*>(plane_pointers[plane_layer]) + slot * slot_stride_bytes;
  V* chunk_vec = reinterpret_cast<V*>(chunk_row);
  V* cache_vec = reinterpret_cast<V*>(cache_row);
  const int64_t n = row_bytes / VecBytes;
  if (to_chunk) {
    copy_row<V>(cache_vec, chunk_vec, n, threadIdx.x, blockDim.x);
  } else {
    copy_row<V>(chunk_vec, cache_vec, n, threadIdx.x, blockDim.x);
  }
}

// The address the GPU uses for the chunk: its own pointer for device memory, the mapped
// device address for pinned (page-locked, mapped) host memory.
unsigned char* device_address(const at::Tensor& chunk, const c10::Device& cache_device) {
  void* ptr = chunk.data_ptr();
  if (chunk.is_cuda()) {
    KVPLUG_CHECK(chunk.device() == cache_device, "the chunk is on ", chunk.device(),
                 " but the paged cache (plane_pointers) is on ", cache_device,
                 "; move the chunk to the cache's device or to pinned host memory.");
    return static_cast<unsigned char*>(ptr);
  }
  KVPLUG_CHECK(chunk.device().is_cpu(), "the chunk must be on a CUDA device or ",
               "in pinned host memory, not on ", chunk.device(), ".");
  cudaPointerAttributes attributes{};
  const cudaError_t status = cudaPointerGetAttributes(&attributes, ptr);
  if (status != cudaSuccess) {
    (void)cudaGetLastError();  // clear the error so that later CUDA calls do not see it
  }
  KVPLUG_CHECK(status == cudaSuccess && attributes.type == cudaMemoryTypeHost &&
                   attributes.devicePointer != nullptr,
               "the host chunk is not in pinned (page-locked) memory, so the "
               "GPU cannot reach it. Allocate it pinned (torch.empty(..., pin_memory=True), "
               "tensor.pin_memory(), or a kvplug FreeListAllocator with CUDA present), or pass a "
               "CUDA tensor.");
  return static_cast<unsigned char*>(attributes.devicePointer);
}

template <int VecBytes>
void launch(unsigned char* chunk, const at::Tensor& plane_pointers, const at::Tensor& slot_mapping,
            int64_t num_tokens, int64_t plane_layers, int64_t row_bytes, int64_t slot_stride_bytes,
            bool to_chunk, cudaStream_t stream) {
  const int64_t row_vecs = row_bytes / VecBytes;
  // Enough threads per row that each holds about kUnroll vectors, a whole warp at least.
  int row_threads = 32;
  while (row_threads < kMaxRowThreads && static_cast<int64_t>(row_threads) * kUnroll < row_vecs) {
    row_threads *= 2;
  }
  const int rows_per_block = kBlockThreads / row_threads;
  const dim3 block(row_threads, rows_per_block);
  const dim3 grid(static_cast<unsigned int>((num_tokens + rows_per_block - 1) / rows_per_block),
                  static_cast<unsigned int>(plane_layers));
  transfer_kernel<VecBytes><<<grid, block, 0, stream>>>(
      chunk, plane_pointers.data_ptr<int64_t>(), slot_mapping.data_ptr<int64_t>(), num_tokens,
      row_bytes, slot_stride_bytes, to_chunk);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void transfer(const at::Tensor& chunk, const at::Tensor& plane_pointers,
              const at::Tensor& slot_mapping, int64_t slot_stride_bytes, int64_t vec_bytes,
              bool to_chunk) {
  KVPLUG_CHECK(chunk.dim() == 4, "the chunk must be 4-D [planes, layers, ",
               "tokens, row], got shape ", chunk.sizes(), ".");
  KVPLUG_CHECK(chunk.is_contiguous(), "the chunk must be contiguous (shape ", chunk.sizes(),
               ", strides ", chunk.strides(), ").");
  KVPLUG_CHECK(plane_pointers.is_cuda() && plane_pointers.scalar_type() == at::kLong,
               "plane_pointers must be an int64 CUDA tensor, got ", plane_pointers.scalar_type(),
               " on ", plane_pointers.device(), ".");
  KVPLUG_CHECK(slot_mapping.is_cuda() && slot_mapping.scalar_type() == at::kLong,
               "slot_mapping must be an int64 CUDA tensor, got ", slot_mapping.scalar_type(),
               " on ", slot_mapping.device(), ".");
  KVPLUG_CHECK(slot_mapping.device() == plane_pointers.device(), "slot_mapping is on ",
               slot_mapping.device(), " but plane_pointers is on ", plane_pointers.device(),
               "; put both on the cache's "
               "device.");
  const int64_t planes = chunk.size(0);
  const int64_t layers = chunk.size(1);
  const int64_t num_tokens = chunk.size(2);
  KVPLUG_CHECK(plane_pointers.dim() == 2 && plane_pointers.size(0) == planes &&
                   plane_pointers.size(1) == layers && plane_pointers.is_contiguous(),
               "plane_pointers must be a contiguous [planes, layers] = [", planes, ", ", layers,
               "] tensor matching the chunk, got shape ", plane_pointers.sizes(), ".");
  KVPLUG_CHECK(
      slot_mapping.dim() == 1 && slot_mapping.size(0) == num_tokens && slot_mapping.is_contiguous(),
      "slot_mapping must be a contiguous 1-D tensor of ", num_tokens,
      " entries (one per token of the chunk), got shape ", slot_mapping.sizes(), ".");
  KVPLUG_CHECK(
      vec_bytes == 1 || vec_bytes == 2 || vec_bytes == 4 || vec_bytes == 8 || vec_bytes == 16,
      "vec_bytes must be 1, 2, 4, 8 or 16, got ", vec_bytes, ".");
  const int64_t row_bytes = chunk.size(3) * static_cast<int64_t>(chunk.element_size());
  KVPLUG_CHECK(row_bytes % vec_bytes == 0 && slot_stride_bytes % vec_bytes == 0, "vec_bytes ",
               vec_bytes, " must divide the row's ", row_bytes, " bytes and the slot stride of ",
               slot_stride_bytes, " bytes.");
  KVPLUG_CHECK(slot_stride_bytes >= row_bytes, "the slot stride (", slot_stride_bytes,
               " bytes) is smaller than a row (", row_bytes, " bytes), so slots would overlap.");
  KVPLUG_CHECK(planes * layers <= 65535,
               "at most 65535 (plane, layer) pairs "
               "per launch, got ",
               planes * layers, ".");
  if (chunk.numel() == 0) return;

  const c10::cuda::CUDAGuard guard(plane_pointers.device());
  unsigned char* chunk_ptr = device_address(chunk, plane_pointers.device());
  KVPLUG_CHECK(reinterpret_cast<uintptr_t>(chunk_ptr) % static_cast<uintptr_t>(vec_bytes) == 0,
               "the chunk's address is not a multiple of vec_bytes ", vec_bytes, ".");
  const cudaStream_t stream =
      c10::cuda::getCurrentCUDAStream(plane_pointers.device().index()).stream();
  const int64_t plane_layers = planes * layers;
  switch (vec_bytes) {
    case 16:
      launch<16>(chunk_ptr, plane_pointers, slot_mapping, num_tokens, plane_layers, row_bytes,
                 slot_stride_bytes, to_chunk, stream);
      break;
    case 8:
      launch<8>(chunk_ptr, plane_pointers, slot_mapping, num_tokens, plane_layers, row_bytes,
                slot_stride_bytes, to_chunk, stream);
      break;
    case 4:
      launch<4>(chunk_ptr, plane_pointers, slot_mapping, num_tokens, plane_layers, row_bytes,
                slot_stride_bytes, to_chunk, stream);
      break;
    case 2:
      launch<2>(chunk_ptr, plane_pointers, slot_mapping, num_tokens, plane_layers, row_bytes,
                slot_stride_bytes, to_chunk, stream);
      break;
    default:
      launch<1>(chunk_ptr, plane_pointers, slot_mapping, num_tokens, plane_layers, row_bytes,
                slot_stride_bytes, to_chunk, stream);
      break;
  }
}

}  // namespace kvplug
