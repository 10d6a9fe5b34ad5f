#include "server/config.h"

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

ABSL_DECLARE_FLAG(uint64_t, pool_bytes);
ABSL_DECLARE_FLAG(std::string, listen);
ABSL_DECLARE_FLAG(int32_t, worker_threads);
ABSL_DECLARE_FLAG(std::string, ucx_listen);
ABSL_DECLARE_FLAG(bool, cuda_programmatic_launch);
ABSL_DECLARE_FLAG(int32_t, cuda_history_chunk_tokens);
ABSL_DECLARE_FLAG(absl::Duration, sequence_ttl);
ABSL_DECLARE_FLAG(absl::Duration, device_check_period);
ABSL_DECLARE_FLAG(absl::Duration, device_failure_exit_grace);

namespace kvpool::server {
namespace {

TEST(ConfigTest, DefaultsServeOnLoopbackWithACappedPool) {
  auto c = ServerConfigFromFlags();
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->listen, "127.0.0.1:50051");
  EXPECT_EQ(c->device, "cpu");
  EXPECT_GT(c->pool_bytes, 0u);
  EXPECT_LE(c->pool_bytes, size_t{8} << 30);
  EXPECT_EQ(c->pool_bytes % c->slab_bytes, 0u);
  EXPECT_GE(c->worker_threads, 1);
}

TEST(ConfigTest, ConfigTextSetsFlagsAndRejectsMistakes) {
  ASSERT_TRUE(ApplyConfigText("# comment\nlisten = 127.0.0.1:6000\n\npool_bytes=67108864 # 64M\n"
                              "--worker_threads = 3\n",
                              "test.conf")
                  .ok());
  auto c = ServerConfigFromFlags();
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->listen, "127.0.0.1:6000");
  EXPECT_EQ(c->pool_bytes, 64u << 20);
  EXPECT_EQ(c->worker_threads, 3);
  EXPECT_TRUE(absl::IsInvalidArgument(ApplyConfigText("no_such_flag = 1", "t")));
  EXPECT_TRUE(absl::IsInvalidArgument(ApplyConfigText("pool_bytes = lots", "t")));
  EXPECT_TRUE(absl::IsInvalidArgument(ApplyConfigText("just words", "t")));
  EXPECT_TRUE(absl::IsInvalidArgument(ApplyConfigText("config = other.conf", "t")));
  absl::SetFlag(&FLAGS_pool_bytes, 1000);  // smaller than a slab
  EXPECT_TRUE(absl::IsInvalidArgument(ServerConfigFromFlags().status()));
  absl::SetFlag(&FLAGS_pool_bytes, 0);
  absl::SetFlag(&FLAGS_listen, "nocolon");
  EXPECT_TRUE(absl::IsInvalidArgument(ServerConfigFromFlags().status()));
  absl::SetFlag(&FLAGS_listen, "127.0.0.1:50051");
  absl::SetFlag(&FLAGS_worker_threads, 0);
}

TEST(ConfigTest, SequenceTtlIsADurationZeroMeaningNone) {
  auto c = ServerConfigFromFlags();
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->sequence_ttl, absl::ZeroDuration());
  ASSERT_TRUE(ApplyConfigText("sequence_ttl = 90s", "t").ok());
  c = ServerConfigFromFlags();
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->sequence_ttl, absl::Seconds(90));
  EXPECT_TRUE(absl::IsInvalidArgument(ApplyConfigText("sequence_ttl = soon", "t")));
  absl::SetFlag(&FLAGS_sequence_ttl, absl::Seconds(-1));
  EXPECT_TRUE(absl::IsInvalidArgument(ServerConfigFromFlags().status()));
  absl::SetFlag(&FLAGS_sequence_ttl, absl::ZeroDuration());
}

// One idle limit: the old UCX-only flag is an alias that replaces it when given.
TEST(ConfigTest, TransportIdleTimeoutIsADeprecatedAliasOfTheStreamIdleTimeout) {
  auto c = ServerConfigFromFlags();
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->stream_idle_timeout_ms, 30000);
  EXPECT_EQ(c->transport_idle_timeout_ms, 0);
  ASSERT_TRUE(ApplyConfigText("stream_idle_timeout_ms = 9000", "t").ok());
  c = ServerConfigFromFlags();
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->stream_idle_timeout_ms, 9000);
  ASSERT_TRUE(ApplyConfigText("transport_idle_timeout_ms = 5000", "t").ok());
  c = ServerConfigFromFlags();
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->stream_idle_timeout_ms, 5000);
  ASSERT_TRUE(ApplyConfigText("transport_idle_timeout_ms = -1", "t").ok());
  EXPECT_TRUE(absl::IsInvalidArgument(ServerConfigFromFlags().status()));
  ASSERT_TRUE(
      ApplyConfigText("transport_idle_timeout_ms = 0\nstream_idle_timeout_ms = 30000", "t").ok());
}

TEST(ConfigTest, DeviceHealthDurationsHaveDefaultsAndBounds) {
  auto c = ServerConfigFromFlags();
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->device_check_period, absl::Seconds(1));
  EXPECT_EQ(c->device_failure_exit_grace, absl::Seconds(5));
  ASSERT_TRUE(
      ApplyConfigText("device_check_period = 250ms\ndevice_failure_exit_grace = 0", "t").ok());
  c = ServerConfigFromFlags();
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->device_check_period, absl::Milliseconds(250));
  EXPECT_EQ(c->device_failure_exit_grace, absl::ZeroDuration());
  absl::SetFlag(&FLAGS_device_check_period, absl::ZeroDuration());  // would never check
  EXPECT_TRUE(absl::IsInvalidArgument(ServerConfigFromFlags().status()));
  absl::SetFlag(&FLAGS_device_check_period, absl::Seconds(1));
  absl::SetFlag(&FLAGS_device_failure_exit_grace, absl::Seconds(-1));
  EXPECT_TRUE(absl::IsInvalidArgument(ServerConfigFromFlags().status()));
  absl::SetFlag(&FLAGS_device_failure_exit_grace, absl::Seconds(5));
}

