#include "kernels/safetensors.h"

#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/bf16.h"

namespace kvpool {
namespace {

using ::testing::HasSubstr;

std::string U64(uint64_t v) {
  std::string s;
  for (int i = 0; i < 8; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  return s;
}

// A file from a literal JSON header and a data section.
std::string Build(const std::string& header, const std::string& data) {
  return U64(header.size()) + header + data;
}

void ExpectInvalid(const std::string& bytes, const std::string& what) {
  absl::StatusOr<SafetensorsFile> f = SafetensorsFile::Parse(bytes);
  ASSERT_FALSE(f.ok()) << "accepted: " << what;
  EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument) << what;
}

TEST(SafetensorsTest, RoundTripPreservesTensorsAndMetadata) {
  SafetensorsWriter w;
  w.SetMetadata("model_id", "smollm2-135m");
  w.SetMetadata("kind", "dense");
  const std::vector<float> a = {1.0f, -2.5f, 3.25f, 0.0f, 1e-30f, -7.0f};
  const std::vector<float> b = {42.0f};  // odd byte size: next tensor needs padding
  w.AddFloat32("layers.0.k_rotation", {2, 3}, a);
  w.AddFloat32("odd", {1}, b);
  const std::vector<uint16_t> bf = {Bf16::FromFloat(1.5f).bits, Bf16::FromFloat(-3.0f).bits};
  w.AddTensor("bf", SafetensorsDtype::kBF16, {2},
              absl::string_view(reinterpret_cast<const char*>(bf.data()), 4));
  const std::vector<int32_t> ints = {7, -8, 9};
  w.AddTensor("ints", SafetensorsDtype::kI32, {3},
              absl::string_view(reinterpret_cast<const char*>(ints.data()), 12));
  w.AddTensor("empty", SafetensorsDtype::kF32, {0, 4}, "");
  const std::string bytes = w.Serialize();

  uint64_t header_len = 0;
  std::memcpy(&header_len, bytes.data(), 8);
  EXPECT_EQ((8 + header_len) % 8, 0u) << "data section must start 8-byte aligned";

  absl::StatusOr<SafetensorsFile> f = SafetensorsFile::Parse(bytes);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->metadata().at("model_id"), "smollm2-135m");
  EXPECT_EQ(f->metadata().at("kind"), "dense");
  EXPECT_EQ(f->tensors().size(), 5u);

