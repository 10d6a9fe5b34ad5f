// Every kind of bad input to a real kvpoold: wrong shapes, dtypes, layer and token ranges,
// unknown ids, NaN/Inf, oversize payloads, a full pool, bad registrations and server paths,
// wrong states. Each gets its precise status code, and each leaves the pool exactly as it was
// (GetStats' accounting, every model and sequence unchanged); afterwards the sequences still
// accept good appends and read back bit for bit.
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kernels/rotation_file.h"
#include "tests/integration/integration_util.h"
#include "tests/support/api_requests.h"

namespace kvpool::integration {
namespace {

using testing::AppendChunkMessage;
using testing::AppendHeaderMessage;

constexpr Shape kShape{/*num_layers=*/2, /*q_heads=*/8, /*kv_heads=*/2, /*head_dim=*/64};
constexpr size_t kRowValues = 2 * 64;
constexpr size_t kRowBytes = kRowValues * 2;
constexpr uint64_t kMaxChunk = 64 << 10;
constexpr uint64_t kMaxMessage = 256 << 10;

class BadInputTest : public DaemonTest {
 protected:
  static void SetUpTestSuite() {
    absl::StatusOr<std::string> dir = client::MakeTempDir("kvpool-models");
    ASSERT_TRUE(dir.ok());
    model_dir_ = *dir;
    absl::StatusOr<std::string> outside = client::MakeTempDir("kvpool-outside");
    ASSERT_TRUE(outside.ok());
    outside_dir_ = *outside;
    const ModelCodec codec{
        "file-model", *RotationSet::Hadamard(2, 64), QuantConfig{}, false, "hadamard", {}, {}};
    ASSERT_TRUE(WriteRotationFile(codec, model_dir_ + "/hadamard.safetensors").ok());
    ASSERT_TRUE(WriteRotationFile(codec, outside_dir_ + "/outside.safetensors").ok());
    ASSERT_EQ(symlink((outside_dir_ + "/outside.safetensors").c_str(),
                      (model_dir_ + "/escape.safetensors").c_str()),
              0);
    StartSuiteDaemon({"--pool_bytes=33554432", "--worker_threads=2",
                      absl::StrCat("--max_chunk_bytes=", kMaxChunk),
                      absl::StrCat("--max_message_bytes=", kMaxMessage), "--max_attention_batch=4",
                      "--max_append_tokens=4096", "--max_rotation_file_bytes=1048576",
                      "--model_dir=" + model_dir_});
  }
  static void TearDownTestSuite() {
    DaemonTest::TearDownTestSuite();
    client::RemoveTree(model_dir_);
    client::RemoveTree(outside_dir_);
  }

  void ExpectRejected(absl::StatusCode code, const std::string& what,
                      const std::function<absl::Status()>& call) {
    ExpectRejectedAndPoolUnchanged(client(), code, what, call);
    ++checked_;
  }

  // Sends `messages` on a raw AppendKv stream (stops at the first failed write), optionally
  // cancelling before the half-close; returns the call's status.
  absl::Status AppendRaw(const std::vector<v1::AppendKvRequest>& messages, bool cancel = false) {
    auto context = client().NewContext();
    v1::AppendKvResponse response;
    auto writer = client().sequences()->AppendKv(context.get(), &response);
    for (const v1::AppendKvRequest& m : messages) {
      if (!writer->Write(m)) break;
    }
    if (cancel) {
      context->TryCancel();
    } else {
      writer->WritesDone();
    }
    return client::FromGrpcStatus(writer->Finish(), "AppendKv");
  }

