// The `kvpool` command-line tool against a real kvpoold: every command, files in and out
// (.npy and safetensors, bit-exact through an identity + bypass model), and plain error lines
// with the gRPC status code and exit status 1 (2 for usage errors).
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/npy.h"
#include "kernels/rotation_file.h"
#include "kernels/safetensors.h"
#include "tests/integration/integration_util.h"

namespace kvpool::integration {
namespace {

struct CliResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr
};

class CliTest : public DaemonTest {
 protected:
  void SetUp() override {
    DaemonTest::SetUp();
    absl::StatusOr<std::string> dir = client::MakeTempDir("kvpool-cli");
    ASSERT_TRUE(dir.ok());
    dir_ = *dir;
  }
  void TearDown() override { client::RemoveTree(dir_); }

  CliResult Run(const std::vector<std::string>& args, bool with_target = true) {
    std::string cmd = BinaryPath("KVPOOL_CLI", KVPOOL_CLI_PATH);
    if (with_target) absl::StrAppend(&cmd, " --target=", daemon().target());
    for (const std::string& a : args) absl::StrAppend(&cmd, " '", a, "'");
    absl::StrAppend(&cmd, " 2>&1");
    CliResult r;
    FILE* p = popen(cmd.c_str(), "r");
    if (p == nullptr) return r;
    char buf[4096];
    size_t n;
    while ((n = fread(buf, 1, sizeof(buf), p)) > 0) r.output.append(buf, n);
    const int status = pclose(p);
    r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    return r;
  }
  std::string Path(const std::string& name) const { return dir_ + "/" + name; }

