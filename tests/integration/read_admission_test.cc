// Admission of reads against a real kvpoold (issue 18): ReadKv, ReadBlocks and Attend hold a read
// ticket. A client that floods large reads on one connection and stops taking their messages
// (its own connection, a flow-control window that never grows) gets exactly as many reads and
// bytes in flight as its caps allow: the next ones are refused before any work with
// RESOURCE_EXHAUSTED, reason LIMIT, naming the cap, while another client's small reads and
// Attend are served. GetStats' admission counters say exactly what is held, and everything comes
// back when the flood is cancelled; a reader that stays stalled past the idle timeout loses its
// read.
//
// Nothing is timed: every wait polls GetStats for its condition with a generous deadline.
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/grpcpp.h"
#include "kvpool/v1/read_service.grpc.pb.h"
#include "proto/status.h"
#include "tests/integration/integration_util.h"

namespace kvpool::integration {
namespace {

// Rows of 8 x 128 values: one token of one layer is 8 KiB of FP32 K and V.
constexpr Shape kShape{/*num_layers=*/2, /*q_heads=*/8, /*kv_heads=*/8, /*head_dim=*/128};
constexpr int kBigTokens = 2048;  // 32 MiB as FP32, about 4 MiB of blocks and rows
constexpr int kSmallTokens = 300;
constexpr int kReadsCap = 2;
constexpr uint64_t kReadBytesCap = uint64_t{5} << 20;

// A client whose reads take their header and then nothing: its own connection, whose
// flow-control window stays at its initial size, so the daemon's next message cannot be sent.
class StalledReader {
 public:
  explicit StalledReader(const std::string& target) {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    args.SetMaxReceiveMessageSize(-1);
    stub_ = v1::ReadService::NewStub(
        grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args));
  }
  ~StalledReader() { CancelAll(); }

  // Opens a read of `id` and takes its first message: OK when the read is open (and stalled),
  // else the call's status.
  absl::Status ReadKv(const std::string& id, v1::DType dtype, uint32_t tokens = 0) {
    v1::ReadKvRequest r;
    r.set_sequence_id(id);
    r.set_dtype(dtype);
    r.set_num_tokens(tokens);
    return Open<v1::ReadKvResponse>([&](grpc::ClientContext* c) { return stub_->ReadKv(c, r); },
                                    "ReadKv");
  }
  absl::Status ReadBlocks(const std::string& id) {
    v1::ReadBlocksRequest r;
    r.set_sequence_id(id);
    return Open<v1::ReadBlocksResponse>(
        [&](grpc::ClientContext* c) { return stub_->ReadBlocks(c, r); }, "ReadBlocks");
  }

  void CancelAll() {
    for (Call& c : calls_) c.context->TryCancel();
    for (Call& c : calls_) (void)c.finish();
    calls_.clear();
  }

 private:
  struct Call {
    std::unique_ptr<grpc::ClientContext> context;
    std::function<grpc::Status()> finish;
  };

  template <typename Response, typename Start>
  absl::Status Open(Start start, const char* what) {
    Call call;
    call.context = std::make_unique<grpc::ClientContext>();
    call.context->set_deadline(std::chrono::system_clock::now() + std::chrono::minutes(10));
    std::shared_ptr<grpc::ClientReader<Response>> reader = start(call.context.get());
    Response first;
    if (!reader->Read(&first)) return FromGrpcStatus(reader->Finish(), what);
    call.finish = [reader] { return reader->Finish(); };
    calls_.push_back(std::move(call));
    return absl::OkStatus();
  }

  std::unique_ptr<v1::ReadService::Stub> stub_;
  std::vector<Call> calls_;
};

void ExpectLimit(const absl::Status& s, absl::string_view cap) {
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_EQ(ReasonOf(s), ErrorReason::kLimit) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), cap)) << s;
}

