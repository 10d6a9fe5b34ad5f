#include "server/model_registry.h"

#include <sys/stat.h>
#include <unistd.h>

#include <fstream>

#include "gtest/gtest.h"
#include "server/server_test_util.h"

namespace kvpool::server {
namespace {

using testing::SmallQuant;
using testing::TestCore;

ModelRegistration Req(const std::string& id, RotationKind kind, int q = 4, int kv = 2) {
  auto codec = DataFreeCodec(kind, 7, 2, 32, SmallQuant());
  EXPECT_TRUE(codec.ok()) << codec.status();
  ModelRegistration r(*std::move(codec));
  r.model_id = id;
  r.q_heads = q;
  r.kv_heads = kv;
  return r;
}

TEST(ModelRegistryTest, RegistersIdempotentlyAndRejectsConflicts) {
  TestCore core;
  auto a = core.registry->Register(kDefaultTenant, Req("m", RotationKind::kHadamard));
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_FALSE(a->already_registered);
  EXPECT_EQ(a->model->version_hex.size(), 64u);
  EXPECT_EQ(a->model->block_bytes, a->model->block_layout.block_bytes());
  auto again = core.registry->Register(kDefaultTenant, Req("m", RotationKind::kHadamard));
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(again->already_registered);
  EXPECT_TRUE(absl::IsAlreadyExists(
      core.registry->Register(kDefaultTenant, Req("m", RotationKind::kIdentity)).status()));
  // Same content under another tenant is another model.
  EXPECT_FALSE(
      core.registry->Register("tenant-b", Req("m", RotationKind::kIdentity))->already_registered);
  EXPECT_EQ(core.registry->List(kDefaultTenant).size(), 1u);
  EXPECT_TRUE(core.registry->Remove(kDefaultTenant, "m").ok());
  EXPECT_TRUE(absl::IsNotFound(core.registry->Get(kDefaultTenant, "m").status()));
}

TEST(ModelRegistryTest, ValidatesShapesIdsAndExpectedVersion) {
  TestCore core;
  EXPECT_TRUE(absl::IsInvalidArgument(
      core.registry->Register(kDefaultTenant, Req("m", RotationKind::kHadamard, 5, 2)).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(
      core.registry->Register(kDefaultTenant, Req("m", RotationKind::kHadamard, 4, 0)).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(
      core.registry->Register(kDefaultTenant, Req("", RotationKind::kHadamard)).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(
      core.registry->Register(kDefaultTenant, Req("a b", RotationKind::kHadamard)).status()));
  ModelRegistration r = Req("m", RotationKind::kHadamard);
  r.num_layers = 3;  // the rotation has 2
  EXPECT_TRUE(
      absl::IsInvalidArgument(core.registry->Register(kDefaultTenant, std::move(r)).status()));
  ModelRegistration v = Req("m", RotationKind::kHadamard);
  v.expected_codec_version = std::string(64, 'a');
  EXPECT_TRUE(
      absl::IsInvalidArgument(core.registry->Register(kDefaultTenant, std::move(v)).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(
      DataFreeCodec(RotationKind::kDense, 0, 2, 32, SmallQuant()).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(
      DataFreeCodec(RotationKind::kHadamard, 0, 2, 48, SmallQuant()).status()));
  QuantConfig bad = SmallQuant();
  bad.block_tokens = 12;
  auto codec = DataFreeCodec(RotationKind::kHadamard, 0, 2, 32, bad);
  ASSERT_TRUE(codec.ok());
  ModelRegistration q(*std::move(codec));
  q.model_id = "q";
  q.q_heads = 4;
  q.kv_heads = 2;
  EXPECT_TRUE(
      absl::IsInvalidArgument(core.registry->Register(kDefaultTenant, std::move(q)).status()));
}

TEST(ModelRegistryTest, ServerPathsStayInsideTheModelDirectory) {
  char tmpl[] = "/tmp/kvpool-models-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  constexpr uint64_t kMax = 1 << 20;
  std::ofstream(dir + "/model.safetensors") << "x";
  EXPECT_TRUE(absl::IsFailedPrecondition(ReadModelFile("", "model.safetensors", kMax).status()));
  auto ok = ReadModelFile(dir, "model.safetensors", kMax);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(*ok, "x");
  EXPECT_TRUE(ReadModelFile(dir, dir + "/model.safetensors", kMax).ok());
  EXPECT_TRUE(ReadModelFile(dir, "./sub/../model.safetensors", kMax).status().code() ==
              absl::StatusCode::kNotFound);  // "sub" does not exist
  // Outside the directory: one answer whether or not the target exists.
  for (const char* outside : {"../../etc/passwd", "../../etc/no-such-file", "/etc/passwd",
                              "/etc/no-such-file", "../../../../../../../../../etc/passwd"}) {
    EXPECT_TRUE(absl::IsPermissionDenied(ReadModelFile(dir, outside, kMax).status())) << outside;
  }
  ASSERT_EQ(symlink("/etc/passwd", (dir + "/link").c_str()), 0);
  ASSERT_EQ(symlink("/etc/no-such-file", (dir + "/dangling").c_str()), 0);
  ASSERT_EQ(symlink("../../etc/passwd", (dir + "/relative-link").c_str()), 0);
  for (const char* link : {"link", "dangling", "relative-link"}) {
    EXPECT_TRUE(absl::IsPermissionDenied(ReadModelFile(dir, link, kMax).status())) << link;
  }
  EXPECT_TRUE(absl::IsNotFound(ReadModelFile(dir, "missing.safetensors", kMax).status()));
  // Not regular files: refused, never read (a FIFO must not block the caller).
  ASSERT_EQ(mkdir((dir + "/subdir").c_str(), 0700), 0);
  ASSERT_EQ(mkfifo((dir + "/fifo").c_str(), 0600), 0);
  EXPECT_TRUE(absl::IsInvalidArgument(ReadModelFile(dir, "subdir", kMax).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(ReadModelFile(dir, "fifo", kMax).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(ReadModelFile(dir, ".", kMax).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(ReadModelFile(dir, "model.safetensors", 0).status()));
  for (const char* name : {"link", "dangling", "relative-link", "fifo", "model.safetensors"}) {
    unlink((dir + "/" + name).c_str());
  }
  rmdir((dir + "/subdir").c_str());
  rmdir(dir.c_str());
}

}  // namespace
}  // namespace kvpool::server
