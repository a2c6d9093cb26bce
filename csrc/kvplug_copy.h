// kvplug's paged-KV copy kernel: one launch moves every layer and plane of one chunk between an
// engine's paged KV cache and a contiguous chunk (on the GPU or in pinned host memory).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace kvplug {

// Copies rows between `chunk` ([planes, layers, tokens, row], contiguous, any dtype, on the GPU
// or in pinned host memory) and the paged cache whose slot 0 of plane p, layer l lies at byte
// address plane_pointers[p][l] (an int64 CUDA tensor). Token t's row lives at slot
// slot_mapping[t] of every plane and layer, slot_stride_bytes apart; negative slots are skipped.
// vec_bytes (1, 2, 4, 8 or 16) is the access width: it must divide the row's bytes, the slot
// stride, the chunk's address and every plane pointer. to_chunk: true gathers (cache -> chunk),
// false scatters (chunk -> cache). Launches on the current CUDA stream and does not synchronize.
void transfer(const at::Tensor& chunk, const at::Tensor& plane_pointers,
              const at::Tensor& slot_mapping, int64_t slot_stride_bytes, int64_t vec_bytes,
              bool to_chunk);

}  // namespace kvplug
