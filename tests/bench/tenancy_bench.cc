// make bench-tenancy: what authentication and encryption cost. Two kvpoold processes in the same
// run with the same flags: one plaintext without tenants (the baseline), one with TLS and a
// tenants file, called with a bearer token. Written as bench-results/tenancy_tls.json in the
// form of docs/operations.md ("Benchmarks").
//
//   ingest             MB/s of BF16 K/V through AppendKv streams            vs  plaintext
//   remote attention   p50 / p99 ms of Attend (batch 4, 4K context)         vs  plaintext
//   prefix lookup      p50 us of LookupPrefix of another tenant's cached prompt  vs  a miss
//                      (a prompt nobody cached), both on the TLS daemon: a foreign prefix
//                      costs what a miss costs
//
// Certificates come from tests/integration/make_test_certs.sh (the openssl CLI). Nothing here is
// a pass/fail assertion.
//
// Usage: kvpool-bench-tenancy [--out bench-results/tenancy_tls.json] [--kvpoold PATH] [--quick]
#include <stdlib.h>

#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/kvpool_client.h"
#include "client/local_daemon.h"
#include "common/status_macros.h"
#include "tests/bench/bench_report.h"
#include "tests/bench/bench_timing.h"
#include "tests/support/test_data.h"

namespace kvpool::bench {
namespace {

namespace v1 = ::kvpool::v1;
using client::KvpoolClient;

constexpr int kLayers = 4, kQHeads = 32, kKvHeads = 8, kHeadDim = 128;
constexpr char kTokenA[] = "bench-token-team-a-0f1e2d3c";
constexpr char kTokenB[] = "bench-token-team-b-4b5a6978";

struct Options {
  std::string out = "bench-results/tenancy_tls.json";
  std::string kvpoold = KVPOOL_KVPOOLD_PATH;
  std::string certs_script = KVPOOL_SOURCE_DIR "/tests/integration/make_test_certs.sh";
  bool quick = false;
};

struct Daemon {
  std::unique_ptr<client::LocalDaemon> process;
  client::ClientOptions a, b;  // how tenants A and B connect
};

absl::StatusOr<std::string> Sha256Hex(const std::string& dir, const std::string& token) {
  const std::string out = dir + "/hash.txt";
  const std::string cmd = "printf %s '" + token + "' | sha256sum | cut -c1-64 > " + out;
  if (std::system(cmd.c_str()) != 0) return absl::InternalError("sha256sum failed");
  std::ifstream in(out);
  std::string hex;
  in >> hex;
  if (hex.size() != 64) return absl::InternalError("sha256sum printed no hash");
  return hex;
}

absl::StatusOr<Daemon> StartDaemon(const Options& opt, const std::string& dir, bool secure) {
  client::LocalDaemonOptions o;
  o.binary = opt.kvpoold;
  o.flags = {"--pool_bytes=1073741824", "--log_level=warn", "--transports="};
  Daemon d;
  if (secure) {
    const std::string certs = dir + "/certs";
    KVPOOL_ASSIGN_OR_RETURN(std::string hash_a, Sha256Hex(dir, kTokenA));
    KVPOOL_ASSIGN_OR_RETURN(std::string hash_b, Sha256Hex(dir, kTokenB));
    {
      std::ofstream f(dir + "/tenants.txtpb");
      f << "tenant { name: \"a\" role: ROLE_TENANT token_sha256: \"" << hash_a << "\" }\n"
        << "tenant { name: \"b\" role: ROLE_TENANT token_sha256: \"" << hash_b << "\" }\n";
    }
    o.flags.push_back("--tenants_file=" + dir + "/tenants.txtpb");
    o.flags.push_back("--tls_cert=" + certs + "/server.pem");
    o.flags.push_back("--tls_key=" + certs + "/server.key");
    o.client.security.tls_root_ca_file = certs + "/ca.pem";
    d.a = d.b = o.client;
    d.a.security.token = kTokenA;
    d.b.security.token = kTokenB;
  }
  KVPOOL_ASSIGN_OR_RETURN(d.process, client::LocalDaemon::Start(o));
  return d;
}

absl::Status Register(const KvpoolClient& c) {
  v1::ModelSpec spec;
  spec.set_model_id("bench");
  spec.mutable_shape()->set_num_layers(kLayers);
  spec.mutable_shape()->set_q_heads(kQHeads);
  spec.mutable_shape()->set_kv_heads(kKvHeads);
  spec.mutable_shape()->set_head_dim(kHeadDim);
  spec.mutable_data_free()->set_kind(v1::ROTATION_KIND_HADAMARD);
  return c.RegisterModel(spec).status();
}

std::vector<uint32_t> Prompt(int n, uint32_t salt) {
  std::vector<uint32_t> ids(n);
  for (int i = 0; i < n; ++i) ids[i] = (static_cast<uint32_t>(i) * 2654435761u + salt) % 50000;
  return ids;
}

// Appends `tokens` tokens of every layer into a new sequence `id` in one stream.
absl::Status Append(const KvpoolClient& c, const std::string& id, const std::vector<Bf16>& kv,
                    int tokens, const std::vector<uint32_t>& token_ids) {
  KVPOOL_RETURN_IF_ERROR(c.CreateSequence("bench", id).status());
  v1::AppendKvHeader h;
  h.set_sequence_id(id);
  h.set_num_tokens(tokens);
  h.set_dtype(v1::DTYPE_BF16);
  h.set_end_of_prefill(true);
  for (uint32_t t : token_ids) h.add_token_ids(t);
  const absl::string_view bytes(reinterpret_cast<const char*>(kv.data()),
                                size_t{static_cast<size_t>(tokens)} * kKvHeads * kHeadDim * 2);
  std::vector<client::LayerKv> layers;
  for (int l = 0; l < kLayers; ++l) layers.push_back({l, bytes, bytes});
  return c.AppendKv(h, layers).status();
}

struct Measured {
  double ingest_mb_s = 0, attend_p50_ms = 0, attend_p99_ms = 0;
};

absl::StatusOr<Measured> Measure(const Daemon& d, const Options& opt) {
  KVPOOL_ASSIGN_OR_RETURN(auto c, KvpoolClient::Connect(d.process->target(), d.a));
  KVPOOL_RETURN_IF_ERROR(Register(*c));
  const int tokens = opt.quick ? 1024 : 4096;
  const int rounds = opt.quick ? 3 : 8;
  const std::vector<Bf16> kv = testing::ToBf16(
      testing::GaussianValues(size_t{static_cast<size_t>(tokens)} * kKvHeads * kHeadDim, 7));
  Measured m;
  std::vector<double> rates;
  for (int r = 0; r < rounds; ++r) {
    const auto t0 = SteadyClock::now();
    KVPOOL_RETURN_IF_ERROR(Append(*c, absl::StrCat("ingest-", r), kv, tokens, {}));
    const double bytes = 2.0 * kLayers * tokens * kKvHeads * kHeadDim * 2;
    rates.push_back(bytes / SecondsSince(t0) / 1e6);
  }
  m.ingest_mb_s = Median(rates);
  // Attend over 4 of those sequences, layer 0, one query each.
  v1::AttendRequest req;
  req.set_model_id("bench");
  req.set_layer(0);
  req.set_dtype(v1::DTYPE_FP32);
  const std::vector<float> q = testing::GaussianValues(size_t{kQHeads} * kHeadDim, 3);
  for (int i = 0; i < 4; ++i) {
    v1::SequenceQuery* sq = req.add_queries();
    sq->set_sequence_id(absl::StrCat("ingest-", i % rounds));
    sq->set_q(std::string(reinterpret_cast<const char*>(q.data()), q.size() * sizeof(float)));
  }
  std::vector<double> ms;
  for (int i = 0; i < (opt.quick ? 20 : 100); ++i) {
    const auto t0 = SteadyClock::now();
    KVPOOL_RETURN_IF_ERROR(c->Attend(req).status());
    ms.push_back(SecondsSince(t0) * 1e3);
  }
  m.attend_p50_ms = Median(ms);
  m.attend_p99_ms = Percentile(ms, 0.99);
  return m;
}

// p50 microseconds of B's LookupPrefix of A's cached prompt, and of a prompt nobody cached.
absl::StatusOr<std::pair<double, double>> ForeignPrefixVersusMiss(const Daemon& d,
                                                                  const Options& opt) {
  KVPOOL_ASSIGN_OR_RETURN(auto a, KvpoolClient::Connect(d.process->target(), d.a));
  KVPOOL_ASSIGN_OR_RETURN(auto b, KvpoolClient::Connect(d.process->target(), d.b));
  KVPOOL_RETURN_IF_ERROR(Register(*b));
  const int tokens = 2048;
  const std::vector<uint32_t> cached = Prompt(tokens, 1), fresh = Prompt(tokens, 2);
  const std::vector<Bf16> kv = testing::ToBf16(
      testing::GaussianValues(size_t{static_cast<size_t>(tokens)} * kKvHeads * kHeadDim, 9));
  KVPOOL_RETURN_IF_ERROR(Append(*a, "cached", kv, tokens, cached));
  KVPOOL_ASSIGN_OR_RETURN(v1::LookupPrefixResponse own, a->LookupPrefix("bench", cached));
  if (own.matched_tokens() == 0) return absl::InternalError("the owner's lookup missed");
  std::vector<double> foreign_us, miss_us;
  for (int i = 0; i < (opt.quick ? 50 : 400); ++i) {
    for (auto [ids, out] : {std::pair{&cached, &foreign_us}, std::pair{&fresh, &miss_us}}) {
      const auto t0 = SteadyClock::now();
      KVPOOL_ASSIGN_OR_RETURN(v1::LookupPrefixResponse r, b->LookupPrefix("bench", *ids));
      out->push_back(SecondsSince(t0) * 1e6);
      if (r.matched_tokens() != 0) return absl::InternalError("a lookup crossed tenants");
    }
  }
  return std::make_pair(Median(foreign_us), Median(miss_us));
}

absl::Status Run(const Options& opt) {
  char tmpl[] = "/tmp/kvpool-bench-tenancy-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) return absl::InternalError("mkdtemp failed");
  const std::string dir = tmpl;
  if (std::system((opt.certs_script + " " + dir + "/certs").c_str()) != 0) {
    return absl::InternalError("make_test_certs.sh failed (needs the openssl CLI)");
  }
  KVPOOL_ASSIGN_OR_RETURN(Daemon plain, StartDaemon(opt, dir, /*secure=*/false));
  KVPOOL_ASSIGN_OR_RETURN(Daemon secure, StartDaemon(opt, dir, /*secure=*/true));
  KVPOOL_ASSIGN_OR_RETURN(Measured p, Measure(plain, opt));
  KVPOOL_ASSIGN_OR_RETURN(Measured s, Measure(secure, opt));
  KVPOOL_ASSIGN_OR_RETURN(auto lookups, ForeignPrefixVersusMiss(secure, opt));
  KVPOOL_RETURN_IF_ERROR(plain.process->Stop());
  KVPOOL_RETURN_IF_ERROR(secure.process->Stop());
  (void)std::system(("rm -rf " + dir).c_str());

  BenchReport report("tenancy_tls");
  const std::map<std::string, std::string> ingest_params = {
      {"layers", std::to_string(kLayers)},
      {"kv_heads", std::to_string(kKvHeads)},
      {"head_dim", std::to_string(kHeadDim)},
      {"tokens", opt.quick ? "1024" : "4096"}};
  report.Add({"ingest_tls_token",
              ingest_params,
              s.ingest_mb_s,
              "MB/s",
              {"ingest_plaintext", p.ingest_mb_s}});
  const std::map<std::string, std::string> attend_params = {
      {"batch", "4"}, {"context", opt.quick ? "1024" : "4096"}};
  report.Add({"attend_p50_tls_token",
              attend_params,
              s.attend_p50_ms,
              "ms",
              {"attend_p50_plaintext", p.attend_p50_ms}});
  report.Add({"attend_p99_tls_token",
              attend_params,
              s.attend_p99_ms,
              "ms",
              {"attend_p99_plaintext", p.attend_p99_ms}});
  report.Add({"lookup_foreign_prefix_p50",
              {{"tokens", "2048"}},
              lookups.first,
              "us",
              {"lookup_miss_p50", lookups.second}});
  return report.Publish(opt.out);
}

}  // namespace
}  // namespace kvpool::bench

int main(int argc, char** argv) {
  kvpool::bench::Options opt;
  if (!kvpool::bench::ParseBenchArgs(argc, argv, {{"--out", &opt.out}, {"--kvpoold", &opt.kvpoold}},
                                     {{"--quick", &opt.quick}},
                                     "[--out FILE] [--kvpoold PATH] [--quick]")) {
    return 2;
  }
  return kvpool::bench::ExitCode(kvpool::bench::Run(opt));
}
