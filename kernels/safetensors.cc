#include "kernels/safetensors.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/bf16.h"
#include "common/file_read.h"
#include "common/quote.h"
#include "nlohmann/json.hpp"

namespace kvpool {
namespace {

using Json = nlohmann::json;

// The reference implementation refuses headers above 100 MB; so do we, before allocating.
constexpr uint64_t kMaxHeaderBytes = 100u << 20;
constexpr size_t kAlignment = 8;

struct DtypeInfo {
  SafetensorsDtype dtype;
  const char* name;
  size_t size;
};

constexpr DtypeInfo kDtypes[] = {
    {SafetensorsDtype::kF64, "F64", 8}, {SafetensorsDtype::kF32, "F32", 4},
    {SafetensorsDtype::kF16, "F16", 2}, {SafetensorsDtype::kBF16, "BF16", 2},
    {SafetensorsDtype::kI64, "I64", 8}, {SafetensorsDtype::kI32, "I32", 4},
    {SafetensorsDtype::kI16, "I16", 2}, {SafetensorsDtype::kI8, "I8", 1},
    {SafetensorsDtype::kU8, "U8", 1},   {SafetensorsDtype::kBool, "BOOL", 1},
};

const DtypeInfo* FindDtype(absl::string_view name) {
  for (const DtypeInfo& d : kDtypes) {
    if (name == d.name) return &d;
  }
  return nullptr;
}

uint64_t ReadLittleEndianU64(const char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(p[i]);
  return v;
}

void AppendLittleEndianU64(uint64_t v, std::string* out) {
  for (int i = 0; i < 8; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xffu));
}

// Reads a JSON value that must be a non-negative integer.
bool AsUint64(const Json& j, uint64_t* out) {
  if (j.is_number_unsigned()) {
    *out = j.get<uint64_t>();
    return true;
  }
  if (j.is_number_integer()) {
    const int64_t v = j.get<int64_t>();
    if (v < 0) return false;
    *out = static_cast<uint64_t>(v);
    return true;
  }
  return false;
}

absl::Status Malformed(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("safetensors: ", what));
}

}  // namespace

absl::string_view SafetensorsDtypeName(SafetensorsDtype d) {
  for (const DtypeInfo& info : kDtypes) {
    if (info.dtype == d) return info.name;
  }
  return "UNKNOWN";
}

size_t SafetensorsDtypeSize(SafetensorsDtype d) {
  for (const DtypeInfo& info : kDtypes) {
    if (info.dtype == d) return info.size;
  }
  return 0;
}