  std::string dir_;
};

std::string DataOf(const std::string& npy_path) {
  absl::StatusOr<client::NpyArray> a = client::ReadNpyFile(npy_path);
  return a.ok() ? a->data : "(" + a.status().ToString() + ")";
}

TEST_F(CliTest, EveryCommandWorksAndErrorsArePlain) {
  CliResult r = Run({"health"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(absl::StrContains(r.output, "SERVING")) << r.output;

  r = Run({"register", "--model=cli-exact", "--q_heads=8", "--kv_heads=2", "--num_layers=2",
           "--head_dim=64", "--rotation=identity", "--quantizer=bypass"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(absl::StrContains(r.output, "registered")) << r.output;
  EXPECT_TRUE(absl::StrContains(r.output, "bypass")) << r.output;

  // A rotation file uploaded from disk.
  const ModelCodec codec{
      "cli-rh", *RotationSet::RandomizedHadamard(2, 64, 21), QuantConfig{}, false, "test", {}, {}};
  ASSERT_TRUE(WriteRotationFile(codec, Path("rot.safetensors")).ok());
  r = Run({"register", "--model=cli-rh", "--q_heads=8", "--kv_heads=2",
           "--rotation_file=" + Path("rot.safetensors")});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(absl::StrContains(r.output, "randomized_hadamard")) << r.output;

  r = Run({"models"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(absl::StrContains(r.output, "cli-exact") && absl::StrContains(r.output, "cli-rh"))
      << r.output;

  r = Run({"describe", "--model=cli-rh", "--rotation_out=" + Path("eff.safetensors")});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(absl::StrContains(r.output, "codec version")) << r.output;
  {
    absl::StatusOr<SafetensorsFile> f = SafetensorsFile::ReadFile(Path("eff.safetensors"));
    ASSERT_TRUE(f.ok()) << f.status();
    absl::StatusOr<std::vector<float>> m = f->ReadFloat32("layers.1.k_rotation");
    ASSERT_TRUE(m.ok()) << m.status();
    EXPECT_EQ(*m, codec.rotations.Matrix(1, KvTensor::kKey));
  }

  // put from .npy (BF16 as ml_dtypes writes it) with token ids, then read back bit for bit.
  const Shape shape;
  const SequenceKv kv = MakeSequenceKv(shape, 500, 31);
  std::string k, v;
  for (int l = 0; l < 2; ++l) {
    absl::StrAppend(&k, AsBytes(kv.k[l]));
    absl::StrAppend(&v, AsBytes(kv.v[l]));
  }
  ASSERT_TRUE(
      client::WriteNpyFile(Path("k.npy"), client::NpyDtype::kBF16, {2, 500, 2, 64}, k).ok());
  ASSERT_TRUE(
      client::WriteNpyFile(Path("v.npy"), client::NpyDtype::kBF16, {2, 500, 2, 64}, v).ok());
  std::vector<int32_t> ids(500);
  for (int i = 0; i < 500; ++i) ids[i] = 1000 + i;
  ASSERT_TRUE(client::WriteNpyFile(
                  Path("ids.npy"), client::NpyDtype::kI32, {500},
                  absl::string_view(reinterpret_cast<const char*>(ids.data()), ids.size() * 4))
                  .ok());
  r = Run({"put", "--create", "--model=cli-exact", "--sequence=cli-1", "--k=" + Path("k.npy"),
           "--v=" + Path("v.npy"), "--token_ids=" + Path("ids.npy"), "--chunk_bytes=65536"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(absl::StrContains(r.output, "appended 500 tokens x 2 layers")) << r.output;

  r = Run({"read", "--sequence=cli-1", "--out_k=" + Path("rk.npy"), "--out_v=" + Path("rv.npy")});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(DataOf(Path("rk.npy")) == k);
  EXPECT_TRUE(DataOf(Path("rv.npy")) == v);

  r = Run({"read", "--sequence=cli-1", "--layers=1", "--start=10", "--count=20", "--dtype=fp32",
           "--out=" + Path("r.safetensors")});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  {
    absl::StatusOr<SafetensorsFile> f = SafetensorsFile::ReadFile(Path("r.safetensors"));
    ASSERT_TRUE(f.ok()) << f.status();
    absl::StatusOr<std::vector<float>> got = f->ReadFloat32("k");
    ASSERT_TRUE(got.ok());
    ASSERT_EQ(got->size(), 20u * 128);
    for (size_t i = 0; i < got->size(); ++i) {
      ASSERT_EQ((*got)[i], kv.k[1][10 * 128 + i].ToFloat()) << i;
    }
    EXPECT_EQ(f->metadata().at("sequence_id"), "cli-1");
  }

  r = Run({"blocks", "--sequence=cli-1", "--out=" + Path("b.safetensors")});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  {
    absl::StatusOr<SafetensorsFile> f = SafetensorsFile::ReadFile(Path("b.safetensors"));
    ASSERT_TRUE(f.ok()) << f.status();
    const SafetensorsTensor* sink = f->Find("layers.0.sink_k");
    ASSERT_NE(sink, nullptr);
    EXPECT_TRUE(sink->bytes == AsBytes(kv.k[0]).substr(0, 64 * 128 * 2));
    EXPECT_NE(f->Find("layers.1.blocks"), nullptr);
  }

  r = Run({"attend", "--model=cli-exact", "--layer=1", "--sequence=cli-1,cli-1",
           "--random_q_seed=3", "--out=" + Path("o.npy")});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  {
    absl::StatusOr<client::NpyArray> o = client::ReadNpyFile(Path("o.npy"));
    ASSERT_TRUE(o.ok()) << o.status();
    EXPECT_EQ(o->shape, (std::vector<int64_t>{2, 1, 8, 64}));
  }

  r = Run({"lookup", "--model=cli-exact", "--token_ids=" + Path("ids.npy")});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(absl::StrContains(r.output, "matched")) << r.output;

  // put from a safetensors file into the quantized model.
  {
    SafetensorsWriter w;
    w.AddTensor("k", SafetensorsDtype::kBF16, {2, 500, 2, 64}, k);
    w.AddTensor("v", SafetensorsDtype::kBF16, {2, 500, 2, 64}, v);
    ASSERT_TRUE(w.WriteFile(Path("kv.safetensors")).ok());
  }
  r = Run({"create", "--model=cli-rh", "--sequence=cli-2"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = Run({"put", "--sequence=cli-2", "--kv=" + Path("kv.safetensors")});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = Run({"sequence", "--sequence=cli-2"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(absl::StrContains(r.output, "500 tokens = sink 64 + history 180 + recent 256"))
      << r.output;

  r = Run({"stats", "--sequences"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(absl::StrContains(r.output, "cli-2")) << r.output;
  r = Run({"seal", "--sequence=cli-2"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  r = Run({"release", "--sequence=cli-2"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  r = Run({"delete-model", "--model=cli-exact", "--force"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(absl::StrContains(r.output, "1 sequences released")) << r.output;

  // Errors: one plain line with the command and the status code.
  r = Run({"describe", "--model=missing"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_TRUE(absl::StrContains(r.output, "kvpool: describe: NOT_FOUND: ")) << r.output;
  r = Run({"describe", "--model=missing", "--request_id=cli-req-1"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_TRUE(absl::StrContains(r.output, "'missing' (request id cli-req-1)\n")) << r.output;
  r = Run({"put", "--sequence=cli-3"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_TRUE(absl::StrContains(r.output, "kvpool: put: INVALID_ARGUMENT: ")) << r.output;
  r = Run({"put", "--sequence=cli-2", "--k=" + Path("nope.npy"), "--v=" + Path("nope.npy")});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_TRUE(absl::StrContains(r.output, "NOT_FOUND")) << r.output;
  r = Run({"register", "--model=x", "--q_heads=8", "--kv_heads=3", "--num_layers=1",
           "--head_dim=64", "--rotation=hadamard"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_TRUE(absl::StrContains(r.output, "kvpool: register: INVALID_ARGUMENT: ")) << r.output;
  r = Run({"frobnicate"});
  EXPECT_EQ(r.exit_code, 2);
  r = Run({"--target=127.0.0.1:1", "--timeout_s=20", "health"}, /*with_target=*/false);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_TRUE(absl::StrContains(r.output, "kvpool: health: UNAVAILABLE: ")) << r.output;
}

}  // namespace
}  // namespace kvpool::integration
