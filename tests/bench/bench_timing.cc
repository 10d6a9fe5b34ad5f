#include "tests/bench/bench_timing.h"

#include <algorithm>
#include <cmath>
#include <thread>

namespace kvpool::bench {

double SecondsSince(SteadyClock::time_point t0) {
  return std::chrono::duration<double>(SteadyClock::now() - t0).count();
}

double Percentile(std::vector<double> samples, double p) {
  std::sort(samples.begin(), samples.end());
  const size_t rank = static_cast<size_t>(std::ceil(p * samples.size()));
  return samples[std::min(samples.size(), std::max<size_t>(rank, 1)) - 1];
}

double Median(std::vector<double> samples) { return Percentile(std::move(samples), 0.5); }

absl::StatusOr<double> RunParallel(int threads, const std::function<absl::Status(int)>& fn) {
  std::vector<absl::Status> status(threads);
  std::vector<std::thread> pool;
  const auto t0 = SteadyClock::now();
  for (int i = 0; i < threads; ++i) pool.emplace_back([&, i] { status[i] = fn(i); });
  for (std::thread& t : pool) t.join();
  const double secs = SecondsSince(t0);
  for (const absl::Status& s : status) {
    if (!s.ok()) return s;
  }
  return secs;
}

}  // namespace kvpool::bench