int64_t SafetensorsTensor::num_elements() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;  // Parse has checked that this cannot overflow.
  return n;
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::Parse(std::string bytes) {
  if (bytes.size() < 8) {
    return Malformed(absl::StrCat("file of ", bytes.size(),
                                  " bytes is shorter than the 8-byte "
                                  "header length"));
  }
  const uint64_t header_len = ReadLittleEndianU64(bytes.data());
  if (header_len > kMaxHeaderBytes) {
    return Malformed(absl::StrCat("header length ", header_len, " exceeds the 100 MB limit"));
  }
  if (header_len > bytes.size() - 8) {
    return Malformed(absl::StrCat("header length ", header_len, " runs past the end of the ",
                                  bytes.size(), "-byte file"));
  }
  const char* header_begin = bytes.data() + 8;
  const char* header_end = header_begin + header_len;

  // Count top-level keys while parsing: nlohmann keeps only the last of duplicated keys, and
  // a duplicated tensor name must be an error rather than a silent choice.
  size_t top_level_keys = 0;
  auto count_keys = [&top_level_keys](int depth, Json::parse_event_t event, Json&) {
    if (depth == 1 && event == Json::parse_event_t::key) ++top_level_keys;
    return true;
  };
  Json header = Json::parse(header_begin, header_end, count_keys, /*allow_exceptions=*/false);
  if (header.is_discarded()) return Malformed("header is not valid JSON");
  if (!header.is_object()) return Malformed("header JSON is not an object");
  if (top_level_keys != header.size()) return Malformed("header has duplicate keys");

  SafetensorsFile file;
  const uint64_t data_begin = 8 + header_len;
  const uint64_t data_size = bytes.size() - data_begin;
  struct Range {
    uint64_t begin, end;
    size_t tensor;
  };
  std::vector<Range> ranges;

  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& key = it.key();
    const Json& value = it.value();
    if (key == "__metadata__") {
      if (!value.is_object()) return Malformed("__metadata__ is not an object");
      for (auto m = value.begin(); m != value.end(); ++m) {
        if (!m.value().is_string()) {
          return Malformed(
              absl::StrCat("__metadata__ value for ", Quote(m.key()), " is not a string"));
        }
        file.metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string where = absl::StrCat("tensor ", Quote(key), ": ");
    if (!value.is_object()) return Malformed(where + "entry is not an object");
    auto dtype_it = value.find("dtype");
    auto shape_it = value.find("shape");
    auto offsets_it = value.find("data_offsets");
    if (dtype_it == value.end() || !dtype_it->is_string()) {
      return Malformed(where + "missing or non-string dtype");
    }
    const DtypeInfo* dtype = FindDtype(dtype_it->get_ref<const std::string&>());
    if (dtype == nullptr) {
      return Malformed(
          absl::StrCat(where, "unknown dtype ", Quote(dtype_it->get_ref<const std::string&>())));
    }
    if (shape_it == value.end() || !shape_it->is_array()) {
      return Malformed(where + "missing or non-array shape");
    }
    SafetensorsTensor tensor;
    tensor.name = key;
    tensor.dtype = dtype->dtype;
    uint64_t elements = 1;
    for (const Json& dim : *shape_it) {
      uint64_t d = 0;
      if (!AsUint64(dim, &d) || d > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return Malformed(where + "shape entries must be non-negative integers");
      }
      if (d != 0 && elements > std::numeric_limits<uint64_t>::max() / d) {
        return Malformed(where + "shape overflows");
      }
      elements *= d;
      tensor.shape.push_back(static_cast<int64_t>(d));
    }
    if (elements > std::numeric_limits<uint64_t>::max() / dtype->size) {
      return Malformed(where + "shape overflows");
    }
    const uint64_t expected_bytes = elements * dtype->size;
    if (offsets_it == value.end() || !offsets_it->is_array() || offsets_it->size() != 2) {
      return Malformed(where + "data_offsets must be an array of two integers");
    }
    uint64_t begin = 0, end = 0;
    if (!AsUint64((*offsets_it)[0], &begin) || !AsUint64((*offsets_it)[1], &end)) {
      return Malformed(where + "data_offsets must be non-negative integers");
    }
    if (begin > end) {
      return Malformed(absl::StrCat(where, "data_offsets [", begin, ", ", end, ") are reversed"));
    }
    if (end > data_size) {
      return Malformed(absl::StrCat(where, "data_offsets [", begin, ", ", end,
                                    ") exceed the data section of ", data_size, " bytes"));
    }
    if (end - begin != expected_bytes) {
      return Malformed(absl::StrCat(where, "holds ", end - begin, " bytes but shape and dtype ",
                                    dtype->name, " need ", expected_bytes));
    }
    ranges.push_back({begin, end, file.tensors_.size()});
    file.tensors_.push_back(std::move(tensor));
  }

  // Overlap check on the ranges sorted by start; empty tensors overlap nothing.
  std::sort(ranges.begin(), ranges.end(),
            [](const Range& a, const Range& b) { return a.begin < b.begin; });
  uint64_t covered_end = 0;
  const std::string* covered_by = nullptr;
  for (const Range& r : ranges) {
    if (r.begin == r.end) continue;
    if (covered_by != nullptr && r.begin < covered_end) {
      return Malformed(absl::StrCat("tensors ", Quote(*covered_by), " and ",
                                    Quote(file.tensors_[r.tensor].name), " overlap"));
    }
    covered_end = r.end;
    covered_by = &file.tensors_[r.tensor].name;
  }

  // The string's heap buffer does not move when the file is moved, so views stay valid.
  file.bytes_ = std::move(bytes);
  for (const Range& r : ranges) {
    file.tensors_[r.tensor].bytes =
        absl::string_view(file.bytes_.data() + data_begin + r.begin, r.end - r.begin);
  }
  // tensors() is in name order (the JSON object's order), so listings are deterministic.
  return file;
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::ReadFile(const std::string& path,
                                                          uint64_t max_bytes) {
  absl::StatusOr<std::string> bytes = ReadRegularFile(path, max_bytes);
  if (!bytes.ok()) {
    return absl::Status(bytes.status().code(),
                        absl::StrCat("safetensors: ", bytes.status().message()));
  }
  absl::StatusOr<SafetensorsFile> file = Parse(*std::move(bytes));
  if (!file.ok()) {
    return absl::Status(file.status().code(),
                        absl::StrCat(file.status().message(), " (in '", path, "')"));
  }
  return file;
}

const SafetensorsTensor* SafetensorsFile::Find(absl::string_view name) const {
  for (const SafetensorsTensor& t : tensors_) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

absl::StatusOr<std::vector<float>> SafetensorsFile::ReadFloat32(absl::string_view name) const {
  const SafetensorsTensor* t = Find(name);
  if (t == nullptr) {
    return absl::NotFoundError(absl::StrCat("safetensors: no tensor named ", Quote(name)));
  }
  const size_t n = static_cast<size_t>(t->num_elements());
  std::vector<float> out(n);
  const char* src = t->bytes.data();
  // memcpy per element: tensor data need not be aligned in the buffer.
  switch (t->dtype) {
    case SafetensorsDtype::kF32:
      if (n > 0) std::memcpy(out.data(), src, n * sizeof(float));
      break;
    case SafetensorsDtype::kF64:
      for (size_t i = 0; i < n; ++i) {
        double d;
        std::memcpy(&d, src + i * sizeof(d), sizeof(d));
        out[i] = static_cast<float>(d);
      }
      break;
    case SafetensorsDtype::kBF16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t b;
        std::memcpy(&b, src + i * sizeof(b), sizeof(b));
        out[i] = Bf16::FromBits(b).ToFloat();
      }
      break;
    case SafetensorsDtype::kF16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t b;
        std::memcpy(&b, src + i * sizeof(b), sizeof(b));
        out[i] = Fp16::FromBits(b).ToFloat();
      }
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat("safetensors: tensor ", Quote(name),
                                                     " has dtype ", SafetensorsDtypeName(t->dtype),
                                                     ", not a floating-point type"));
  }
  return out;
}

