// One copy between device addresses: `rows` runs of `bytes` bytes, run i from
// src + i * src_pitch to dst + i * dst_pitch (the pitches matter only when rows > 1). What a
// fetch into a decode worker's GPU arena is made of (server/transport/device_fetch.h), copied in
// one launch by kernels/cuda/copy_ranges.h.
//
// Plain data: included by host code and by the CUDA kernels.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvpool {

struct DeviceCopy {
  uint8_t* dst = nullptr;
  const uint8_t* src = nullptr;
  size_t bytes = 0;
  size_t rows = 1;
  size_t dst_pitch = 0;
  size_t src_pitch = 0;
};

}  // namespace kvpool