  static std::string model_dir_;
  static std::string outside_dir_;
  int checked_ = 0;
};

std::string BadInputTest::model_dir_;
std::string BadInputTest::outside_dir_;

std::string Rows(const std::vector<Bf16>& all, size_t start, size_t n) {
  return std::string(AsBytes(all).substr(start * kRowBytes, n * kRowBytes));
}

TEST_F(BadInputTest, EveryBadRequestGetsItsCodeAndLeavesThePoolUnchanged) {
  using C = absl::StatusCode;
  v1::QuantConfig bypass;
  bypass.set_method(v1::QUANT_METHOD_BYPASS);
  ASSERT_TRUE(
      RegisterDataFree(client(), "bad", kShape, v1::ROTATION_KIND_IDENTITY, 0, bypass).ok());
  ASSERT_TRUE(RegisterDataFree(client(), "bad-int2", kShape, v1::ROTATION_KIND_HADAMARD, 0).ok());
  // The sequences requests are aimed at: 100 tokens of a prefill in progress, one whose prefill
  // is finished, a sealed one, one of the other model.
  const SequenceKv kv = MakeSequenceKv(kShape, 400, 9);
  SequenceKv first = kv;
  first.tokens = 100;
  for (int l = 0; l < 2; ++l) {
    first.k[l].resize(100 * kRowValues);
    first.v[l].resize(100 * kRowValues);
  }
  ASSERT_TRUE(CreateAndAppend(client(), "bad", "s", first, false).ok());
  ASSERT_TRUE(CreateAndAppend(client(), "bad", "s-final", first, true).ok());
  ASSERT_TRUE(CreateAndAppend(client(), "bad", "s-sealed", first, true).ok());
  ASSERT_TRUE(client().SealSequence("s-sealed").ok());
  ASSERT_TRUE(CreateAndAppend(client(), "bad-int2", "s-int2", first, true).ok());
  ASSERT_TRUE(CreateAndAppend(client(), "bad-int2", "s-int2-open", first, false).ok());
  const std::string k1 = Rows(kv.k[0], 100, 10), v1_ = Rows(kv.v[0], 100, 10);
  const std::string k2 = Rows(kv.k[1], 100, 10), v2 = Rows(kv.v[1], 100, 10);
  auto good_chunks = [&](std::vector<v1::AppendKvRequest> m) {
    m.push_back(AppendChunkMessage(0, 0, 10, k1, v1_));
    m.push_back(AppendChunkMessage(1, 0, 10, k2, v2));
    return m;
  };

  // --- CreateSequence ---
  ExpectRejected(C::kNotFound, "create: unknown model",
                 [&] { return client().CreateSequence("no-such-model", "x").status(); });
  ExpectRejected(C::kInvalidArgument, "create: bad id",
                 [&] { return client().CreateSequence("bad", "has space").status(); });
  ExpectRejected(C::kInvalidArgument, "create: id too long",
                 [&] { return client().CreateSequence("bad", std::string(129, 'a')).status(); });
  ExpectRejected(C::kAlreadyExists, "create: id in use",
                 [&] { return client().CreateSequence("bad", "s").status(); });

  // --- AppendKv: header ---
  ExpectRejected(C::kNotFound, "append: unknown sequence",
                 [&] { return AppendRaw(good_chunks({AppendHeaderMessage("nope", 0, 10)})); });
  ExpectRejected(C::kFailedPrecondition, "append: token_start is not the length",
                 [&] { return AppendRaw(good_chunks({AppendHeaderMessage("s", 0, 10)})); });
  ExpectRejected(C::kFailedPrecondition, "append: token_start past the length",
                 [&] { return AppendRaw(good_chunks({AppendHeaderMessage("s", 101, 10)})); });
  ExpectRejected(C::kInvalidArgument, "append: dtype unspecified", [&] {
    return AppendRaw(good_chunks({AppendHeaderMessage("s", 100, 10, v1::DTYPE_UNSPECIFIED)}));
  });
  ExpectRejected(C::kInvalidArgument, "append: unknown dtype value", [&] {
    return AppendRaw(good_chunks({AppendHeaderMessage("s", 100, 10, static_cast<v1::DType>(77))}));
  });
  ExpectRejected(C::kInvalidArgument, "append: zero tokens",
                 [&] { return AppendRaw({AppendHeaderMessage("s", 100, 0)}); });
  ExpectRejected(C::kInvalidArgument, "append: more tokens than max_append_tokens",
                 [&] { return AppendRaw({AppendHeaderMessage("s", 100, 4097)}); });
  ExpectRejected(C::kInvalidArgument, "append: token_ids count differs", [&] {
    v1::AppendKvRequest h = AppendHeaderMessage("s", 100, 10);
    h.mutable_header()->add_token_ids(1);
    return AppendRaw(good_chunks({h}));
  });
  ExpectRejected(C::kInvalidArgument, "append: no header",
                 [&] { return AppendRaw(good_chunks({})); });
  ExpectRejected(C::kInvalidArgument, "append: empty stream", [&] { return AppendRaw({}); });
  ExpectRejected(C::kInvalidArgument, "append: a second header", [&] {
    return AppendRaw({AppendHeaderMessage("s", 100, 10), AppendHeaderMessage("s", 100, 10)});
  });

  // --- AppendKv: chunks ---
  ExpectRejected(C::kInvalidArgument, "append: layer out of range", [&] {
    return AppendRaw({AppendHeaderMessage("s", 100, 10), AppendChunkMessage(2, 0, 10, k1, v1_)});
  });
  ExpectRejected(C::kInvalidArgument, "append: negative layer", [&] {
    return AppendRaw({AppendHeaderMessage("s", 100, 10), AppendChunkMessage(-1, 0, 10, k1, v1_)});
  });
  ExpectRejected(C::kInvalidArgument, "append: k one value short", [&] {
    return AppendRaw(
        {AppendHeaderMessage("s", 100, 10), AppendChunkMessage(0, 0, 10, k1.substr(2), v1_)});
  });
  ExpectRejected(C::kInvalidArgument, "append: k for a wider head", [&] {
    return AppendRaw({AppendHeaderMessage("s", 100, 10), AppendChunkMessage(0, 0, 5, k1, v1_)});
  });
  ExpectRejected(C::kInvalidArgument, "append: v missing", [&] {
    return AppendRaw({AppendHeaderMessage("s", 100, 10), AppendChunkMessage(0, 0, 10, k1, "")});
  });
  ExpectRejected(C::kInvalidArgument, "append: chunk past the append's tokens", [&] {
    return AppendRaw({AppendHeaderMessage("s", 100, 10), AppendChunkMessage(0, 5, 10, k1, v1_)});
  });
  ExpectRejected(C::kInvalidArgument, "append: chunk with zero tokens", [&] {
    return AppendRaw({AppendHeaderMessage("s", 100, 10), AppendChunkMessage(0, 0, 0, "", "")});
  });
  ExpectRejected(C::kInvalidArgument, "append: gap inside a layer", [&] {
    return AppendRaw(
        {AppendHeaderMessage("s", 100, 10),
         AppendChunkMessage(0, 0, 4, k1.substr(0, 4 * kRowBytes), v1_.substr(0, 4 * kRowBytes)),
         AppendChunkMessage(0, 5, 5, k1.substr(5 * kRowBytes), v1_.substr(5 * kRowBytes))});
  });
  ExpectRejected(C::kInvalidArgument, "append: a layer twice", [&] {
    return AppendRaw(
        good_chunks({AppendHeaderMessage("s", 100, 10), AppendChunkMessage(0, 0, 10, k1, v1_)}));
  });
  ExpectRejected(C::kInvalidArgument, "append: layer 1 missing", [&] {
    return AppendRaw({AppendHeaderMessage("s", 100, 10), AppendChunkMessage(0, 0, 10, k1, v1_)});
  });
  ExpectRejected(C::kInvalidArgument, "append: layer 0 incomplete", [&] {
    return AppendRaw(
        {AppendHeaderMessage("s", 100, 10), AppendChunkMessage(1, 0, 10, k2, v2),
         AppendChunkMessage(0, 0, 4, k1.substr(0, 4 * kRowBytes), v1_.substr(0, 4 * kRowBytes))});
  });

  // --- AppendKv: values ---
  for (const auto& [what, bits, in_k] :
       {std::tuple<const char*, uint16_t, bool>{"NaN in k", 0x7fc0, true},
        {"+Inf in v", 0x7f80, false},
        {"-Inf in k", 0xff80, true},
        {"signalling NaN in v", 0x7f81, false}}) {
    ExpectRejected(C::kInvalidArgument, absl::StrCat("append: ", what),
                   [&, bits = bits, in_k = in_k] {
                     std::string k = k2, v = v2;
                     const uint16_t word = bits;
                     std::memcpy((in_k ? k : v).data() + 7 * kRowBytes + 2 * 33, &word, 2);
                     // Layer 0 is staged completely first: the bad value arrives late in the
                     // stream.
                     return AppendRaw({AppendHeaderMessage("s", 100, 10),
                                       AppendChunkMessage(0, 0, 10, k1, v1_),
                                       AppendChunkMessage(1, 0, 10, k, v)});
                   });
  }
  ExpectRejected(C::kInvalidArgument, "append: FP32 NaN", [&] {
    std::vector<float> k(10 * kRowValues, 0.5f), v(10 * kRowValues, 0.25f);
    k[77] = std::numeric_limits<float>::quiet_NaN();
    const std::string kb(AsBytes(k)), vb(AsBytes(v));
    return AppendRaw({AppendHeaderMessage("s", 100, 10, v1::DTYPE_FP32),
                      AppendChunkMessage(0, 0, 10, kb, vb), AppendChunkMessage(1, 0, 10, kb, vb)});
  });
  ExpectRejected(C::kInvalidArgument, "append: FP16 Inf", [&] {
    std::vector<uint16_t> k(10 * kRowValues, 0x3c00), v(10 * kRowValues, 0x3c00);
    v[3] = 0x7c00;
    const std::string kb(reinterpret_cast<const char*>(k.data()), k.size() * 2);
    const std::string vb(reinterpret_cast<const char*>(v.data()), v.size() * 2);
    return AppendRaw({AppendHeaderMessage("s", 100, 10, v1::DTYPE_FP16),
                      AppendChunkMessage(0, 0, 10, kb, vb), AppendChunkMessage(1, 0, 10, kb, vb)});
  });
  ExpectRejected(C::kInvalidArgument, "append: FP32 beyond the BF16 range (INT2 model)", [&] {
    std::vector<float> k(10 * kRowValues, 0.5f), v(10 * kRowValues, 0.25f);
    k[5] = std::numeric_limits<float>::max();  // rounds to BF16 +Inf
    const std::string kb(AsBytes(k)), vb(AsBytes(v));
    return AppendRaw({AppendHeaderMessage("s-int2-open", 100, 10, v1::DTYPE_FP32),
                      AppendChunkMessage(0, 0, 10, kb, vb), AppendChunkMessage(1, 0, 10, kb, vb)});
  });
  ExpectRejected(C::kOutOfRange, "append: INT2 scale beyond the FP16 range", [&] {
    // Finite, but the Hadamard rotation spreads it to +-1e6/8 on every dim of the row, so the
    // row's scale (max - min) / 3 exceeds FP16's 65504.
    std::vector<float> k(10 * kRowValues, 0.5f), v(10 * kRowValues, 0.25f);
    k[3 * kRowValues] = 1e6f;
    const std::string kb(AsBytes(k)), vb(AsBytes(v));
    return AppendRaw({AppendHeaderMessage("s-int2-open", 100, 10, v1::DTYPE_FP32),
                      AppendChunkMessage(0, 0, 10, kb, vb), AppendChunkMessage(1, 0, 10, kb, vb)});
  });

  // --- AppendKv: payload limits ---
  {
    const SequenceKv big = MakeSequenceKv(kShape, 1000, 11);
    const uint32_t over_chunk = kMaxChunk / kRowBytes + 1;  // k alone just over max_chunk_bytes
    ExpectRejected(C::kInvalidArgument, "append: chunk over max_chunk_bytes", [&] {
      return AppendRaw({AppendHeaderMessage("s", 100, over_chunk),
                        AppendChunkMessage(0, 0, over_chunk, Rows(big.k[0], 0, over_chunk),
                                           Rows(big.v[0], 0, over_chunk))});
    });
    const uint32_t over_message = kMaxMessage / (2 * kRowBytes) + 8;  // k+v over the message
    ExpectRejected(C::kResourceExhausted, "append: message over max_message_bytes", [&] {
      return AppendRaw({AppendHeaderMessage("s", 100, over_message),
                        AppendChunkMessage(0, 0, over_message, Rows(big.k[0], 0, over_message),
                                           Rows(big.v[0], 0, over_message))});
    });
  }
  ExpectRejected(C::kCancelled, "append: cancelled after a layer", [&] {
    return AppendRaw({AppendHeaderMessage("s", 100, 10), AppendChunkMessage(0, 0, 10, k1, v1_)},
                     true);
  });

  // --- AppendKv: states ---
  ExpectRejected(C::kFailedPrecondition, "append: sealed sequence", [&] {
    return AppendRaw(good_chunks({AppendHeaderMessage("s-sealed", 100, 10)}));
  });
  ExpectRejected(C::kFailedPrecondition, "append: prefill after end_of_prefill",
                 [&] { return AppendRaw(good_chunks({AppendHeaderMessage("s-final", 100, 10)})); });

  // --- pool full: 4096 tokens of a large bypass model need 64 MiB of a 32 MiB pool ---
  {
    v1::QuantConfig q;
    q.set_method(v1::QUANT_METHOD_BYPASS);
    ASSERT_TRUE(RegisterDataFree(client(), "bad-big", Shape{4, 64, 8, 128},
                                 v1::ROTATION_KIND_IDENTITY, 0, q)
                    .ok());
    ASSERT_TRUE(client().CreateSequence("bad-big", "s-big").ok());
    ExpectRejected(C::kResourceExhausted, "append: pool full",
                   [&] { return AppendRaw({AppendHeaderMessage("s-big", 0, 4096)}); });
  }

  // --- AppendDecode ---
  auto decode = [&](const std::string& id, uint32_t start, std::string k, std::string v,
                    uint32_t n = 1, v1::DType dtype = v1::DTYPE_BF16) {
    v1::AppendDecodeRequest d;
    d.set_sequence_id(id);
    d.set_token_start(start);
    d.set_num_tokens(n);
    d.set_dtype(dtype);
    d.set_k(std::move(k));
    d.set_v(std::move(v));
    return client().AppendDecode(d).status();
  };
  const std::string dk = Rows(kv.k[0], 100, 1) + Rows(kv.k[1], 100, 1);
  const std::string dv = Rows(kv.v[0], 100, 1) + Rows(kv.v[1], 100, 1);
  ExpectRejected(C::kFailedPrecondition, "decode: before end_of_prefill",
                 [&] { return decode("s", 100, dk, dv); });
  ExpectRejected(C::kFailedPrecondition, "decode: sealed",
                 [&] { return decode("s-sealed", 100, dk, dv); });
  ExpectRejected(C::kFailedPrecondition, "decode: wrong token_start",
                 [&] { return decode("s-final", 99, dk, dv); });
  ExpectRejected(C::kNotFound, "decode: unknown sequence",
                 [&] { return decode("nope", 0, dk, dv); });
  ExpectRejected(C::kInvalidArgument, "decode: one layer's rows only", [&] {
    return decode("s-final", 100, dk.substr(kRowBytes), dv.substr(kRowBytes));
  });
  ExpectRejected(C::kInvalidArgument, "decode: num_tokens does not match the rows",
                 [&] { return decode("s-final", 100, dk, dv, 2); });
  ExpectRejected(C::kInvalidArgument, "decode: NaN", [&] {
    std::string k = dk;
    const uint16_t nan = 0x7fc1;
    std::memcpy(k.data() + kRowBytes + 10, &nan, 2);
    return decode("s-final", 100, k, dv);
  });
  ExpectRejected(C::kInvalidArgument, "decode: dtype unspecified",
                 [&] { return decode("s-final", 100, dk, dv, 1, v1::DTYPE_UNSPECIFIED); });

  // --- ReadKv / ReadBlocks ---
  auto read_kv = [&](const std::string& id, std::vector<int> layers, uint32_t start, uint32_t n,
                     v1::DType dtype = v1::DTYPE_BF16) {
    v1::ReadKvRequest r;
    r.set_sequence_id(id);
    r.mutable_layers()->Add(layers.begin(), layers.end());
    r.set_token_start(start);
    r.set_num_tokens(n);
    r.set_dtype(dtype);
    return client().ReadKv(r).status();
  };
  ExpectRejected(C::kNotFound, "read: unknown sequence", [&] { return read_kv("nope", {}, 0, 0); });
  ExpectRejected(C::kInvalidArgument, "read: layer out of range", [&] {
    return read_kv("s", {0, 2}, 0, 0);
  });
  ExpectRejected(C::kInvalidArgument, "read: negative layer",
                 [&] { return read_kv("s", {-1}, 0, 0); });
  ExpectRejected(C::kOutOfRange, "read: tokens past the end",
                 [&] { return read_kv("s", {}, 90, 11); });
  ExpectRejected(C::kOutOfRange, "read: start past the end",
                 [&] { return read_kv("s", {}, 101, 0); });
  ExpectRejected(C::kInvalidArgument, "read: FP16 output",
                 [&] { return read_kv("s", {}, 0, 0, v1::DTYPE_FP16); });
  auto read_blocks = [&](const std::string& id, std::vector<int> layers) {
    v1::ReadBlocksRequest r;
    r.set_sequence_id(id);
    r.mutable_layers()->Add(layers.begin(), layers.end());
    return client().ReadBlocks(r).status();
  };
  ExpectRejected(C::kNotFound, "blocks: unknown sequence", [&] { return read_blocks("nope", {}); });
  ExpectRejected(C::kInvalidArgument, "blocks: layer out of range",
                 [&] { return read_blocks("s", {7}); });

  // --- Attend ---
  const std::vector<float> q(kShape.q_heads * kShape.head_dim, 0.1f);
  auto attend = [&](const std::string& model, int layer, std::vector<std::string> ids,
                    std::string qbytes, v1::DType dtype = v1::DTYPE_FP32) {
    v1::AttendRequest r;
    r.set_model_id(model);
    r.set_layer(layer);
    r.set_dtype(dtype);
    for (const std::string& id : ids) {
      v1::SequenceQuery* sq = r.add_queries();
      sq->set_sequence_id(id);
      sq->set_q(qbytes);
    }
    return client().Attend(r).status();
  };
  const std::string qb(AsBytes(q));
  ExpectRejected(C::kNotFound, "attend: unknown model",
                 [&] { return attend("nope", 0, {"s"}, qb); });
  ExpectRejected(C::kNotFound, "attend: unknown sequence", [&] {
    return attend("bad", 0, {"s", "nope"}, qb);
  });
  ExpectRejected(C::kInvalidArgument, "attend: q too short",
                 [&] { return attend("bad", 0, {"s"}, qb.substr(4)); });
  ExpectRejected(C::kInvalidArgument, "attend: q as BF16 of FP32 size",
                 [&] { return attend("bad", 0, {"s"}, qb, v1::DTYPE_BF16); });
  ExpectRejected(C::kInvalidArgument, "attend: NaN query", [&] {
    std::vector<float> bad = q;
    bad[100] = std::numeric_limits<float>::quiet_NaN();
    return attend("bad", 0, {"s"}, std::string(AsBytes(bad)));
  });
  ExpectRejected(C::kInvalidArgument, "attend: Inf query", [&] {
    std::vector<float> bad = q;
    bad[0] = -std::numeric_limits<float>::infinity();
    return attend("bad", 0, {"s"}, std::string(AsBytes(bad)));
  });
  ExpectRejected(C::kInvalidArgument, "attend: layer out of range",
                 [&] { return attend("bad", 2, {"s"}, qb); });
  ExpectRejected(C::kInvalidArgument, "attend: negative layer",
                 [&] { return attend("bad", -1, {"s"}, qb); });
  ExpectRejected(C::kInvalidArgument, "attend: empty batch",
                 [&] { return attend("bad", 0, {}, qb); });
  ExpectRejected(C::kInvalidArgument, "attend: batch over max_attention_batch", [&] {
    return attend("bad", 0, {"s", "s", "s", "s", "s"}, qb);
  });
  ExpectRejected(C::kInvalidArgument, "attend: a sequence of another model", [&] {
    return attend("bad", 0, {"s", "s-int2"}, qb);
  });
  ExpectRejected(C::kInvalidArgument, "attend: unknown dtype",
                 [&] { return attend("bad", 0, {"s"}, qb, static_cast<v1::DType>(9)); });
  ExpectRejected(C::kResourceExhausted, "attend: request over max_message_bytes", [&] {
    v1::AttendRequest r;
    r.set_model_id("bad");
    v1::SequenceQuery* sq = r.add_queries();
    sq->set_sequence_id("s");
    sq->set_num_queries(300);
    sq->set_q(std::string(300 * qb.size(), '\0'));
    return client().Attend(r).status();
  });

  // --- RegisterModel ---
  auto spec_for = [&](const std::string& id, Shape s) {
    v1::ModelSpec spec;
    spec.set_model_id(id);
    spec.mutable_shape()->set_num_layers(s.num_layers);
    spec.mutable_shape()->set_q_heads(s.q_heads);
    spec.mutable_shape()->set_kv_heads(s.kv_heads);
    spec.mutable_shape()->set_head_dim(s.head_dim);
    spec.mutable_data_free()->set_kind(v1::ROTATION_KIND_HADAMARD);
    return spec;
  };
  auto reg = [&](const v1::ModelSpec& spec, absl::string_view file = {}) {
    return client().RegisterModel(spec, file).status();
  };
  ExpectRejected(C::kInvalidArgument, "register: q_heads not a multiple of kv_heads", [&] {
    return reg(spec_for("r1", Shape{2, 6, 4, 64}));
  });
  ExpectRejected(C::kInvalidArgument, "register: unsupported head_dim", [&] {
    return reg(spec_for("r2", Shape{2, 8, 2, 96}));
  });
  ExpectRejected(C::kInvalidArgument, "register: zero layers", [&] {
    return reg(spec_for("r3", Shape{0, 8, 2, 64}));
  });
  ExpectRejected(C::kInvalidArgument, "register: bad model id",
                 [&] { return reg(spec_for("bad id!", kShape)); });
  ExpectRejected(C::kInvalidArgument, "register: no rotation source", [&] {
    v1::ModelSpec spec = spec_for("r4", kShape);
    spec.clear_data_free();
    return reg(spec);
  });
  ExpectRejected(C::kInvalidArgument, "register: dense kind without a file", [&] {
    v1::ModelSpec spec = spec_for("r5", kShape);
    spec.mutable_data_free()->set_kind(v1::ROTATION_KIND_DENSE);
    return reg(spec);
  });
  ExpectRejected(C::kInvalidArgument, "register: block_tokens not a power of two", [&] {
    v1::ModelSpec spec = spec_for("r6", kShape);
    spec.mutable_quant()->set_block_tokens(12);
    return reg(spec);
  });
  ExpectRejected(C::kInvalidArgument, "register: 3-bit codes", [&] {
    v1::ModelSpec spec = spec_for("r7", kShape);
    spec.mutable_quant()->set_bits(3);
    return reg(spec);
  });
  ExpectRejected(C::kInvalidArgument, "register: malformed rotation file",
                 [&] { return reg(spec_for("r8", kShape), std::string(5000, 'x')); });
  ExpectRejected(C::kInvalidArgument, "register: file over max_rotation_file_bytes",
                 [&] { return reg(spec_for("r9", kShape), std::string(2 << 20, 'x')); });
  ExpectRejected(C::kInvalidArgument, "register: upload shorter than upload_size", [&] {
    auto context = client().NewContext();
    v1::RegisterModelResponse response;
    auto writer = client().models()->RegisterModel(context.get(), &response);
    v1::RegisterModelRequest r;
    *r.mutable_spec() = spec_for("r10", kShape);
    r.mutable_spec()->set_upload_size(1000);
    writer->Write(r);
    r.set_rotation_file_chunk(std::string(500, 'x'));
    writer->Write(r);
    writer->WritesDone();
    return client::FromGrpcStatus(writer->Finish(), "RegisterModel");
  });
  const ModelCodec file_codec{"f", *RotationSet::Hadamard(2, 64), QuantConfig{}, false, "", {}, {}};
  const std::string file = SerializeRotationFile(file_codec);
  ExpectRejected(C::kInvalidArgument, "register: quant config beside a rotation file", [&] {
    v1::ModelSpec spec = spec_for("r11", kShape);
    spec.mutable_quant()->set_bits(4);
    return reg(spec, file);
  });
  ExpectRejected(C::kInvalidArgument, "register: shape differs from the rotation file", [&] {
    return reg(spec_for("r12", Shape{3, 8, 2, 64}), file);
  });
  ExpectRejected(C::kInvalidArgument, "register: expected codec version differs", [&] {
    v1::ModelSpec spec = spec_for("r13", kShape);
    spec.set_expected_codec_version(std::string(64, '0'));
    return reg(spec);
  });
  ExpectRejected(C::kAlreadyExists, "register: same id, another codec version", [&] {
    v1::ModelSpec spec = spec_for("bad", kShape);  // "bad" is identity + bypass
    return reg(spec);
  });
  auto path_spec = [&](const std::string& id, const std::string& path) {
    v1::ModelSpec spec = spec_for(id, kShape);
    spec.set_server_path(path);
    return spec;
  };
  ExpectRejected(C::kPermissionDenied, "register: path leaving the model dir", [&] {
    const std::string up = "../" + outside_dir_.substr(outside_dir_.rfind('/') + 1);
    return reg(path_spec("p1", up + "/outside.safetensors"));
  });
  ExpectRejected(C::kPermissionDenied, "register: absolute path outside the model dir",
                 [&] { return reg(path_spec("p2", outside_dir_ + "/outside.safetensors")); });
  ExpectRejected(C::kPermissionDenied, "register: symlink out of the model dir",
                 [&] { return reg(path_spec("p3", "escape.safetensors")); });
  ExpectRejected(C::kNotFound, "register: no such file",
                 [&] { return reg(path_spec("p4", "missing.safetensors")); });

  // Positive controls: a registration from the model dir, and an identical re-registration.
  {
    v1::ModelSpec spec = path_spec("from-dir", "hadamard.safetensors");
    spec.mutable_shape()->set_num_layers(0);  // taken from the file
    spec.mutable_shape()->set_head_dim(0);
    absl::StatusOr<v1::RegisterModelResponse> r = client().RegisterModel(spec);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->model().shape().num_layers(), 2);
    EXPECT_EQ(r->model().shape().head_dim(), 64);
    EXPECT_EQ(r->model().rotation_kind(), v1::ROTATION_KIND_HADAMARD);
    r = client().RegisterModel(spec);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(r->already_registered());
  }