  const SafetensorsTensor* t = f->Find("layers.0.k_rotation");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->dtype, SafetensorsDtype::kF32);
  EXPECT_EQ(t->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(t->num_elements(), 6);
  EXPECT_EQ(*f->ReadFloat32("layers.0.k_rotation"), a);
  EXPECT_EQ(*f->ReadFloat32("odd"), b);
  EXPECT_EQ(*f->ReadFloat32("bf"), (std::vector<float>{1.5f, -3.0f}));
  EXPECT_TRUE(f->ReadFloat32("empty")->empty());
  const SafetensorsTensor* it = f->Find("ints");
  ASSERT_NE(it, nullptr);
  std::vector<int32_t> read_ints(3);
  std::memcpy(read_ints.data(), it->bytes.data(), 12);
  EXPECT_EQ(read_ints, ints);

  EXPECT_EQ(f->Find("nope"), nullptr);
  EXPECT_EQ(f->ReadFloat32("nope").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(f->ReadFloat32("ints").status().code(), absl::StatusCode::kInvalidArgument);

  // Moving the file keeps the tensor views valid.
  SafetensorsFile moved = std::move(*f);
  EXPECT_EQ(*moved.ReadFloat32("layers.0.k_rotation"), a);
}

TEST(SafetensorsTest, ReadsF16AndF64) {
  const double d[2] = {0.5, -1.25};
  const uint16_t h[2] = {Fp16::FromFloat(2.0f).bits, Fp16::FromFloat(-0.5f).bits};
  std::string data(reinterpret_cast<const char*>(d), 16);
  data.append(reinterpret_cast<const char*>(h), 4);
  const std::string bytes = Build(R"({"d":{"dtype":"F64","shape":[2],"data_offsets":[0,16]},)"
                                  R"("h":{"dtype":"F16","shape":[2],"data_offsets":[16,20]}})",
                                  data);
  absl::StatusOr<SafetensorsFile> f = SafetensorsFile::Parse(bytes);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(*f->ReadFloat32("d"), (std::vector<float>{0.5f, -1.25f}));
  EXPECT_EQ(*f->ReadFloat32("h"), (std::vector<float>{2.0f, -0.5f}));
}

TEST(SafetensorsTest, FileRoundTrip) {
  SafetensorsWriter w;
  w.SetMetadata("k", "v");
  const std::vector<float> a = {1, 2, 3, 4};
  w.AddFloat32("a", {2, 2}, a);
  const std::string path = ::testing::TempDir() + "/safetensors_test_roundtrip.safetensors";
  ASSERT_TRUE(w.WriteFile(path).ok());
  absl::StatusOr<SafetensorsFile> f = SafetensorsFile::ReadFile(path);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(*f->ReadFloat32("a"), a);
  EXPECT_EQ(f->metadata().at("k"), "v");
  std::remove(path.c_str());

  absl::StatusOr<SafetensorsFile> missing = SafetensorsFile::ReadFile(path + ".does-not-exist");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
}

TEST(SafetensorsTest, RejectsBadLengths) {
  ExpectInvalid("", "empty file");
  ExpectInvalid("\x02\x00\x00", "short length prefix");
  ExpectInvalid(U64(100) + "{}", "header longer than file");
  ExpectInvalid(U64(~0ull) + "{}", "huge header length");
  ExpectInvalid(U64(200ull << 20) + "{}", "header above 100 MB");
}

TEST(SafetensorsTest, RejectsNonObjectOrBrokenJson) {
  ExpectInvalid(Build("[1,2,3]", ""), "array header");
  ExpectInvalid(Build("\"x\"", ""), "string header");
  ExpectInvalid(Build("42", ""), "number header");
  ExpectInvalid(Build("{\"a\":", ""), "truncated JSON");
  ExpectInvalid(Build("{\"a\":1}", ""), "tensor entry not an object");
  ExpectInvalid(Build("{\"__metadata__\":[]}", ""), "metadata not an object");
  ExpectInvalid(Build("{\"__metadata__\":{\"a\":1}}", ""), "metadata value not a string");
  ExpectInvalid(Build(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                      R"("a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                      std::string(8, '\0')),
                "duplicate tensor names");
  // An empty header object is a valid, empty file.
  EXPECT_TRUE(SafetensorsFile::Parse(Build("{}", "")).ok());
}

TEST(SafetensorsTest, RejectsBadTensorEntries) {
  const std::string data(16, '\0');
  auto entry = [&](const std::string& body) { return Build("{\"t\":" + body + "}", data); };
  ExpectInvalid(entry(R"({"shape":[1],"data_offsets":[0,4]})"), "no dtype");
  ExpectInvalid(entry(R"({"dtype":"Q4","shape":[1],"data_offsets":[0,4]})"), "unknown dtype");
  ExpectInvalid(entry(R"({"dtype":3,"shape":[1],"data_offsets":[0,4]})"), "dtype not string");
  ExpectInvalid(entry(R"({"dtype":"F32","data_offsets":[0,4]})"), "no shape");
  ExpectInvalid(entry(R"({"dtype":"F32","shape":[-1],"data_offsets":[0,4]})"), "negative dim");
  ExpectInvalid(entry(R"({"dtype":"F32","shape":[1.5],"data_offsets":[0,4]})"), "float dim");
  ExpectInvalid(entry(R"({"dtype":"F32","shape":"1","data_offsets":[0,4]})"), "shape string");
  ExpectInvalid(entry(R"({"dtype":"F32","shape":[1]})"), "no offsets");
  ExpectInvalid(entry(R"({"dtype":"F32","shape":[1],"data_offsets":[0]})"), "one offset");
  ExpectInvalid(entry(R"({"dtype":"F32","shape":[1],"data_offsets":[0,4,8]})"), "three offsets");
  ExpectInvalid(entry(R"({"dtype":"F32","shape":[1],"data_offsets":[-4,0]})"), "negative offset");
  ExpectInvalid(entry(R"({"dtype":"F32","shape":[1],"data_offsets":[8,4]})"), "reversed offsets");
  ExpectInvalid(entry(R"({"dtype":"F32","shape":[1],"data_offsets":[16,20]})"), "past end");
  ExpectInvalid(entry(R"({"dtype":"F32","shape":[1],"data_offsets":[0,18446744073709551615]})"),
                "offset at u64 max");
  ExpectInvalid(entry(R"({"dtype":"F32","shape":[2],"data_offsets":[0,4]})"), "size mismatch");
  ExpectInvalid(entry(R"({"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,4]})"),
                "shape overflow");
  ExpectInvalid(entry(R"({"dtype":"F64","shape":[2305843009213693952],"data_offsets":[0,4]})"),
                "bytes overflow");
  EXPECT_TRUE(
      SafetensorsFile::Parse(entry(R"({"dtype":"F32","shape":[2,2],"data_offsets":[0,16]})")).ok());
}

