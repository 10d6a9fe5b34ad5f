// What a hostile client tried against a real kvpoold, each case a request that once crashed the
// daemon, pinned its memory or got a misleading answer: not-regular files named by server paths,
// values that overflow attention, unbounded layer lists, megabyte ids echoed in messages,
// server paths that reveal which files exist, unbounded model windows, and decode appends that
// reserve pages for data they do not carry. Each gets a precise status, changes nothing, and the
// daemon keeps serving.
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kernels/rotation_file.h"
#include "tests/integration/integration_util.h"

namespace kvpool::integration {
namespace {

using C = absl::StatusCode;

constexpr Shape kShape{/*num_layers=*/2, /*q_heads=*/8, /*kv_heads=*/2, /*head_dim=*/64};
constexpr size_t kRowValues = 2 * 64;

class HostileClientTest : public DaemonTest {
 protected:
  static void SetUpTestSuite() {
    absl::StatusOr<std::string> dir = client::MakeTempDir("kvpool-models");
    ASSERT_TRUE(dir.ok());
    model_dir_ = *dir;
    const ModelCodec codec{
        "file-model", *RotationSet::Hadamard(2, 64), QuantConfig{}, false, "hadamard", {}, {}};
    ASSERT_TRUE(WriteRotationFile(codec, model_dir_ + "/hadamard.safetensors").ok());
    ASSERT_EQ(mkdir((model_dir_ + "/a-directory").c_str(), 0700), 0);
    ASSERT_EQ(mkfifo((model_dir_ + "/a-fifo").c_str(), 0600), 0);
    StartSuiteDaemon({"--pool_bytes=67108864", "--worker_threads=2", "--model_dir=" + model_dir_});
  }
  static void TearDownTestSuite() {
    DaemonTest::TearDownTestSuite();
    client::RemoveTree(model_dir_);
  }

  void ExpectRejected(absl::StatusCode code, const std::string& what,
                      const std::function<absl::Status()>& call) {
    ExpectRejectedAndPoolUnchanged(client(), code, what, call);
  }

  v1::ModelSpec PathSpec(const std::string& id, const std::string& path) {
    v1::ModelSpec spec;
    spec.set_model_id(id);
    spec.mutable_shape()->set_q_heads(kShape.q_heads);
    spec.mutable_shape()->set_kv_heads(kShape.kv_heads);
    spec.set_server_path(path);
    return spec;
  }