  // --- other unknown ids and wrong states ---
  ExpectRejected(C::kNotFound, "describe: unknown model",
                 [&] { return client().DescribeModel("nope", true).status(); });
  ExpectRejected(C::kNotFound, "delete: unknown model",
                 [&] { return client().DeleteModel("nope", true).status(); });
  ExpectRejected(C::kFailedPrecondition, "delete: model with sequences, no force",
                 [&] { return client().DeleteModel("bad", false).status(); });
  ExpectRejected(C::kNotFound, "release: unknown sequence",
                 [&] { return client().ReleaseSequence("nope").status(); });
  ExpectRejected(C::kNotFound, "seal: unknown sequence",
                 [&] { return client().SealSequence("nope").status(); });
  ExpectRejected(C::kNotFound, "describe: unknown sequence",
                 [&] { return client().DescribeSequence("nope").status(); });
  ExpectRejected(C::kNotFound, "lookup: unknown model", [&] {
    const uint32_t ids[] = {1, 2, 3};
    return client().LookupPrefix("nope", ids).status();
  });
  EXPECT_GE(checked_, 90);

  // Nothing of the failed requests remains: the next good append at token 100 succeeds and the
  // sequence reads back exactly what the good appends sent. (The client first fits its chunks
  // to this daemon's small limits.)
  KV_ASSERT_OK(client().FitToServerLimits());
  EXPECT_LE(client().chunk_bytes(), 2 * kMaxChunk);
  v1::AppendKvHeader header;
  header.set_sequence_id("s");
  header.set_token_start(100);
  header.set_num_tokens(300);
  header.set_dtype(v1::DTYPE_BF16);
  header.set_end_of_prefill(true);
  const std::string rk0 = Rows(kv.k[0], 100, 300), rv0 = Rows(kv.v[0], 100, 300);
  const std::string rk1 = Rows(kv.k[1], 100, 300), rv1 = Rows(kv.v[1], 100, 300);
  const client::LayerKv layers[] = {{0, rk0, rv0}, {1, rk1, rv1}};
  absl::StatusOr<v1::AppendKvResponse> r = client().AppendKv(header, layers);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->sequence().total_tokens(), 400u);
  v1::ReadKvRequest read;
  read.set_sequence_id("s");
  absl::StatusOr<client::KvRead> back = client().ReadKv(read);
  ASSERT_TRUE(back.ok()) << back.status();
  for (int l = 0; l < 2; ++l) {
    EXPECT_TRUE(back->layers[l].k == AsBytes(kv.k[l])) << "layer " << l;
    EXPECT_TRUE(back->layers[l].v == AsBytes(kv.v[l])) << "layer " << l;
  }
}