TEST(SafetensorsTest, RejectsOverlappingTensors) {
  const std::string data(16, '\0');
  absl::StatusOr<SafetensorsFile> f =
      SafetensorsFile::Parse(Build(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                   R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                                   data));
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(f.status().message()), HasSubstr("overlap"));
  ExpectInvalid(Build(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
                      R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                      data),
                "nested range");
  // Adjacent tensors and empty ones in the middle of others are fine.
  EXPECT_TRUE(
      SafetensorsFile::Parse(Build(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                   R"("e":{"dtype":"F32","shape":[0],"data_offsets":[4,4]},)"
                                   R"("b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})",
                                   data))
          .ok());
}

// Random mutations of a valid file must give OK or a status, never a crash (ASan-clean under
// the sanitizer build).
TEST(SafetensorsTest, FuzzedMutationsNeverCrash) {
  SafetensorsWriter w;
  w.SetMetadata("model_id", "m");
  std::vector<float> a(64);
  for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>(i) * 0.5f;
  w.AddFloat32("layers.0.k_rotation", {8, 8}, a);
  w.AddFloat32("layers.0.v_rotation", {4, 4}, absl::MakeConstSpan(a).subspan(0, 16));
  const std::string base = w.Serialize();

  std::mt19937_64 rng(12345);
  int accepted = 0;
  for (int iter = 0; iter < 20000; ++iter) {
    std::string bytes = base;
    const int mutations = 1 + static_cast<int>(rng() % 4);
    for (int m = 0; m < mutations; ++m) {
      switch (rng() % 5) {
        case 0:  // flip a byte
          if (!bytes.empty()) bytes[rng() % bytes.size()] = static_cast<char>(rng());
          break;
        case 1:  // truncate
          bytes.resize(rng() % (bytes.size() + 1));
          break;
        case 2:  // insert a byte
          bytes.insert(bytes.begin() + static_cast<std::ptrdiff_t>(rng() % (bytes.size() + 1)),
                       static_cast<char>(rng()));
          break;
        case 3:  // perturb a byte in the header region, where structure lives
          if (bytes.size() > 8) {
            const size_t hdr_end = std::min<size_t>(bytes.size(), 200);
            bytes[8 + rng() % (hdr_end - 8)] = "{}[]\",:0123456789-e.ab"[rng() % 22];
          }
          break;
        default:  // rewrite the length prefix
          if (bytes.size() >= 8) {
            const std::string len = U64(rng() % (bytes.size() + 16));
            bytes.replace(0, 8, len);
          }
          break;
      }
    }
    absl::StatusOr<SafetensorsFile> f = SafetensorsFile::Parse(bytes);
    if (!f.ok()) {
      EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument);
      continue;
    }
    ++accepted;
    for (const SafetensorsTensor& t : f->tensors()) {
      (void)f->ReadFloat32(t.name);  // must be in bounds for any accepted file
    }
  }
  EXPECT_GT(accepted, 0);
}

TEST(SafetensorsTest, Names) {
  EXPECT_EQ(SafetensorsDtypeName(SafetensorsDtype::kBF16), "BF16");
  EXPECT_EQ(SafetensorsDtypeSize(SafetensorsDtype::kF64), 8u);
  EXPECT_EQ(SafetensorsDtypeSize(SafetensorsDtype::kBool), 1u);
}

}  // namespace
}  // namespace kvpool
