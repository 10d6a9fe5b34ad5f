// Reader and writer for NumPy's .npy format (versions 1.0, 2.0 and 3.0), enough for K/V and
// query tensors: little-endian float32, float64, float16 and bfloat16 arrays, plus integer
// token ids, in C order.
//
// File layout: the magic "\x93NUMPY", a major and a minor version byte, the header length
// (u16 little-endian in 1.0, u32 in 2.0/3.0), an ASCII header holding a Python dict literal
// ({'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }), padded with spaces and a
// newline so that the data starts at a multiple of 64 bytes, then the raw data.
//
// NumPy has no bfloat16 of its own. Arrays saved from ml_dtypes' bfloat16 carry the descr
// "<V2" (or "|V2"); those are read as BF16. Raw 16-bit words saved as '<u2' or '<i2' (for example
// a torch bfloat16 tensor viewed as int16) are read as integers; use `AsBf16Words` to take
// them as BF16.
//
//   KVPOOL_ASSIGN_OR_RETURN(NpyArray k, ReadNpyFile("k.npy"));   // [layers][tokens][Hkv][D]
//   if (k.dtype == NpyDtype::kF32) { const float* p = k.data_as<float>(); ... }
//   KVPOOL_RETURN_IF_ERROR(WriteNpyFile("out.npy", NpyDtype::kF32, {4, 128}, bytes));
//
// Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvpool::client {

enum class NpyDtype {
  kF32,   // '<f4'
  kF64,   // '<f8'
  kF16,   // '<f2'
  kBF16,  // '<V2' (ml_dtypes.bfloat16)
  kI32,   // '<i4'
  kI64,   // '<i8'
  kU32,   // '<u4'
  kU16,   // '<u2'
  kI16,   // '<i2'
};

// Bytes per element.
size_t NpyDtypeSize(NpyDtype d);
// The descr string written for `d` ("<f4", ...).
absl::string_view NpyDescr(NpyDtype d);

struct NpyArray {
  NpyDtype dtype = NpyDtype::kF32;
  std::vector<int64_t> shape;
  std::string data;  // num_elements() * NpyDtypeSize(dtype) bytes, C order, little-endian

  int64_t num_elements() const;
  template <typename T>
  const T* data_as() const {
    return reinterpret_cast<const T*>(data.data());
  }
};

// Parses the bytes of a .npy file. InvalidArgument naming the problem: bad magic or version,
// a malformed header, an unsupported dtype (big-endian, structured, object), Fortran order, or
// a data size that does not match the shape.
[[nodiscard]] absl::StatusOr<NpyArray> ParseNpy(std::string bytes);
// Reads and parses a file. NotFound when it cannot be opened; errors of ParseNpy otherwise.
[[nodiscard]] absl::StatusOr<NpyArray> ReadNpyFile(const std::string& path);

// Serializes an array (version 1.0, or 2.0 when the header does not fit 1.0). `data` must hold
// exactly the shape's elements; InvalidArgument otherwise.
[[nodiscard]] absl::StatusOr<std::string> SerializeNpy(NpyDtype dtype,
                                                       const std::vector<int64_t>& shape,
                                                       absl::string_view data);
[[nodiscard]] absl::Status WriteNpyFile(const std::string& path, NpyDtype dtype,
                                        const std::vector<int64_t>& shape, absl::string_view data);

// Reinterprets an array of 16-bit integer words ('<u2' / '<i2') as BF16 words; other dtypes
// are returned unchanged.
NpyArray AsBf16Words(NpyArray a);

}  // namespace kvpool::client
