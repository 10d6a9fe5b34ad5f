#include "client/npy.h"

#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "common/file_read.h"
#include "common/status_macros.h"

namespace kvpool::client {
namespace {

constexpr char kMagic[] = "\x93NUMPY";
constexpr size_t kMagicLen = 6;

struct DtypeEntry {
  const char* descr;
  NpyDtype dtype;
};

// Accepted descr strings. '|' (not applicable) is accepted for the 1- and 2-byte void type.
constexpr DtypeEntry kDtypes[] = {
    {"<f4", NpyDtype::kF32},  {"<f8", NpyDtype::kF64},  {"<f2", NpyDtype::kF16},
    {"<V2", NpyDtype::kBF16}, {"|V2", NpyDtype::kBF16}, {"bfloat16", NpyDtype::kBF16},
    {"<i4", NpyDtype::kI32},  {"<i8", NpyDtype::kI64},  {"<u4", NpyDtype::kU32},
    {"<u2", NpyDtype::kU16},  {"<i2", NpyDtype::kI16},
};

// A tiny scanner over the header's Python dict literal.
class HeaderScanner {
 public:
  explicit HeaderScanner(absl::string_view text) : text_(text) {}

  void SkipSpace() {
    while (pos_ < text_.size() && absl::ascii_isspace(static_cast<unsigned char>(text_[pos_]))) {
      ++pos_;
    }
  }
  bool Consume(char c) {
    SkipSpace();
    if (pos_ < text_.size() && text_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  bool Peek(char c) {
    SkipSpace();
    return pos_ < text_.size() && text_[pos_] == c;
  }
  absl::StatusOr<std::string> String() {
    SkipSpace();
    if (pos_ >= text_.size() || (text_[pos_] != '\'' && text_[pos_] != '"')) {
      return Error("expected a quoted string");
    }
    const char quote = text_[pos_++];
    const size_t end = text_.find(quote, pos_);
    if (end == absl::string_view::npos) return Error("unterminated string");
    std::string s(text_.substr(pos_, end - pos_));
    pos_ = end + 1;
    return s;
  }
  absl::StatusOr<std::string> Word() {
    SkipSpace();
    const size_t start = pos_;
    while (pos_ < text_.size() &&
           (absl::ascii_isalnum(static_cast<unsigned char>(text_[pos_])) || text_[pos_] == '_')) {
      ++pos_;
    }
    if (pos_ == start) return Error("expected a value");
    return std::string(text_.substr(start, pos_ - start));
  }
  absl::Status Error(absl::string_view what) const {
    return absl::InvalidArgumentError(
        absl::StrCat(".npy header: ", what, " at offset ", pos_, " of '", text_, "'"));
  }

 private:
  absl::string_view text_;
  size_t pos_ = 0;
};

absl::StatusOr<std::vector<int64_t>> ParseShape(HeaderScanner& s) {
  if (!s.Consume('(')) return s.Error("shape must be a tuple");
  std::vector<int64_t> shape;
  while (!s.Consume(')')) {
    auto word = s.Word();
    if (!word.ok()) return word.status();
    int64_t dim = 0;
    if (!absl::SimpleAtoi(*word, &dim) || dim < 0) return s.Error("bad dimension");
    shape.push_back(dim);
    if (!s.Consume(',') && !s.Peek(')')) return s.Error("expected ',' or ')' in shape");
  }
  return shape;
}

}  // namespace

size_t NpyDtypeSize(NpyDtype d) {
  switch (d) {
    case NpyDtype::kF64:
    case NpyDtype::kI64:
      return 8;
    case NpyDtype::kF32:
    case NpyDtype::kI32:
    case NpyDtype::kU32:
      return 4;
    case NpyDtype::kF16:
    case NpyDtype::kBF16:
    case NpyDtype::kU16:
    case NpyDtype::kI16:
      return 2;
  }
  return 0;
}

absl::string_view NpyDescr(NpyDtype d) {
  switch (d) {
    case NpyDtype::kF32:
      return "<f4";
    case NpyDtype::kF64:
      return "<f8";
    case NpyDtype::kF16:
      return "<f2";
    case NpyDtype::kBF16:
      return "<V2";
    case NpyDtype::kI32:
      return "<i4";
    case NpyDtype::kI64:
      return "<i8";
    case NpyDtype::kU32:
      return "<u4";
    case NpyDtype::kU16:
      return "<u2";
    case NpyDtype::kI16:
      return "<i2";
  }
  return "";
}

int64_t NpyArray::num_elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

absl::StatusOr<NpyArray> ParseNpy(std::string bytes) {
  if (bytes.size() < kMagicLen + 4 || std::memcmp(bytes.data(), kMagic, kMagicLen) != 0) {
    return absl::InvalidArgumentError("not a .npy file (bad magic)");
  }
  const int major = static_cast<unsigned char>(bytes[6]);
  size_t header_len = 0;
  size_t header_start = 0;
  if (major == 1) {
    header_len = static_cast<unsigned char>(bytes[8]) |
                 (static_cast<size_t>(static_cast<unsigned char>(bytes[9])) << 8);
    header_start = 10;
  } else if (major == 2 || major == 3) {
    if (bytes.size() < 12) return absl::InvalidArgumentError(".npy file truncated");
    for (int i = 0; i < 4; ++i) {
      header_len |= static_cast<size_t>(static_cast<unsigned char>(bytes[8 + i])) << (8 * i);
    }
    header_start = 12;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("unsupported .npy version ", major));
  }
  if (header_len > bytes.size() - header_start) {
    return absl::InvalidArgumentError(".npy header runs past the end of the file");
  }
  const absl::string_view header(bytes.data() + header_start, header_len);

