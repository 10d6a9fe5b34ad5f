// kvpool-soak: many clients against one kvpoold for a while, then an exact accounting check.
//
// Starts the kvpoold built with it (or uses --target, an otherwise idle daemon), registers shared
// models (identity + BF16 bypass, INT2 Hadamard, INT4 randomized Hadamard), runs --clients
// threads, each with its own connection, for --seconds doing a random mix of honest and hostile
// requests (tests/soak/soak_client.h), releases everything and checks that the daemon's
// accounting is back to its baseline (tests/soak/soak_accounting.h). Prints a table of the RPCs
// and their status codes. Exits 0 only when every answer was the expected one, every read and
// attention result matched, the accounting is exact, and a daemon it started exited cleanly
// (status 0: a sanitizer report at exit fails the run).
//
//   kvpool-soak --clients=16 --seconds=180
//   kvpool-soak --target=127.0.0.1:50051 --seconds=60
#include <sys/wait.h>

#include <cstdlib>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "client/kvpool_client.h"
#include "client/local_daemon.h"
#include "common/status_macros.h"
#include "tests/soak/soak_accounting.h"
#include "tests/soak/soak_client.h"

ABSL_FLAG(std::string, target, "",
          "host:port of a running, otherwise idle kvpoold; empty: start the kvpoold built here");
ABSL_FLAG(std::string, kvpoold, KVPOOL_KVPOOLD_PATH, "kvpoold binary to start without --target");
ABSL_FLAG(std::vector<std::string>, daemon_flags, {},
          "further flags for the started kvpoold, comma-separated");
ABSL_FLAG(int, clients, 16, "client threads, each with its own connection");
ABSL_FLAG(double, seconds, 30, "how long the clients run");
ABSL_FLAG(uint64_t, seed, 0, "random seed (0: from the clock; printed)");
ABSL_FLAG(int, max_live_sequences, 6, "live sequences per client");
ABSL_FLAG(int, max_tokens, 640, "longest sequence a client grows");
ABSL_FLAG(double, settle_seconds, 120,
          "how long the final check waits for the daemon to finish rolling back cut calls");

