// Timing helpers shared by the benchmarks: elapsed seconds, order statistics of samples, and a
// fixed set of threads run once (the service and GPU benchmarks' parallel clients).
//
//   const auto t0 = SteadyClock::now();
//   ...;
//   samples.push_back(SecondsSince(t0));
//   double p99 = Percentile(samples, 0.99);
//   KVPOOL_ASSIGN_OR_RETURN(double secs, RunParallel(4, [&](int i) { return Push(i); }));
#pragma once

#include <chrono>
#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvpool::bench {

using SteadyClock = std::chrono::steady_clock;

double SecondsSince(SteadyClock::time_point t0);

// Nearest-rank percentile (p in (0, 1]) of non-empty `samples`.
double Percentile(std::vector<double> samples, double p);
double Median(std::vector<double> samples);

// Runs fn(0) .. fn(threads - 1) on their own threads; the wall seconds they took together, or
// the first error.
absl::StatusOr<double> RunParallel(int threads, const std::function<absl::Status(int)>& fn);

}  // namespace kvpool::bench