TEST(ConfigTest, HostPortSplitsAndRejectsMalformedAddresses) {
  auto a = ParseHostPort("127.0.0.1:0");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->host, "127.0.0.1");
  EXPECT_EQ(a->port, 0);
  a = ParseHostPort("[::1]:65535");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->host, "::1");
  EXPECT_EQ(a->port, 65535);
  a = ParseHostPort(":7000");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->host, "");
  for (const char* bad : {"", "host", "host:", "host:port", "host:65536", "host:-1", "::1:80"}) {
    EXPECT_TRUE(absl::IsInvalidArgument(ParseHostPort(bad).status())) << bad;
  }
  absl::SetFlag(&FLAGS_ucx_listen, "127.0.0.1:99999");
  EXPECT_TRUE(absl::IsInvalidArgument(ServerConfigFromFlags().status()));
  absl::SetFlag(&FLAGS_ucx_listen, "10.0.0.1:7000");
  auto c = ServerConfigFromFlags();
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->ucx_listen, "10.0.0.1:7000");
  absl::SetFlag(&FLAGS_ucx_listen, "");
}

TEST(ConfigTest, LoopbackHosts) {
  for (const char* h : {"localhost", "127.0.0.1", "127.1.2.3", "::1"}) {
    EXPECT_TRUE(IsLoopbackHost(h)) << h;
  }
  for (const char* h : {"", "0.0.0.0", "::", "10.0.0.1", "128.0.0.1", "127.example.com", "::2"}) {
    EXPECT_FALSE(IsLoopbackHost(h)) << h;
  }
}

TEST(ConfigTest, NonLoopbackNeedsTenantsAndTlsOrInsecure) {
  ServerConfig c;
  c.pool_bytes = 64u << 20;
  c.worker_threads = 1;
  c.listen = "0.0.0.0:50051";
  absl::Status s = c.Validate();
  EXPECT_TRUE(absl::IsInvalidArgument(s));
  EXPECT_NE(s.message().find("--insecure"), std::string::npos) << s;
  c.insecure = true;
  EXPECT_TRUE(c.Validate().ok());
  c.insecure = false;
  c.tenants_file = "/etc/kvpool/tenants.txtpb";
  s = c.Validate();
  EXPECT_NE(s.message().find("in clear"), std::string::npos) << s;
  c.tls_cert = "cert.pem";
  EXPECT_TRUE(absl::IsInvalidArgument(c.Validate()));  // a certificate without its key
  c.tls_key = "key.pem";
  EXPECT_TRUE(c.Validate().ok());
  c.tls_cert = c.tls_key = "";
  c.tls_client_ca = "ca.pem";
  c.listen = "127.0.0.1:0";
  EXPECT_TRUE(absl::IsInvalidArgument(c.Validate()));  // client CA without TLS
  c.tls_client_ca = "";
  EXPECT_TRUE(c.Validate().ok());  // tokens over loopback
}

TEST(ConfigTest, LogFormatIsTextOrJson) {
  ServerConfig c;
  c.pool_bytes = 64u << 20;
  c.worker_threads = 1;
  EXPECT_EQ(c.log_format, "text");
  c.log_format = "json";
  EXPECT_TRUE(c.Validate().ok());
  c.log_format = "xml";
  const absl::Status s = c.Validate();
  EXPECT_TRUE(absl::IsInvalidArgument(s));
  EXPECT_NE(s.message().find("--log_format"), std::string::npos) << s;
}

TEST(ConfigTest, CudaFlagsSetTheKernelTuningAndDefaultToTheMeasuredOnes) {
  auto c = ServerConfigFromFlags();
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->cuda_tuning.attention.programmatic_launch);
  EXPECT_EQ(c->cuda_tuning.attention.max_history_chunk_tokens,
            cuda::AttentionTuning{}.max_history_chunk_tokens);
  ASSERT_TRUE(
      ApplyConfigText("cuda_programmatic_launch = false\ncuda_history_chunk_tokens = 8192\n",
                      "test.conf")
          .ok());
  c = ServerConfigFromFlags();
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->cuda_tuning.attention.programmatic_launch);
  EXPECT_EQ(c->cuda_tuning.attention.max_history_chunk_tokens, 8192);
  // The fields without a flag keep their defaults.
  EXPECT_TRUE(c->cuda_tuning.attention.narrow_layout);
  EXPECT_TRUE(c->cuda_tuning.arrival.mma_kernel);
  absl::SetFlag(&FLAGS_cuda_history_chunk_tokens, -1);
  EXPECT_TRUE(absl::IsInvalidArgument(ServerConfigFromFlags().status()));
  absl::SetFlag(&FLAGS_cuda_history_chunk_tokens, cuda::AttentionTuning{}.max_history_chunk_tokens);
  absl::SetFlag(&FLAGS_cuda_programmatic_launch, true);
}

TEST(ConfigTest, AutoPoolIsAFractionCappedAndAligned) {
  const size_t align = 4 << 20;
  const size_t small = AutoPoolBytes(0.01, size_t{1} << 40, align);
  EXPECT_EQ(small % align, 0u);
  EXPECT_GE(small, align);
  EXPECT_EQ(AutoPoolBytes(0.9, 64 << 20, align), 64u << 20);
}

}  // namespace
}  // namespace kvpool::server