namespace kvpool::soak {
namespace {

// Small limits so that oversize requests are cheap to send; everything else as shipped.
std::vector<std::string> DaemonFlags() {
  std::vector<std::string> flags = {"--pool_bytes=134217728",    "--worker_threads=2",
                                    "--max_chunk_bytes=262144",  "--max_message_bytes=1048576",
                                    "--max_attention_batch=16",  "--max_append_tokens=65536",
                                    "--shutdown_grace_ms=10000", "--log_level=warn"};
  for (const std::string& f : absl::GetFlag(FLAGS_daemon_flags)) flags.push_back(f);
  return flags;
}

absl::StatusOr<std::vector<SoakModel>> RegisterSharedModels(const client::KvpoolClient& c,
                                                            const std::string& prefix) {
  const SoakShape shape;
  std::vector<SoakModel> models;
  // The first is the exact one: clients' probe sequences use it.
  struct Choice {
    const char* name;
    bool exact;
    v1::RotationKind kind;
    int bits;
  };
  for (const Choice& m : {Choice{"exact", true, v1::ROTATION_KIND_IDENTITY, 16},
                          Choice{"int2", false, v1::ROTATION_KIND_HADAMARD, 2},
                          Choice{"int4", false, v1::ROTATION_KIND_RANDOMIZED_HADAMARD, 4}}) {
    const v1::ModelSpec spec =
        SoakModelSpec(absl::StrCat(prefix, "-", m.name), shape, m.exact, m.kind, 17, m.bits);
    KVPOOL_ASSIGN_OR_RETURN(SoakModel model, RegisterSoakModel(c, spec, m.exact));
    models.push_back(std::move(model));
  }
  return models;
}

int Run() {
  uint64_t seed = absl::GetFlag(FLAGS_seed);
  if (seed == 0) seed = static_cast<uint64_t>(absl::ToUnixNanos(absl::Now()));
  const std::string prefix = absl::StrCat("soak", seed % 1000000);

  std::unique_ptr<client::LocalDaemon> daemon;
  std::string target = absl::GetFlag(FLAGS_target);
  if (target.empty()) {
    client::LocalDaemonOptions options;
    options.binary = absl::GetFlag(FLAGS_kvpoold);
    options.flags = DaemonFlags();
    options.startup_timeout = absl::Seconds(300);
    absl::StatusOr<std::unique_ptr<client::LocalDaemon>> started =
        client::LocalDaemon::Start(options);
    if (!started.ok()) {
      std::cerr << "kvpool-soak: FAIL: kvpoold did not start: " << started.status() << "\n";
      return 1;
    }
    daemon = *std::move(started);
    target = daemon->target();
  }
  auto fail = [&](const std::string& why) {
    std::cerr << "kvpool-soak: FAIL: " << why << "\n";
    if (daemon != nullptr) {
      std::cerr << "kvpoold " << (daemon->Running() ? "is running" : "has exited")
                << "; its log ends with:\n"
                << daemon->LogTail(8000) << "\n";
    }
    return 1;
  };

  client::ClientOptions options;
  options.deadline = absl::Seconds(300);
  absl::StatusOr<std::unique_ptr<client::KvpoolClient>> control =
      client::KvpoolClient::Connect(target, options);
  if (!control.ok()) return fail(control.status().ToString());
  client::KvpoolClient& c = **control;
  if (absl::Status s = c.WaitForServing(absl::Seconds(120)); !s.ok()) return fail(s.ToString());
  absl::StatusOr<v1::GetStatsResponse> baseline = c.GetStats(/*include_sequences=*/true);
  if (!baseline.ok()) return fail(baseline.status().ToString());
  absl::StatusOr<std::vector<SoakModel>> models = RegisterSharedModels(c, prefix);
  if (!models.ok()) return fail(models.status().ToString());

  SoakOptions soak;
  soak.clients = absl::GetFlag(FLAGS_clients);
  soak.duration = absl::Seconds(absl::GetFlag(FLAGS_seconds));
  soak.seed = seed;
  soak.max_live_sequences = absl::GetFlag(FLAGS_max_live_sequences);
  soak.max_tokens = absl::GetFlag(FLAGS_max_tokens);
  soak.id_prefix = prefix;
  std::cout << "kvpool-soak: " << soak.clients << " clients for "
            << absl::FormatDuration(soak.duration) << " against " << target << " ("
            << baseline->service().backend() << ", " << baseline->service().version() << "), seed "
            << seed << "\n"
            << std::flush;

  SoakRun run(target, soak, baseline->limits(), *models);
  const absl::Time started = absl::Now();
  std::vector<std::unique_ptr<SoakClient>> clients;
  std::vector<std::thread> threads;
  for (int i = 0; i < soak.clients; ++i) {
    clients.push_back(std::make_unique<SoakClient>(i, &run));
    threads.emplace_back([client = clients.back().get()] { client->Run(); });
  }
  // Watch the daemon: a crash stops the run at once with its log.
  while (!run.stopping()) {
    absl::SleepFor(absl::Milliseconds(200));
    if (daemon != nullptr && !daemon->Running()) run.Fail("kvpoold exited during the run");
  }
  for (std::thread& t : threads) t.join();
  const absl::Duration elapsed = absl::Now() - started;

  SoakReport total;
  for (const auto& client : clients) total.Merge(client->report());
  std::cout << total.Table(elapsed) << std::flush;
  if (run.failed()) return fail(run.failure());

  std::string log;
  const absl::Status accounting =
      CheckFinalAccounting(c, *baseline, *models, prefix, total.counters,
                           absl::Seconds(absl::GetFlag(FLAGS_settle_seconds)), &log);
  std::cout << log;
  if (!accounting.ok()) return fail(std::string(accounting.message()));
  std::cout << "accounting: exact (pool, page classes, slabs, prefix units, sequences, models, "
               "data plane back to the baseline; counters within bounds)\n";

  if (daemon != nullptr) {
    if (absl::Status stopped = daemon->Stop(absl::Seconds(300)); !stopped.ok()) {
      std::cerr << "kvpool-soak: FAIL: kvpoold did not exit cleanly: " << stopped << "\n";
      return 1;
    }
    std::cout << "kvpoold exited cleanly\n";
  }
  std::cout << "kvpool-soak: PASS\n";
  return 0;
}

}  // namespace
}  // namespace kvpool::soak

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Runs many clients against kvpoold with honest and hostile requests, then checks exact "
      "accounting. Exit status 0 only when everything matched.");
  absl::ParseCommandLine(argc, argv);
  return kvpool::soak::Run();
}
