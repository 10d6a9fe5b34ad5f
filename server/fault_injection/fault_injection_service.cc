#include "server/fault_injection/fault_injection_service.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kvpool/testing/fault_injection.grpc.pb.h"
#include "proto/status.h"
#include "server/sequence_snapshot.h"
#include "spdlog/spdlog.h"
#if defined(KVPOOL_FAULT_INJECTION_CUDA)
#include "kernels/cuda/testing_fault.h"
#endif

namespace kvpool::server {
namespace {

namespace t = ::kvpool::testing;

class FaultInjectionService final : public t::FaultInjection::CallbackService {
 public:
  explicit FaultInjectionService(ServiceContext* ctx) : ctx_(ctx) {}

  grpc::ServerUnaryReactor* CorruptPage(grpc::CallbackServerContext* context,
                                        const t::CorruptPageRequest* request,
                                        t::CorruptPageResponse* /*response*/) override {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(ToGrpcStatus(Corrupt(TenantOf(*ctx_, context), *request)));
    return reactor;
  }

  grpc::ServerUnaryReactor* PoisonDevice(grpc::CallbackServerContext* context,
                                         const t::PoisonDeviceRequest* /*request*/,
                                         t::PoisonDeviceResponse* /*response*/) override {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(ToGrpcStatus(Poison()));
    return reactor;
  }

 private:
  absl::Status Poison() {
    const int device = ctx_->backend->device();
    if (device < 0) return absl::FailedPreconditionError("the pool is not on a GPU");
#if defined(KVPOOL_FAULT_INJECTION_CUDA)
    spdlog::warn("fault injection: poisoning the CUDA context of cuda:{}", device);
    return cuda::testing::PoisonCudaContext(device);
#else
    return absl::UnimplementedError("this build has no CUDA");
#endif
  }

  absl::Status Corrupt(const TenantId& tenant, const t::CorruptPageRequest& r) {
    if (!ctx_->pool->arena().host_accessible()) {
      return absl::UnimplementedError("fault injection writes host-accessible pools only");
    }
    const int layer = static_cast<int>(r.layer());
    absl::StatusOr<std::unique_ptr<SequenceSnapshot>> snap =
        ctx_->store->Snapshot(tenant, r.sequence_id(), {layer});
    if (!snap.ok()) return snap.status();
    const SequenceSnapshot::Layer& l = (*snap)->layers().at(0);
    const std::vector<int32_t>* pages = r.tier() == t::PAGE_TIER_SINK      ? &l.sink
                                        : r.tier() == t::PAGE_TIER_HISTORY ? &l.history
                                        : r.tier() == t::PAGE_TIER_RECENT  ? &l.recent
                                                                           : nullptr;
    if (pages == nullptr) return absl::InvalidArgumentError("tier must be set");
    if (r.page_index() >= pages->size()) {
      return absl::OutOfRangeError(absl::StrCat("page ", r.page_index(), " of ", pages->size()));
    }
    const PageId page = ctx_->pool->PageOfBlock((*pages)[r.page_index()]);
    if (r.byte_offset() >= ctx_->pool->PageBytes(page) || r.bit() > 7) {
      return absl::OutOfRangeError("byte_offset or bit beyond the page");
    }
    ctx_->pool->Data(page)[r.byte_offset()] ^= static_cast<uint8_t>(1u << r.bit());
    spdlog::warn("fault injection: flipped bit {} of byte {} of page {:#x}", r.bit(),
                 r.byte_offset(), page);
    return absl::OkStatus();
  }

  ServiceContext* const ctx_;
};

}  // namespace

std::unique_ptr<grpc::Service> NewFaultInjectionService(ServiceContext* ctx) {
  return std::make_unique<FaultInjectionService>(ctx);
}

}  // namespace kvpool::server
