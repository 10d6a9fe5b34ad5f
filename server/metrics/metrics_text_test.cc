// The pieces of the metrics page that need no daemon: label escaping, number formats, latency
// buckets and the Attend batch buckets (the page itself is checked against a real kvpoold in
// tests/observability).
#include <limits>
#include <string>

#include "gtest/gtest.h"
#include "server/metrics/prometheus_text.h"
#include "server/metrics/rpc_latency.h"

namespace kvpool::server {
namespace {

TEST(PrometheusTextTest, EscapesLabelValuesAndWritesFamiliesOnce) {
  PrometheusText out;
  out.Family("kvpool_x", "gauge", "An example.");
  out.Sample("kvpool_x", {{"tenant", "a\"b\\c\nd"}}, uint64_t{7});
  out.Sample("kvpool_x", {}, 0.25);
  EXPECT_EQ(out.Take(),
            "# HELP kvpool_x An example.\n# TYPE kvpool_x gauge\n"
            "kvpool_x{tenant=\"a\\\"b\\\\c\\nd\"} 7\nkvpool_x 0.25\n");
}

TEST(PrometheusTextTest, DoublesRoundTripAndSpecialValuesAreSpelledOut) {
  PrometheusText out;
  out.Sample("a", {}, 0.1);
  out.Sample("b", {}, std::numeric_limits<double>::infinity());
  const std::string text = out.Take();
  EXPECT_EQ(std::stod(text.substr(2, text.find('\n') - 2)), 0.1);
  EXPECT_NE(text.find("b +Inf\n"), std::string::npos);
}

TEST(RpcLatencyTest, CountsCallsPerMethodAndCodeIntoTheirBuckets) {
  RpcLatency latency;
  latency.Record("m", 0, 0.00005);  // first bucket
  latency.Record("m", 0, 0.003);    // le 0.005
  latency.Record("m", 0, 1000.0);   // over every bound: +Inf only
  latency.Record("m", 5, 0.003);
  latency.Record("m", 99, 0.003);  // an out-of-range code counts as UNKNOWN
  const auto series = latency.Snapshot();
  ASSERT_EQ(series.size(), 3u);
  EXPECT_EQ(series[0].code, "OK");
  EXPECT_EQ(series[0].count, 3u);
  EXPECT_EQ(series[0].buckets[0], 1u);
  EXPECT_EQ(series[0].buckets[5], 1u);  // 0.005
  EXPECT_EQ(series[0].buckets.back(), 1u);
  EXPECT_EQ(series[1].code, "UNKNOWN");
  EXPECT_EQ(series[2].code, "NOT_FOUND");
}

TEST(RpcLatencyTest, AttendBatchBuckets) {
  EXPECT_EQ(AttendBatchBucket(1), "1");
  EXPECT_EQ(AttendBatchBucket(2), "2-4");
  EXPECT_EQ(AttendBatchBucket(4), "2-4");
  EXPECT_EQ(AttendBatchBucket(5), "5-8");
  EXPECT_EQ(AttendBatchBucket(9), "9-16");
  EXPECT_EQ(AttendBatchBucket(256), "129-256");
  EXPECT_EQ(AttendBatchBucket(257), "257+");
  EXPECT_EQ(AttendBatchBucket(100000), "257+");
}

}  // namespace
}  // namespace kvpool::server
