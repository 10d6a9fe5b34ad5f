#include "client/kv_files.h"

#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/bf16.h"
#include "kernels/safetensors.h"

namespace kvpool::client {
namespace {

std::string TempPath(const std::string& name) {
  return ::testing::TempDir() + "/" + std::to_string(getpid()) + "_" + name;
}

std::string Bf16Bytes(size_t n, float base) {
  std::string out(n * 2, '\0');
  for (size_t i = 0; i < n; ++i) {
    const Bf16 b = Bf16::FromFloat(base + static_cast<float>(i));
    std::memcpy(&out[i * 2], &b.bits, 2);
  }
  return out;
}

TEST(KvFilesTest, LoadsStackedSafetensors) {
  const int layers = 3, tokens = 5, heads = 2, dim = 4;
  const size_t n = size_t{layers} * tokens * heads * dim;
  const std::string k = Bf16Bytes(n, 0), v = Bf16Bytes(n, 1000);
  SafetensorsWriter w;
  w.AddTensor("k", SafetensorsDtype::kBF16, {layers, tokens, heads, dim}, k);
  w.AddTensor("v", SafetensorsDtype::kBF16, {layers, tokens, heads, dim}, v);
  const int64_t ids[tokens] = {10, 11, 12, 13, 14};
  w.AddTensor("token_ids", SafetensorsDtype::kI64, {tokens},
              absl::string_view(reinterpret_cast<const char*>(ids), sizeof(ids)));
  const std::string path = TempPath("stacked.safetensors");
  ASSERT_TRUE(w.WriteFile(path).ok());

  absl::StatusOr<KvHistory> kv = LoadKvSafetensors(path);
  ASSERT_TRUE(kv.ok()) << kv.status();
  EXPECT_EQ(kv->dtype, v1::DTYPE_BF16);
  EXPECT_EQ(kv->num_layers, layers);
  EXPECT_EQ(kv->num_tokens, tokens);
  EXPECT_EQ(kv->kv_heads, heads);
  EXPECT_EQ(kv->head_dim, dim);
  const size_t layer_bytes = n / layers * 2;
  for (int l = 0; l < layers; ++l) {
    EXPECT_EQ(kv->k[l], k.substr(l * layer_bytes, layer_bytes));
    EXPECT_EQ(kv->v[l], v.substr(l * layer_bytes, layer_bytes));
  }
  EXPECT_EQ(kv->token_ids, (std::vector<uint32_t>{10, 11, 12, 13, 14}));
  unlink(path.c_str());
}

TEST(KvFilesTest, LoadsPerLayerSafetensorsAndNarrowsF64) {
  const int tokens = 2, heads = 1, dim = 4;
  SafetensorsWriter w;
  for (int l = 0; l < 2; ++l) {
    std::vector<double> values(tokens * heads * dim, 0.5 + l);
    const absl::string_view raw(reinterpret_cast<const char*>(values.data()),
                                values.size() * sizeof(double));
    w.AddTensor("layers." + std::to_string(l) + ".k", SafetensorsDtype::kF64, {tokens, heads, dim},
                raw);
    w.AddTensor("layers." + std::to_string(l) + ".v", SafetensorsDtype::kF64, {tokens, heads, dim},
                raw);
  }
  const std::string path = TempPath("layers.safetensors");
  ASSERT_TRUE(w.WriteFile(path).ok());
  absl::StatusOr<KvHistory> kv = LoadKvSafetensors(path);
  ASSERT_TRUE(kv.ok()) << kv.status();
  EXPECT_EQ(kv->dtype, v1::DTYPE_FP32);
  ASSERT_EQ(kv->num_layers, 2);
  ASSERT_EQ(kv->k[1].size(), tokens * heads * dim * sizeof(float));
  float f;
  std::memcpy(&f, kv->k[1].data(), 4);
  EXPECT_EQ(f, 1.5f);
  unlink(path.c_str());
}

TEST(KvFilesTest, RejectsMismatchedOrMissingTensors) {
  SafetensorsWriter w;
  w.AddTensor("k", SafetensorsDtype::kBF16, {1, 2, 1, 4}, Bf16Bytes(8, 0));
  w.AddTensor("v", SafetensorsDtype::kBF16, {1, 1, 2, 4}, Bf16Bytes(8, 0));
  const std::string path = TempPath("bad.safetensors");
  ASSERT_TRUE(w.WriteFile(path).ok());
  EXPECT_EQ(LoadKvSafetensors(path).status().code(), absl::StatusCode::kInvalidArgument);

  SafetensorsWriter only_k;
  only_k.AddTensor("k", SafetensorsDtype::kBF16, {1, 2, 1, 4}, Bf16Bytes(8, 0));
  ASSERT_TRUE(only_k.WriteFile(path).ok());
  EXPECT_EQ(LoadKvSafetensors(path).status().code(), absl::StatusCode::kInvalidArgument);

  SafetensorsWriter ints;
  ints.AddTensor("k", SafetensorsDtype::kI32, {2, 1, 1}, std::string(8, '\0'));
  ints.AddTensor("v", SafetensorsDtype::kI32, {2, 1, 1}, std::string(8, '\0'));
  ASSERT_TRUE(ints.WriteFile(path).ok());
  EXPECT_EQ(LoadKvSafetensors(path).status().code(), absl::StatusCode::kInvalidArgument);
  unlink(path.c_str());
}

TEST(KvFilesTest, LoadsNpyPairAndTokenIds) {
  const std::string k = Bf16Bytes(2 * 3 * 1 * 4, 0), v = Bf16Bytes(2 * 3 * 1 * 4, 7);
  const std::string kp = TempPath("k.npy"), vp = TempPath("v.npy");
  ASSERT_TRUE(WriteNpyFile(kp, NpyDtype::kBF16, {2, 3, 1, 4}, k).ok());
  ASSERT_TRUE(WriteNpyFile(vp, NpyDtype::kBF16, {2, 3, 1, 4}, v).ok());
  absl::StatusOr<KvHistory> kv = LoadKvNpy(kp, vp);
  ASSERT_TRUE(kv.ok()) << kv.status();
  EXPECT_EQ(kv->num_layers, 2);
  EXPECT_EQ(kv->num_tokens, 3);
  EXPECT_EQ(kv->k[0] + kv->k[1], k);
  EXPECT_EQ(kv->v[0] + kv->v[1], v);

  NpyArray ids;
  ids.dtype = NpyDtype::kI32;
  ids.shape = {2};
  const int32_t raw[2] = {5, -1};
  ids.data.assign(reinterpret_cast<const char*>(raw), sizeof(raw));
  EXPECT_EQ(TokenIdsFromNpy(ids).status().code(), absl::StatusCode::kInvalidArgument);
  const int32_t good[2] = {5, 6};
  ids.data.assign(reinterpret_cast<const char*>(good), sizeof(good));
  EXPECT_EQ(*TokenIdsFromNpy(ids), (std::vector<uint32_t>{5, 6}));
  unlink(kp.c_str());
  unlink(vp.c_str());
}

TEST(KvFilesTest, NpyToFloatConvertsHalfTypes) {
  NpyArray a;
  a.dtype = NpyDtype::kF16;
  a.shape = {2};
  const uint16_t words[2] = {Fp16::FromFloat(1.5f).bits, Fp16::FromFloat(-2.0f).bits};
  a.data.assign(reinterpret_cast<const char*>(words), sizeof(words));
  EXPECT_EQ(*NpyToFloat(a), (std::vector<float>{1.5f, -2.0f}));
  a.dtype = NpyDtype::kI16;
  EXPECT_FALSE(NpyToFloat(a).ok());
}

}  // namespace
}  // namespace kvpool::client