class ReadAdmissionTest : public DaemonTest {
 protected:
  static void SetUpTestSuite() {
    StartSuiteDaemon({"--pool_bytes=268435456", "--worker_threads=2",
                      absl::StrCat("--max_reads_per_connection=", kReadsCap),
                      absl::StrCat("--max_read_bytes_per_connection=", kReadBytesCap),
                      "--stream_idle_timeout_ms=600000"});
  }

  void SetUp() override {
    DaemonTest::SetUp();
    if (!pushed_) {
      ASSERT_TRUE(RegisterDataFree(client(), "rd", kShape, v1::ROTATION_KIND_HADAMARD, 1).ok());
      ASSERT_TRUE(
          CreateAndAppend(client(), "rd", "big", MakeSequenceKv(kShape, kBigTokens, 1), true).ok());
      ASSERT_TRUE(
          CreateAndAppend(client(), "rd", "small", MakeSequenceKv(kShape, kSmallTokens, 2), true)
              .ok());
      pushed_ = true;
    }
  }

  // Another client's small calls, on the default connection: all served.
  void ServeAnotherClient() {
    v1::ReadKvRequest kv;
    kv.set_sequence_id("small");
    kv.set_num_tokens(16);
    KV_ASSERT_OK(client().ReadKv(kv).status());
    v1::ReadBlocksRequest blocks;
    blocks.set_sequence_id("small");
    KV_ASSERT_OK(client().ReadBlocks(blocks).status());
    const v1::AttendRequest attend = Bf16QueryRequest("rd", 1, "small", kShape, 5);
    absl::StatusOr<v1::AttendResponse> a = client().Attend(attend);
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_EQ(a->results_size(), 1);
    EXPECT_EQ(a->results(0).attended_tokens(), static_cast<uint32_t>(kSmallTokens));
  }

  static bool pushed_;
};

bool ReadAdmissionTest::pushed_ = false;

TEST_F(ReadAdmissionTest, AFloodOfLargeReadsIsCappedAndDoesNotStallAnotherClient) {
  const v1::GetStatsResponse base = Stats();
  EXPECT_EQ(base.admission().open_reads(), 0u);
  EXPECT_EQ(base.admission().read_bytes(), 0u);
  EXPECT_EQ(base.admission().max_reads_per_connection(), static_cast<uint32_t>(kReadsCap));
  EXPECT_EQ(base.admission().max_read_bytes_per_connection(), kReadBytesCap);

  StalledReader flood(daemon().target());
  // One large FP32 read: admitted, and held (its next message cannot be sent).
  KV_ASSERT_OK(flood.ReadKv("big", v1::DTYPE_FP32));
  uint64_t fp32_bytes = 0;
  ASSERT_TRUE(WaitForStats([&](const v1::GetStatsResponse& s) {
    fp32_bytes = s.admission().read_bytes();
    return s.admission().open_reads() == 1;
  }));
  ASSERT_GT(fp32_bytes, 0u);
  ASSERT_LE(fp32_bytes, kReadBytesCap);
  // A second would pass the connection's bytes in flight: refused before any work.
  ExpectLimit(flood.ReadKv("big", v1::DTYPE_FP32), "read bytes in flight per connection");
  // A ReadBlocks of the same sequence holds less: admitted; then the count cap is reached.
  KV_ASSERT_OK(flood.ReadBlocks("big"));
  ExpectLimit(flood.ReadKv("small", v1::DTYPE_BF16, 16), "reads per connection");

  v1::GetStatsResponse held = Stats();
  EXPECT_EQ(held.admission().open_reads(), static_cast<uint64_t>(kReadsCap));
  EXPECT_GT(held.admission().read_bytes(), fp32_bytes);
  EXPECT_LE(held.admission().read_bytes(), kReadBytesCap);
  EXPECT_EQ(held.admission().refused(), base.admission().refused() + 2);

  // Another client is served meanwhile, and its calls leave nothing held.
  ServeAnotherClient();
  if (HasFatalFailure()) return;
  v1::GetStatsResponse after = Stats();
  EXPECT_EQ(after.admission().open_reads(), static_cast<uint64_t>(kReadsCap));
  EXPECT_EQ(after.admission().read_bytes(), held.admission().read_bytes());
  EXPECT_EQ(after.admission().refused(), held.admission().refused());

  // Cancelled, the flood's reads let go of everything.
  flood.CancelAll();
  ASSERT_TRUE(WaitForStats([](const v1::GetStatsResponse& s) {
    return s.admission().open_reads() == 0 && s.admission().read_bytes() == 0;
  }));
  // And the connection may read again.
  StalledReader again(daemon().target());
  KV_ASSERT_OK(again.ReadKv("big", v1::DTYPE_FP32));
}

