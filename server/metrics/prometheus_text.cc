#include "server/metrics/prometheus_text.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace kvpool::server {

std::string EscapeLabelValue(absl::string_view value) {
  std::string out;
  out.reserve(value.size());
  for (char c : value) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

void PrometheusText::Family(absl::string_view name, absl::string_view type,
                            absl::string_view help) {
  absl::StrAppend(&text_, "# HELP ", name, " ", help, "\n# TYPE ", name, " ", type, "\n");
}

void PrometheusText::Series(absl::string_view name, const MetricLabels& labels) {
  text_.append(name.data(), name.size());
  if (!labels.empty()) {
    text_ += '{';
    for (size_t i = 0; i < labels.size(); ++i) {
      absl::StrAppend(&text_, i == 0 ? "" : ",", labels[i].first, "=\"",
                      EscapeLabelValue(labels[i].second), "\"");
    }
    text_ += '}';
  }
  text_ += ' ';
}

void PrometheusText::Sample(absl::string_view name, const MetricLabels& labels, double value) {
  Series(name, labels);
  if (std::isnan(value)) {
    text_ += "NaN";
  } else if (std::isinf(value)) {
    text_ += value > 0 ? "+Inf" : "-Inf";
  } else {
    // 17 significant digits: a scraper parses back the same double.
    absl::StrAppend(&text_, absl::StrFormat("%.17g", value));
  }
  text_ += '\n';
}

void PrometheusText::Sample(absl::string_view name, const MetricLabels& labels, uint64_t value) {
  Series(name, labels);
  absl::StrAppend(&text_, value, "\n");
}

}  // namespace kvpool::server
