// What this binary is: the project version (CMake's project(VERSION)), the git commit it was
// configured from, its build type and whether the CUDA backend is compiled in. kvpoold reports
// it in GetStats (BuildInfo), on its metrics page (kvpool_build_info) and for --version; the
// kvpool CLI for --version.
//
//   std::printf("%s\n", kvpool::BuildDescription("kvpoold").c_str());
#pragma once

#include <string>

#include "absl/strings/string_view.h"

namespace kvpool {

struct BuildInfo {
  absl::string_view version;     // "0.1.0"
  absl::string_view git_commit;  // 12 hex digits, "-dirty" appended for local changes; "" unknown
  absl::string_view build_type;  // "Release", "Debug", ...
  bool cuda = false;             // built with the CUDA kernels and backend
};

const BuildInfo& ThisBuild();

// One line: "kvpoold 0.1.0 (commit 0123abcd4567, Release, CUDA off)".
std::string BuildDescription(absl::string_view program);

}  // namespace kvpool