  HeaderScanner s(header);
  if (!s.Consume('{')) return s.Error("expected '{'");
  bool have_descr = false, have_order = false, have_shape = false;
  NpyArray array;
  while (!s.Consume('}')) {
    auto key = s.String();
    if (!key.ok()) return key.status();
    if (!s.Consume(':')) return s.Error("expected ':'");
    if (*key == "descr") {
      if (s.Peek('[')) return s.Error("structured dtypes are not supported");
      auto descr = s.String();
      if (!descr.ok()) return descr.status();
      bool found = false;
      for (const DtypeEntry& e : kDtypes) {
        if (*descr == e.descr) {
          array.dtype = e.dtype;
          found = true;
        }
      }
      if (!found) {
        return absl::InvalidArgumentError(absl::StrCat(
            ".npy dtype '", *descr,
            "' is not supported (little-endian f4, f8, f2, bfloat16 (V2), i4, i8, u4, u2, i2)"));
      }
      have_descr = true;
    } else if (*key == "fortran_order") {
      auto word = s.Word();
      if (!word.ok()) return word.status();
      if (*word == "True") {
        return absl::InvalidArgumentError(
            ".npy arrays in Fortran order are not supported (save with np.ascontiguousarray)");
      }
      if (*word != "False") return s.Error("fortran_order must be True or False");
      have_order = true;
    } else if (*key == "shape") {
      auto shape = ParseShape(s);
      if (!shape.ok()) return shape.status();
      array.shape = *std::move(shape);
      have_shape = true;
    } else {
      return s.Error(absl::StrCat("unknown key '", *key, "'"));
    }
    if (!s.Consume(',') && !s.Peek('}')) return s.Error("expected ',' or '}'");
  }
  if (!have_descr || !have_order || !have_shape) {
    return absl::InvalidArgumentError(".npy header lacks descr, fortran_order or shape");
  }

  const size_t data_start = header_start + header_len;
  const size_t elem = NpyDtypeSize(array.dtype);
  uint64_t elements = 1;
  for (int64_t d : array.shape) {
    if (d != 0 && elements > std::numeric_limits<uint64_t>::max() / 16 / static_cast<uint64_t>(d)) {
      return absl::InvalidArgumentError(".npy shape is too large");
    }
    elements *= static_cast<uint64_t>(d);
  }
  const uint64_t want = elements * elem;
  if (bytes.size() - data_start != want) {
    return absl::InvalidArgumentError(absl::StrCat(".npy data holds ", bytes.size() - data_start,
                                                   " bytes; the shape needs ", want));
  }
  bytes.erase(0, data_start);
  array.data = std::move(bytes);
  return array;
}

absl::StatusOr<NpyArray> ReadNpyFile(const std::string& path) {
  KVPOOL_ASSIGN_OR_RETURN(std::string bytes,
                          ReadRegularFile(path, std::numeric_limits<uint64_t>::max()));
  auto parsed = ParseNpy(std::move(bytes));
  if (!parsed.ok()) {
    return absl::Status(parsed.status().code(),
                        absl::StrCat(path, ": ", parsed.status().message()));
  }
  return parsed;
}

absl::StatusOr<std::string> SerializeNpy(NpyDtype dtype, const std::vector<int64_t>& shape,
                                         absl::string_view data) {
  uint64_t elements = 1;
  for (int64_t d : shape) {
    if (d < 0) return absl::InvalidArgumentError("negative dimension");
    elements *= static_cast<uint64_t>(d);
  }
  if (elements * NpyDtypeSize(dtype) != data.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "data holds ", data.size(), " bytes; the shape needs ", elements * NpyDtypeSize(dtype)));
  }
  std::string dict =
      absl::StrCat("{'descr': '", NpyDescr(dtype), "', 'fortran_order': False, 'shape': (",
                   absl::StrJoin(shape, ", "), shape.size() == 1 ? ",), }" : "), }");
  // Pad with spaces so that magic + version + length + header (ending in '\n') is a multiple
  // of 64.
  size_t prefix = kMagicLen + 2 + 2;
  int major = 1;
  if (dict.size() + 1 + prefix > 65535) {
    prefix = kMagicLen + 2 + 4;
    major = 2;
  }
  const size_t total = (prefix + dict.size() + 1 + 63) / 64 * 64;
  dict.append(total - prefix - dict.size() - 1, ' ');
  dict.push_back('\n');

  std::string out(kMagic, kMagicLen);
  out.push_back(static_cast<char>(major));
  out.push_back(0);
  const size_t len = dict.size();
  out.push_back(static_cast<char>(len & 0xff));
  out.push_back(static_cast<char>((len >> 8) & 0xff));
  if (major == 2) {
    out.push_back(static_cast<char>((len >> 16) & 0xff));
    out.push_back(static_cast<char>((len >> 24) & 0xff));
  }
  out += dict;
  out.append(data.data(), data.size());
  return out;
}

absl::Status WriteNpyFile(const std::string& path, NpyDtype dtype,
                          const std::vector<int64_t>& shape, absl::string_view data) {
  auto bytes = SerializeNpy(dtype, shape, data);
  if (!bytes.ok()) return bytes.status();
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return absl::PermissionDeniedError(absl::StrCat("cannot write '", path, "'"));
  out.write(bytes->data(), static_cast<std::streamsize>(bytes->size()));
  if (!out.good()) return absl::DataLossError(absl::StrCat("short write to '", path, "'"));
  return absl::OkStatus();
}

NpyArray AsBf16Words(NpyArray a) {
  if (a.dtype == NpyDtype::kU16 || a.dtype == NpyDtype::kI16) a.dtype = NpyDtype::kBF16;
  return a;
}

}  // namespace kvpool::client
