// PrometheusText: builds a page of the Prometheus text exposition format (version 0.0.4):
// one `# HELP` and `# TYPE` line per family, then its samples, label values escaped.
//
//   PrometheusText out;
//   out.Family("kvpool_pool_bytes", "gauge", "Pool bytes by state.");
//   out.Sample("kvpool_pool_bytes", {{"state", "used"}}, 4096);
//   std::string page = out.Take();
//
// Families must be declared once each, before their samples. Not thread-safe (one per scrape).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"

namespace kvpool::server {

using MetricLabels = std::vector<std::pair<absl::string_view, absl::string_view>>;

class PrometheusText {
 public:
  void Family(absl::string_view name, absl::string_view type, absl::string_view help);
  // `name` is the family's name or, for histograms, with _bucket/_sum/_count.
  void Sample(absl::string_view name, const MetricLabels& labels, double value);
  void Sample(absl::string_view name, const MetricLabels& labels, uint64_t value);
  std::string Take() { return std::move(text_); }

 private:
  void Series(absl::string_view name, const MetricLabels& labels);
  std::string text_;
};

// A label value escaped for the text format (backslash, double quote, newline).
std::string EscapeLabelValue(absl::string_view value);

}  // namespace kvpool::server
