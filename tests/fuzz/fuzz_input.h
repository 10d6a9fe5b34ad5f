// FuzzInput: reads a fuzz target's input front to back (bytes, little-endian integers, the
// rest). Reads past the end yield zeros / empty views, so a target never has to check lengths.
//
//   FuzzInput in(data, size);
//   const uint8_t which = in.Byte();
//   const absl::string_view header = in.Bytes(sizeof(Header));
//   const absl::string_view payload = in.Rest();
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/strings/string_view.h"

namespace kvpool::fuzz {

class FuzzInput {
 public:
  FuzzInput(const uint8_t* data, size_t size) : bytes_(reinterpret_cast<const char*>(data), size) {}

  uint8_t Byte() {
    const absl::string_view b = Bytes(1);
    return b.empty() ? 0 : static_cast<uint8_t>(b[0]);
  }
  uint32_t U32() {
    const absl::string_view b = Bytes(4);
    uint32_t v = 0;
    for (size_t i = 0; i < b.size(); ++i)
      v |= static_cast<uint32_t>(static_cast<uint8_t>(b[i])) << (8 * i);
    return v;
  }
  // Up to `n` bytes (fewer at the end of the input).
  absl::string_view Bytes(size_t n) {
    const absl::string_view b = bytes_.substr(pos_, n);
    pos_ += b.size();
    return b;
  }
  // A piece framed by a varint length (protobuf's), as the streaming RPCs' messages are; false
  // at the end of the input.
  bool Framed(absl::string_view* piece) {
    uint64_t length = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (pos_ >= bytes_.size()) return false;
      const uint8_t b = static_cast<uint8_t>(bytes_[pos_++]);
      length |= static_cast<uint64_t>(b & 0x7f) << shift;
      if ((b & 0x80) == 0) break;
    }
    *piece = Bytes(length > remaining() ? remaining() : static_cast<size_t>(length));
    return true;
  }
  absl::string_view Rest() { return Bytes(remaining()); }
  size_t remaining() const { return bytes_.size() - pos_; }

 private:
  absl::string_view bytes_;
  size_t pos_ = 0;
};

}  // namespace kvpool::fuzz
