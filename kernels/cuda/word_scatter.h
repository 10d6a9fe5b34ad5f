// Writes scattered int32 words of a device array in one launch: how a resident attention plan
// (server/attention_plan.h) brings its device block tables up to date when sequences grow,
// moving only the words that changed.
//
//   KVPOOL_RETURN_IF_ERROR(ScatterWords(d_tables, d_patch, n, stream));
//
// Thread-safety: no state; enqueued on `stream`.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/cuda_codec.h"

namespace kvpool::cuda {

// dst[index] = value for each of n entries (device memory). Indices are the caller's to bound.
struct WordWrite {
  uint32_t index = 0;
  int32_t value = 0;
};

[[nodiscard]] absl::Status ScatterWords(int32_t* dst, const WordWrite* writes, int n,
                                        Stream stream);

}  // namespace kvpool::cuda
