#include "client/npy.h"

#include <cstring>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace kvpool::client {
namespace {

std::string Header(absl::string_view dict, int major = 1) {
  std::string out = "\x93NUMPY";
  out.push_back(static_cast<char>(major));
  out.push_back(0);
  std::string text(dict);
  const size_t prefix = major == 1 ? 10 : 12;
  while ((prefix + text.size() + 1) % 64 != 0) text.push_back(' ');
  text.push_back('\n');
  out.push_back(static_cast<char>(text.size() & 0xff));
  out.push_back(static_cast<char>(text.size() >> 8));
  if (major != 1) out.append(2, '\0');
  return out + text;
}

TEST(NpyTest, RoundTripsEveryDtypeAndShape) {
  const std::vector<std::pair<NpyDtype, std::vector<int64_t>>> cases = {
      {NpyDtype::kF32, {2, 3}},     {NpyDtype::kF64, {5}}, {NpyDtype::kF16, {1, 2, 3, 4}},
      {NpyDtype::kBF16, {3, 1, 8}}, {NpyDtype::kI32, {7}}, {NpyDtype::kI64, {2, 2}},
      {NpyDtype::kU32, {0, 4}},     {NpyDtype::kU16, {}},
  };
  for (const auto& [dtype, shape] : cases) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    std::string data(n * NpyDtypeSize(dtype), '\0');
    for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 7 + 1);
    absl::StatusOr<std::string> bytes = SerializeNpy(dtype, shape, data);
    ASSERT_TRUE(bytes.ok()) << bytes.status();
    EXPECT_EQ((bytes->size() - data.size()) % 64, 0u) << "data starts 64-byte aligned";
    absl::StatusOr<NpyArray> a = ParseNpy(*bytes);
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_EQ(a->dtype, dtype);
    EXPECT_EQ(a->shape, shape);
    EXPECT_EQ(a->data, data);
  }
}

TEST(NpyTest, ParsesHeadersAsNumpyWritesThem) {
  // Exactly what numpy 1.x writes for np.zeros((2, 3), np.float32), with data.
  std::string bytes = Header("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }");
  const float values[6] = {1, 2, 3, 4, 5, 6};
  bytes.append(reinterpret_cast<const char*>(values), sizeof(values));
  absl::StatusOr<NpyArray> a = ParseNpy(bytes);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(a->data_as<float>()[5], 6.0f);

  // One-element tuple, keys in another order, version 2.0, ml_dtypes bfloat16.
  std::string v2 = Header("{'shape': (3,), 'fortran_order': False, 'descr': '<V2'}", 2);
  v2.append(6, '\x01');
  a = ParseNpy(v2);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->dtype, NpyDtype::kBF16);
  EXPECT_EQ(a->shape, (std::vector<int64_t>{3}));

  // Scalar.
  std::string scalar = Header("{'descr': '<i8', 'fortran_order': False, 'shape': (), }");
  scalar.append(8, '\0');
  a = ParseNpy(scalar);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_TRUE(a->shape.empty());
  EXPECT_EQ(a->num_elements(), 1);
}

TEST(NpyTest, RejectsWhatItCannotRead) {
  auto parse = [](std::string s) { return ParseNpy(std::move(s)).status(); };
  EXPECT_EQ(parse("not numpy").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(parse(Header("{'descr': '>f4', 'fortran_order': False, 'shape': (1,), }") +
                  std::string(4, '\0'))
                .code(),
            absl::StatusCode::kInvalidArgument);  // big-endian
  EXPECT_EQ(parse(Header("{'descr': '<f4', 'fortran_order': True, 'shape': (1,), }") +
                  std::string(4, '\0'))
                .code(),
            absl::StatusCode::kInvalidArgument);  // Fortran order
  EXPECT_EQ(parse(Header("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }") +
                  std::string(4, '\0'))
                .code(),
            absl::StatusCode::kInvalidArgument);  // data too short
  EXPECT_EQ(
      parse(Header("{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (1,), }")).code(),
      absl::StatusCode::kInvalidArgument);  // structured
  EXPECT_EQ(parse(Header("{'descr': '<f4', 'shape': (1,), }") + std::string(4, '\0')).code(),
            absl::StatusCode::kInvalidArgument);  // missing key
  std::string truncated = Header("{'descr': '<f4', 'fortran_order': False, 'shape': (1,), }");
  truncated.resize(20);
  EXPECT_EQ(parse(truncated).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(SerializeNpy(NpyDtype::kF32, {2}, "abc").ok());
}

TEST(NpyTest, ReadsMissingFileAsNotFound) {
  EXPECT_EQ(ReadNpyFile("/nonexistent/x.npy").status().code(), absl::StatusCode::kNotFound);
}

TEST(NpyTest, AsBf16WordsRelabelsIntegerWords) {
  NpyArray a;
  a.dtype = NpyDtype::kI16;
  a.shape = {1};
  a.data = std::string(2, '\0');
  EXPECT_EQ(AsBf16Words(a).dtype, NpyDtype::kBF16);
  a.dtype = NpyDtype::kF32;
  EXPECT_EQ(AsBf16Words(a).dtype, NpyDtype::kF32);
}

}  // namespace
}  // namespace kvpool::client
