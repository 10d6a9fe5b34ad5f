// Reader and writer for the safetensors container (an 8-byte little-endian header length, a
// JSON header mapping tensor names to {dtype, shape, data_offsets} plus an optional
// "__metadata__" string map, then the raw little-endian tensor bytes).
//
//   KVPOOL_ASSIGN_OR_RETURN(SafetensorsFile f, SafetensorsFile::Parse(std::move(bytes)));
//   const SafetensorsTensor* t = f.Find("layers.0.k_rotation");
//   std::vector<float> m = *f.ReadFloat32("layers.0.k_rotation");
//
//   SafetensorsWriter w;
//   w.SetMetadata("model_id", "smollm2-135m");
//   w.AddFloat32("layers.0.k_rotation", {64, 64}, data);
//   std::string bytes = w.Serialize();
#pragma once

#include <cstdint>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace kvpool {

enum class SafetensorsDtype { kF64, kF32, kF16, kBF16, kI64, kI32, kI16, kI8, kU8, kBool };

absl::string_view SafetensorsDtypeName(SafetensorsDtype d);  // "F32", "BF16", ...
size_t SafetensorsDtypeSize(SafetensorsDtype d);

struct SafetensorsTensor {
  std::string name;
  SafetensorsDtype dtype;
  std::vector<int64_t> shape;
  absl::string_view bytes;  // points into the owning SafetensorsFile
  int64_t num_elements() const;
};

// A parsed file. Owns its bytes; tensors point into them. Movable, not copyable.
class SafetensorsFile {
 public:
  // InvalidArgument (with what is wrong) on a malformed header, overlapping or out-of-range
  // offsets, unknown dtypes or a size that does not match the shape.
  static absl::StatusOr<SafetensorsFile> Parse(std::string bytes);
  // Reads a regular file of at most `max_bytes` (common/file_read.h) and parses it.
  static absl::StatusOr<SafetensorsFile> ReadFile(
      const std::string& path, uint64_t max_bytes = std::numeric_limits<uint64_t>::max());

  SafetensorsFile(SafetensorsFile&&) = default;
  SafetensorsFile& operator=(SafetensorsFile&&) = default;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::vector<SafetensorsTensor>& tensors() const { return tensors_; }
  const SafetensorsTensor* Find(absl::string_view name) const;  // nullptr when absent

  // The tensor converted to fp32 (from F32, F16, BF16 or F64). NotFound / InvalidArgument.
  absl::StatusOr<std::vector<float>> ReadFloat32(absl::string_view name) const;

 private:
  SafetensorsFile() = default;
  std::string bytes_;
  std::map<std::string, std::string> metadata_;
  std::vector<SafetensorsTensor> tensors_;
};

// Builds a file in memory. Tensors are written in the order added, 8-byte aligned.
class SafetensorsWriter {
 public:
  void SetMetadata(const std::string& key, const std::string& value);
  void AddTensor(const std::string& name, SafetensorsDtype dtype, std::vector<int64_t> shape,
                 absl::string_view raw_bytes);
  void AddFloat32(const std::string& name, std::vector<int64_t> shape,
                  absl::Span<const float> data);
  std::string Serialize() const;
  absl::Status WriteFile(const std::string& path) const;

 private:
  struct Entry {
    std::string name;
    SafetensorsDtype dtype;
    std::vector<int64_t> shape;
    std::string bytes;
  };
  std::map<std::string, std::string> metadata_;
  std::vector<Entry> entries_;
};

}  // namespace kvpool
