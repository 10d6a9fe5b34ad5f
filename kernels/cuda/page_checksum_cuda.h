// Page checksums (kernels/page_checksum.h) of paged blocks in GPU memory, the same sum the CPU
// computes, for verification (reads, the scrubber): one flat launch, a warp per (range, span)
// reading consecutive words. The writers do not use it: the arrival and demotion kernels add
// the checksums of what they write in the same launch (ArrivalRows::page_checksums).
//
//   KVPOOL_RETURN_IF_ERROR(PageChecksums(pool, history_geo, bf16_geo, d_ranges, n, d_out, stream));
//
// Thread-safety: no state; enqueued on `stream`.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/cuda_codec.h"
#include "kernels/page_checksum.h"

namespace kvpool::cuda {

// Slots [first_slot, first_slot + count) of the page at pool + block * 16 bytes (the backend's
// block id), an INT2 history block (history != 0) or a BF16 page.
struct ChecksumRange {
  int32_t block = 0;
  int32_t first_slot = 0;
  int32_t count = 0;
  int32_t history = 0;
};

// out[i] = the checksum of ranges[i], for i < n (ranges and out in device memory; out is zeroed
// on the stream first, then summed into).
[[nodiscard]] absl::Status PageChecksums(const uint8_t* pool, const PageChecksumGeometry& history,
                                         const PageChecksumGeometry& bf16,
                                         const ChecksumRange* ranges, int n, uint32_t* out,
                                         Stream stream);

}  // namespace kvpool::cuda
