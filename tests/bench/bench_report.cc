#include "tests/bench/bench_report.h"

#include <sys/sysinfo.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <sstream>

#include "absl/strings/str_split.h"
#include "nlohmann/json.hpp"

namespace kvpool::bench {

void BenchReport::Add(BenchResult r) {
  if (r.ratio < 0.0) r.ratio = r.baseline.value != 0.0 ? r.value / r.baseline.value : 0.0;
  results_.push_back(std::move(r));
}

void BenchReport::PrintTable(std::ostream& os) const {
  os << "\n" << suite_ << " benchmark\n";
  os << std::left << std::setw(34) << "name" << std::setw(36) << "params" << std::right
     << std::setw(12) << "value"
     << "  " << std::left << std::setw(8) << "unit" << std::setw(24) << "baseline" << std::right
     << std::setw(12) << "base value" << std::setw(9) << "ratio"
     << "\n";
  for (const BenchResult& r : results_) {
    std::ostringstream params;
    for (const auto& [k, v] : r.params) params << k << "=" << v << " ";
    os << std::left << std::setw(34) << r.name << std::setw(36) << params.str() << std::right
       << std::setw(12) << std::setprecision(4) << r.value << "  " << std::left << std::setw(8)
       << r.unit << std::setw(24) << r.baseline.name << std::right << std::setw(12)
       << std::setprecision(4) << r.baseline.value << std::setw(9) << std::setprecision(3)
       << r.ratio << "\n";
  }
}

absl::Status BenchReport::Publish(const std::string& path) const {
  PrintTable(std::cout);
  if (absl::Status s = WriteJson(path); !s.ok()) return s;
  std::cout << "wrote " << path << "\n";
  return absl::OkStatus();
}

bool ParseBenchArgs(int argc, char** argv, const std::map<std::string, std::string*>& values,
                    const std::map<std::string, bool*>& switches, const char* usage) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (auto v = values.find(a); v != values.end() && i + 1 < argc) {
      *v->second = argv[++i];
    } else if (auto w = switches.find(a); w != switches.end()) {
      *w->second = true;
    } else {
      std::cerr << "usage: " << argv[0] << " " << usage << "\n";
      return false;
    }
  }
  return true;
}

bool ParseDaemonBenchArgs(int argc, char** argv, DaemonBenchOptions* o) {
  const char* usage =
      "--kvpoold PATH [--device cuda:0] [--out FILE] [--quick] [--kvpoold_flags 'FLAG ...']";
  std::string flags;
  if (!ParseBenchArgs(argc, argv,
                      {{"--kvpoold", &o->kvpoold},
                       {"--device", &o->device},
                       {"--out", &o->out},
                       {"--kvpoold_flags", &flags}},
                      {{"--quick", &o->quick}}, usage)) {
    return false;
  }
  o->kvpoold_flags = absl::StrSplit(flags, ' ', absl::SkipEmpty());
  if (o->kvpoold.empty()) {
    std::cerr << "usage: " << argv[0] << " " << usage << "\n";
    return false;
  }
  return true;
}

int ExitCode(const absl::Status& s) {
  if (s.ok()) return 0;
  std::cerr << "error: " << s << "\n";
  return 1;
}

absl::Status BenchReport::WriteJson(const std::string& path) const {
  nlohmann::json doc;
  doc["suite"] = suite_;
  doc["machine"] = MachineInfo();
  doc["results"] = nlohmann::json::array();
  for (const BenchResult& r : results_) {
    doc["results"].push_back(
        {{"name", r.name},
         {"params", r.params},
         {"value", r.value},
         {"unit", r.unit},
         {"baseline", {{"name", r.baseline.name}, {"value", r.baseline.value}}},
         {"ratio", r.ratio}});
  }
  std::ofstream out(path);
  if (!out) return absl::UnavailableError("cannot write " + path);
  out << doc.dump(2) << "\n";
  if (!out) return absl::DataLossError("short write to " + path);
  return absl::OkStatus();
}

std::map<std::string, std::string> MachineInfo() {
  std::map<std::string, std::string> m;
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("model name", 0) == 0) {
      m["cpu"] = line.substr(line.find(':') + 2);
      break;
    }
  }
  m["cores"] = std::to_string(sysconf(_SC_NPROCESSORS_ONLN));
  struct sysinfo si;
  if (sysinfo(&si) == 0) {
    m["memory_gib"] =
        std::to_string(static_cast<double>(si.totalram) * si.mem_unit / (1024.0 * 1024 * 1024));
  }
  m["compiler"] = std::string("gcc ") + __VERSION__;
  char host[256] = {0};
  if (gethostname(host, sizeof(host) - 1) == 0) m["host"] = host;
  return m;
}

}  // namespace kvpool::bench
