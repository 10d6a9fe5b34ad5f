// Benchmark results in the JSON form of docs/operations.md ("Benchmarks"), shared by every kvpool
// benchmark:
//
//   {"machine": {...}, "results": [{"name", "params", "value", "unit",
//                                   "baseline": {"name", "value"}, "ratio"}]}
//
// ratio = value / baseline.value (for "lower is better" units such as latency the caller passes
// the ratio it wants to show; see BenchResult::ratio).
//
//   BenchReport report("cpu");
//   report.Add({"rotate_quantize", {{"D", "128"}}, 1.2, "GB/s", {"sgemm_implied", 2.0}});
//   report.PrintTable(std::cout);
//   KVPOOL_RETURN_IF_ERROR(report.WriteJson("bench-results/cpu.json"));
#pragma once

#include <map>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace kvpool::bench {

struct BenchBaseline {
  std::string name;
  double value = 0.0;
};

struct BenchResult {
  std::string name;
  std::map<std::string, std::string> params;
  double value = 0.0;
  std::string unit;
  BenchBaseline baseline;
  // value / baseline.value unless set explicitly (>= 0).
  double ratio = -1.0;
};

class BenchReport {
 public:
  explicit BenchReport(std::string suite) : suite_(std::move(suite)) {}
  void Add(BenchResult r);
  const std::vector<BenchResult>& results() const { return results_; }
  void PrintTable(std::ostream& os) const;
  absl::Status WriteJson(const std::string& path) const;
  // PrintTable to stdout, WriteJson to `path`, and a line naming it.
  absl::Status Publish(const std::string& path) const;

 private:
  std::string suite_;
  std::vector<BenchResult> results_;
};

// Command-line options of a benchmark: `--name VALUE` for each entry of `values`, `--name` for
// each of `switches`. False (after printing `usage`) on anything else or a missing value.
bool ParseBenchArgs(int argc, char** argv, const std::map<std::string, std::string*>& values,
                    const std::map<std::string, bool*>& switches, const char* usage);

// The options of a benchmark that starts its own kvpoold (the GPU daemon benchmarks):
// --kvpoold PATH (required) [--device cuda:N] [--out FILE] [--quick]. `out` keeps its default
// unless given. False after printing the usage.
struct DaemonBenchOptions {
  std::string kvpoold;
  std::string device = "cuda:0";
  std::string out;
  bool quick = false;
  std::vector<std::string> kvpoold_flags;  // more kvpoold flags, for A/B runs
};
bool ParseDaemonBenchArgs(int argc, char** argv, DaemonBenchOptions* options);

// A benchmark main's exit status: 0, or 1 after printing the error.
int ExitCode(const absl::Status& s);

// CPU model, core count, memory, compiler: the "machine" object.
std::map<std::string, std::string> MachineInfo();

}  // namespace kvpool::bench