// An Attend whose decoded queries and answer would pass the bytes cap is refused before work.
TEST_F(ReadAdmissionTest, AnAttendOverTheReadBytesCapIsRefusedUpFront) {
  constexpr int kRows = 1000;  // 4 MiB of FP32 queries and 4 MiB of answer
  const v1::AttendRequest attend = Bf16QueryRequest("rd", 0, "small", kShape, 6, kRows);
  const v1::GetStatsResponse before = Stats();
  const absl::Status s = client().Attend(attend).status();
  ExpectLimit(s, "read bytes in flight per connection");
  const v1::GetStatsResponse after = Stats();
  EXPECT_EQ(after.service().attention_calls(), before.service().attention_calls());
  EXPECT_EQ(after.admission().refused(), before.admission().refused() + 1);
  EXPECT_EQ(after.admission().open_reads(), 0u);
}

// A reader that stays stalled past the idle timeout loses its read: the ticket expires (counted),
// the write is cancelled and the read's bytes come back.
TEST(ReadAdmissionIdleTest, AStalledReaderLosesItsReadAfterTheIdleTimeout) {
  absl::StatusOr<std::unique_ptr<LocalDaemon>> d = StartDaemon(
      {"--pool_bytes=268435456", "--worker_threads=2", "--stream_idle_timeout_ms=5000"});
  ASSERT_TRUE(d.ok()) << d.status();
  absl::StatusOr<std::unique_ptr<KvpoolClient>> c = KvpoolClient::Connect((*d)->target());
  ASSERT_TRUE(c.ok()) << c.status();
  KvpoolClient& client = **c;
  ASSERT_TRUE(RegisterDataFree(client, "rd", kShape, v1::ROTATION_KIND_HADAMARD, 1).ok());
  ASSERT_TRUE(
      CreateAndAppend(client, "rd", "big", MakeSequenceKv(kShape, kBigTokens, 1), true).ok());
  auto stats = [&] {
    absl::StatusOr<v1::GetStatsResponse> s = client.GetStats();
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *s : v1::GetStatsResponse{};
  };
  const uint64_t expired = stats().admission().expired_idle();
  {
    StalledReader reader((*d)->target());
    KV_ASSERT_OK(reader.ReadKv("big", v1::DTYPE_FP32));
    const absl::Time deadline = absl::Now() + absl::Minutes(5);
    v1::GetStatsResponse s = stats();
    while (absl::Now() < deadline &&
           !(s.admission().expired_idle() > expired && s.admission().open_reads() == 0 &&
             s.admission().read_bytes() == 0)) {
      absl::SleepFor(absl::Milliseconds(50));
      s = stats();
    }
    EXPECT_EQ(s.admission().expired_idle(), expired + 1);
    EXPECT_EQ(s.admission().open_reads(), 0u);
    EXPECT_EQ(s.admission().read_bytes(), 0u);
  }
  // The sequence is whole and readable.
  v1::ReadBlocksRequest r;
  r.set_sequence_id("big");
  KV_ASSERT_OK(client.ReadBlocks(r).status());
  KV_ASSERT_OK((*d)->Stop(absl::Seconds(120)));
}

}  // namespace
}  // namespace kvpool::integration