// Streams of many small chunks keep the daemon's receive queue full, so the read is paused
// and resumed many times while chunks are staged: a failure late in such a stream (NaN, a gap,
// a cancel) still answers with its code and leaves the pool as it was, and a good one commits
// every token exactly.
TEST_F(BadInputTest, DeepStreamsFailLateOrCommitExactly) {
  using C = absl::StatusCode;
  v1::QuantConfig bypass;
  bypass.set_method(v1::QUANT_METHOD_BYPASS);
  ASSERT_TRUE(
      RegisterDataFree(client(), "deep", kShape, v1::ROTATION_KIND_IDENTITY, 0, bypass).ok());
  ASSERT_TRUE(RegisterDataFree(client(), "deep-int2", kShape, v1::ROTATION_KIND_HADAMARD, 0).ok());
  constexpr uint32_t kTokens = 600;
  const SequenceKv kv = MakeSequenceKv(kShape, kTokens, 21);
  // One message per token and layer, layer 0 first; `edit` may change the messages.
  auto one_token_chunks = [&](const std::string& id,
                              const std::function<void(std::vector<v1::AppendKvRequest>*)>& edit) {
    std::vector<v1::AppendKvRequest> m = {AppendHeaderMessage(id, 0, kTokens)};
    for (int l = 0; l < 2; ++l) {
      for (uint32_t t = 0; t < kTokens; ++t) {
        m.push_back(AppendChunkMessage(l, t, 1, Rows(kv.k[l], t, 1), Rows(kv.v[l], t, 1)));
      }
    }
    if (edit) edit(&m);
    return m;
  };
  for (const char* model : {"deep", "deep-int2"}) {
    const std::string id = absl::StrCat(model, "-seq");
    ASSERT_TRUE(client().CreateSequence(model, id).ok());
    ExpectRejected(C::kInvalidArgument, absl::StrCat(model, ": NaN in the last chunks"), [&] {
      return AppendRaw(one_token_chunks(id, [](std::vector<v1::AppendKvRequest>* m) {
        const uint16_t nan = 0x7fc0;
        std::memcpy(m->at(m->size() - 3).mutable_chunk()->mutable_k()->data() + 10, &nan, 2);
      }));
    });
    ExpectRejected(C::kInvalidArgument, absl::StrCat(model, ": a gap late in layer 1"), [&] {
      return AppendRaw(one_token_chunks(
          id, [](std::vector<v1::AppendKvRequest>* m) { m->erase(m->end() - 5); }));
    });
    ExpectRejected(C::kCancelled, absl::StrCat(model, ": cancelled after 1000 chunks"), [&] {
      return AppendRaw(
          one_token_chunks(id, [](std::vector<v1::AppendKvRequest>* m) { m->resize(1001); }),
          /*cancel=*/true);
    });
    ASSERT_EQ(AppendRaw(one_token_chunks(id, nullptr)), absl::OkStatus()) << model;
    absl::StatusOr<v1::SequenceInfo> info = client().DescribeSequence(id);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->total_tokens(), kTokens) << model;
  }
  // The bypass model stores exactly what was sent.
  v1::ReadKvRequest read;
  read.set_sequence_id("deep-seq");
  absl::StatusOr<client::KvRead> back = client().ReadKv(read);
  ASSERT_TRUE(back.ok()) << back.status();
  for (int l = 0; l < 2; ++l) {
    EXPECT_TRUE(back->layers[l].k == AsBytes(kv.k[l])) << "layer " << l;
    EXPECT_TRUE(back->layers[l].v == AsBytes(kv.v[l])) << "layer " << l;
  }
  for (const char* id : {"deep-seq", "deep-int2-seq"}) {
    ASSERT_TRUE(client().ReleaseSequence(id).ok());
  }
}

// Without --model_dir, server paths are refused as a precondition.
class NoModelDirTest : public DaemonTest {};

TEST_F(NoModelDirTest, ServerPathWithoutModelDirIsFailedPrecondition) {
  v1::ModelSpec spec;
  spec.set_model_id("p");
  spec.mutable_shape()->set_q_heads(8);
  spec.mutable_shape()->set_kv_heads(2);
  spec.set_server_path("hadamard.safetensors");
  absl::StatusOr<std::string> before = PoolFingerprint(client());
  EXPECT_EQ(client().RegisterModel(spec).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(*PoolFingerprint(client()), *before);
}

}  // namespace
}  // namespace kvpool::integration
