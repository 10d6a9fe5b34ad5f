#include "server/backend.h"

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "server/cpu_backend.h"
#include "server/cuda_backend.h"

namespace kvpool::server {
namespace {

class HostTables final : public ResidentTables {
 public:
  explicit HostTables(size_t words) : words_(new int32_t[words]()), size_(words) {}
  int32_t* words() const override { return words_.get(); }
  size_t size() const override { return size_; }

 private:
  const std::unique_ptr<int32_t[]> words_;
  const size_t size_;
};

class HostMemory final : public HostRegistration {
 public:
  void* KernelAddress(void* p) const override { return p; }
};

}  // namespace

absl::StatusOr<std::unique_ptr<ResidentTables>> ComputeBackend::AllocateTables(size_t words) {
  return std::make_unique<HostTables>(words);
}

absl::Status ComputeBackend::PatchTables(ResidentTables* tables,
                                         absl::Span<const TableWord> patch) {
  int32_t* w = tables->words();
  for (const TableWord& p : patch) {
    if (p.index >= tables->size()) return absl::InternalError("table patch out of range");
    w[p.index] = p.value;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<HostRegistration>> ComputeBackend::RegisterHostMemory(
    void* /*p*/, size_t /*bytes*/) {
  return std::make_unique<HostMemory>();
}

absl::StatusOr<std::unique_ptr<ComputeBackend>> CreateBackend(
    absl::string_view name, const cuda::KernelTuning& cuda_tuning) {
  if (name == "cpu") return NewCpuBackend();
  if (absl::StartsWith(name, "cuda:")) {
    int device = -1;
    if (!absl::SimpleAtoi(name.substr(5), &device) || device < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("bad device '", name, "' (expected cpu or cuda:N with N >= 0)"));
    }
    return NewCudaBackend(device, cuda_tuning);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown device '", name, "' (expected cpu or cuda:N)"));
}

}  // namespace kvpool::server
