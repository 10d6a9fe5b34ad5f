// Little-endian stores and loads of the data-plane wire formats (attention_wire.h, shm_wire.h),
// independent of the host's byte order.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace kvpool::server::wire {

template <typename T>
void Put(uint8_t* p, T v) {
  for (size_t i = 0; i < sizeof(T); ++i) {
    p[i] = static_cast<uint8_t>(static_cast<uint64_t>(v) >> (8 * i));
  }
}

template <typename T>
T Get(const uint8_t* p) {
  uint64_t v = 0;
  for (size_t i = 0; i < sizeof(T); ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return static_cast<T>(v);
}

inline bool AllZero(const uint8_t* p, size_t n) {
  return std::all_of(p, p + n, [](uint8_t b) { return b == 0; });
}

}  // namespace kvpool::server::wire