void SafetensorsWriter::SetMetadata(const std::string& key, const std::string& value) {
  metadata_[key] = value;
}

void SafetensorsWriter::AddTensor(const std::string& name, SafetensorsDtype dtype,
                                  std::vector<int64_t> shape, absl::string_view raw_bytes) {
  entries_.push_back({name, dtype, std::move(shape), std::string(raw_bytes)});
}

void SafetensorsWriter::AddFloat32(const std::string& name, std::vector<int64_t> shape,
                                   absl::Span<const float> data) {
  AddTensor(
      name, SafetensorsDtype::kF32, std::move(shape),
      absl::string_view(reinterpret_cast<const char*>(data.data()), data.size() * sizeof(float)));
}

std::string SafetensorsWriter::Serialize() const {
  // Lay out the data first: each tensor starts on an 8-byte boundary. Tensors whose sizes are
  // multiples of 8 (all rotation files) end up contiguous, as strict readers require.
  Json header = Json::object();
  std::string data;
  for (const Entry& e : entries_) {
    while (data.size() % kAlignment != 0) data.push_back('\0');
    const uint64_t begin = data.size();
    data.append(e.bytes);
    header[e.name] = {{"dtype", std::string(SafetensorsDtypeName(e.dtype))},
                      {"shape", e.shape},
                      {"data_offsets", {begin, static_cast<uint64_t>(data.size())}}};
  }
  if (!metadata_.empty()) {
    Json meta = Json::object();
    for (const auto& [k, v] : metadata_) meta[k] = v;
    header["__metadata__"] = std::move(meta);
  }
  // Invalid UTF-8 in names or metadata is replaced instead of throwing.
  std::string header_text = header.dump(-1, ' ', false, Json::error_handler_t::replace);
  // Pad with spaces (valid JSON whitespace) so the data section starts 8-byte aligned.
  while ((8 + header_text.size()) % kAlignment != 0) header_text.push_back(' ');

  std::string out;
  out.reserve(8 + header_text.size() + data.size());
  AppendLittleEndianU64(header_text.size(), &out);
  out.append(header_text);
  out.append(data);
  return out;
}

absl::Status SafetensorsWriter::WriteFile(const std::string& path) const {
  const std::string bytes = Serialize();
  // Write to a temporary name and rename, so a reader never sees a half-written file.
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return absl::NotFoundError(absl::StrCat("safetensors: cannot create '", tmp, "'"));
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    out.flush();
    if (!out) {
      std::remove(tmp.c_str());
      return absl::DataLossError(absl::StrCat("safetensors: error writing '", tmp, "'"));
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    return absl::NotFoundError(
        absl::StrCat("safetensors: cannot rename '", tmp, "' to '", path, "'"));
  }
  return absl::OkStatus();
}

}  // namespace kvpool
