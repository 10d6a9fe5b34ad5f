#include "common/build_info.h"

#include "absl/strings/str_cat.h"

// Defined for this file only by common/CMakeLists.txt, at configure time.
#ifndef KVPOOL_BUILD_VERSION
#error "KVPOOL_BUILD_VERSION must be defined by the build"
#endif

namespace kvpool {

const BuildInfo& ThisBuild() {
  static const BuildInfo kBuild{KVPOOL_BUILD_VERSION, KVPOOL_BUILD_GIT_COMMIT, KVPOOL_BUILD_TYPE,
                                KVPOOL_BUILD_CUDA != 0};
  return kBuild;
}

std::string BuildDescription(absl::string_view program) {
  const BuildInfo& b = ThisBuild();
  return absl::StrCat(program, " ", b.version, " (commit ",
                      b.git_commit.empty() ? "unknown" : b.git_commit, ", ", b.build_type,
                      ", CUDA ", b.cuda ? "on" : "off", ")");
}

}  // namespace kvpool