  static std::string model_dir_;
};

std::string HostileClientTest::model_dir_;

std::string FloatBytes(const std::vector<float>& v) { return std::string(AsBytes(v)); }

TEST_F(HostileClientTest, ServerPathsToWhatIsNotARegularFileAreRefused) {
  // A directory once threw std::ios_failure out of the file reader and killed the daemon; a
  // FIFO would block the reading thread forever.
  for (const char* path : {"a-directory", "a-fifo", ".", "a-directory/.."}) {
    ExpectRejected(C::kInvalidArgument, absl::StrCat("server_path ", path),
                   [&] { return client().RegisterModel(PathSpec("p", path)).status(); });
  }
  absl::StatusOr<v1::RegisterModelResponse> ok =
      client().RegisterModel(PathSpec("from-dir", "hadamard.safetensors"));
  ASSERT_TRUE(ok.ok()) << ok.status();
}

TEST_F(HostileClientTest, PathsOutsideTheModelDirectoryRevealNothing) {
  // Existing and missing targets outside the directory get the same answer.
  for (const char* path :
       {"../../../etc/passwd", "../../../etc/no-such-file", "/etc/passwd", "/etc/no-such-file",
        "../../../../../../../../../../proc/self/environ", "a-directory/../../x"}) {
    ExpectRejected(C::kPermissionDenied, absl::StrCat("server_path ", path),
                   [&] { return client().RegisterModel(PathSpec("p", path)).status(); });
  }
  ExpectRejected(C::kNotFound, "a missing file inside", [&] {
    return client().RegisterModel(PathSpec("p", "missing.safetensors")).status();
  });
}

TEST_F(HostileClientTest, ValuesThatWouldOverflowAttentionAreOutOfRange) {
  v1::QuantConfig bypass;
  bypass.set_method(v1::QUANT_METHOD_BYPASS);
  ASSERT_TRUE(
      RegisterDataFree(client(), "big-bypass", kShape, v1::ROTATION_KIND_IDENTITY, 0, bypass).ok());
  ASSERT_TRUE(RegisterDataFree(client(), "big-int2", kShape, v1::ROTATION_KIND_HADAMARD, 0).ok());
  // Keys of 3e38: a bypass model stored them and attention answered output 0 and LSE -inf, the
  // "empty sequence" answer; both models now refuse them, as they refuse NaN.
  // The bound holds in the rotated basis: Hadamard spreads one large value over 64 dims (/ 8).
  for (const auto& [model, huge_values] :
       {std::pair<const char*, std::vector<float>>{"big-bypass", {3e38f, 65536.0f, -1e5f}},
        {"big-int2", {3e38f, 1e6f, -524288.0f}}}) {
    const std::string id = absl::StrCat(model, "-refused");
    ASSERT_TRUE(client().CreateSequence(model, id).ok());
    const SequenceKv kv = MakeSequenceKv(kShape, 64, 3);
    for (float huge : huge_values) {
      std::vector<Bf16> k1 = kv.k[1];
      k1[17 * kRowValues + 5] = Bf16::FromFloat(huge);
      ExpectRejected(C::kOutOfRange, absl::StrCat(model, ": a key of ", huge), [&] {
        v1::AppendKvHeader header;
        header.set_sequence_id(id);
        header.set_num_tokens(64);
        header.set_dtype(v1::DTYPE_BF16);
        const client::LayerKv layers[] = {{0, AsBytes(kv.k[0]), AsBytes(kv.v[0])},
                                          {1, AsBytes(k1), AsBytes(kv.v[1])}};
        return client().AppendKv(header, layers).status();
      });
    }
  }
  // The largest values in range are stored and attention over them is finite.
  SequenceKv edge = MakeSequenceKv(kShape, 64, 4);
  for (int l = 0; l < 2; ++l) {
    for (size_t i = 0; i < edge.k[l].size(); i += 7) {
      edge.k[l][i] = Bf16::FromFloat(i % 2 ? 65280.0f : -65280.0f);
    }
  }
  ASSERT_TRUE(CreateAndAppend(client(), "big-bypass", "big-bypass-seq", edge, true).ok());
  auto attend = [&](const std::vector<float>& q) {
    v1::AttendRequest r;
    r.set_model_id("big-bypass");
    r.set_layer(1);
    r.set_dtype(v1::DTYPE_FP32);
    v1::SequenceQuery* sq = r.add_queries();
    sq->set_sequence_id("big-bypass-seq");
    sq->set_q(FloatBytes(q));
    return client().Attend(r);
  };
  std::vector<float> q(kShape.q_heads * kShape.head_dim, 0.5f);
  q[3] = 65000.0f;
  absl::StatusOr<v1::AttendResponse> fine = attend(q);
  ASSERT_TRUE(fine.ok()) << fine.status();
  for (float lse : fine->results(0).lse()) EXPECT_TRUE(std::isfinite(lse));
  for (float x : FloatFromBytes(fine->results(0).out())) ASSERT_TRUE(std::isfinite(x));
  // A query of 3e38 once answered output 0 and LSE -inf.
  for (float huge : {3e38f, -65536.0f}) {
    q[3] = huge;
    ExpectRejected(C::kOutOfRange, absl::StrCat("a query of ", huge),
                   [&] { return attend(q).status(); });
  }
}

TEST_F(HostileClientTest, RepeatedLayersAreMergedInReads) {
  ASSERT_TRUE(RegisterDataFree(client(), "reads", kShape, v1::ROTATION_KIND_HADAMARD, 0).ok());
  const SequenceKv kv = MakeSequenceKv(kShape, 600, 5);
  ASSERT_TRUE(CreateAndAppend(client(), "reads", "reads-seq", kv, true).ok());
  // 40,000 repeats of layer 0 once made the daemon snapshot the layer 40,000 times.
  v1::ReadBlocksRequest blocks;
  blocks.set_sequence_id("reads-seq");
  for (int i = 0; i < 40000; ++i) blocks.add_layers(i % 3 == 2 ? 1 : 0);
  absl::StatusOr<client::BlocksRead> b = client().ReadBlocks(blocks);
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_EQ(b->layers.size(), 2u);
  EXPECT_EQ(b->layers[0].layer, 0);
  EXPECT_EQ(b->layers[1].layer, 1);
  v1::ReadKvRequest rows;
  rows.set_sequence_id("reads-seq");
  for (int i = 0; i < 40000; ++i) rows.add_layers(1);
  absl::StatusOr<client::KvRead> r = client().ReadKv(rows);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->layers.size(), 1u);
  EXPECT_EQ(r->layers[0].layer, 1);
  EXPECT_EQ(r->layers[0].k.size(), 600 * kRowValues * 2);
}

TEST_F(HostileClientTest, HugeIdsAreQuotedShortInMessages) {
  // A 1 MB id echoed whole made a trailer larger than the client accepts: the client saw
  // RESOURCE_EXHAUSTED instead of NOT_FOUND.
  const std::string huge(1 << 20, 'x');
  ExpectRejected(C::kNotFound, "describe a huge sequence id",
                 [&] { return client().DescribeSequence(huge).status(); });
  ExpectRejected(C::kNotFound, "release a huge sequence id",
                 [&] { return client().ReleaseSequence(huge).status(); });
  ExpectRejected(C::kNotFound, "describe a huge model id",
                 [&] { return client().DescribeModel(huge, false).status(); });
  const absl::Status s = client().DescribeSequence(huge).status();
  EXPECT_NE(s.message().find("xxxx..."), absl::string_view::npos) << s.message().substr(0, 200);
  EXPECT_NE(s.message().find("1048576 bytes"), absl::string_view::npos);
}

TEST_F(HostileClientTest, ModelWindowsAreBounded) {
  for (uint32_t tokens : {uint32_t{1} << 30, 8200u, 65536u}) {
    ExpectRejected(C::kInvalidArgument, absl::StrCat("sink_tokens ", tokens), [&] {
      v1::QuantConfig q;
      q.set_sink_tokens(tokens);
      return RegisterDataFree(client(), "wide-sink", kShape, v1::ROTATION_KIND_HADAMARD, 0, q)
          .status();
    });
    ExpectRejected(C::kInvalidArgument, absl::StrCat("recent_tokens ", tokens), [&] {
      v1::QuantConfig q;
      q.set_recent_tokens(tokens);
      return RegisterDataFree(client(), "wide-recent", kShape, v1::ROTATION_KIND_HADAMARD, 0, q)
          .status();
    });
  }
}

TEST_F(HostileClientTest, DecodeAppendsWithoutTheirDataReserveNothing) {
  ASSERT_TRUE(RegisterDataFree(client(), "dec", kShape, v1::ROTATION_KIND_HADAMARD, 0).ok());
  const SequenceKv kv = MakeSequenceKv(kShape, 100, 6);
  ASSERT_TRUE(CreateAndAppend(client(), "dec", "dec-seq", kv, true).ok());
  // 2^20 tokens and no k or v: once answered "pool full" after trying to reserve them.
  for (uint32_t n : {uint32_t{1} << 20, 100000u, 2u}) {
    ExpectRejected(C::kInvalidArgument, absl::StrCat("decode of ", n, " tokens, no data"), [&] {
      v1::AppendDecodeRequest d;
      d.set_sequence_id("dec-seq");
      d.set_token_start(100);
      d.set_num_tokens(n);
      d.set_dtype(v1::DTYPE_BF16);
      return client().AppendDecode(d).status();
    });
  }
}

}  // namespace
}  // namespace kvpool::integration
