// Fuzz target: request validation of every kvpool.v1 RPC, end to end in one process. The
// input's first byte picks the RPC (rpc_catalog.h); the rest is its request message (for a
// client-streaming RPC up to 8 messages, each framed by a varint length) in protobuf bytes,
// sent through an in-process channel to the real service handlers of a kvpoold with a small
// pool (fuzz_daemon.h). Every input starts from the same base state (model "m", sequences "s"
// and "e"), so a run is deterministic up to thread scheduling.
//
// Beyond crashes and sanitizer reports, a finding is:
//   - a call that does not answer within kCallDeadline (the daemon wedged),
//   - an UNKNOWN, INTERNAL or DATA_LOSS answer to a request (an unhandled case),
//   - a request that failed, or that only reads, yet changed pool usage, models or sequences.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "google/protobuf/util/message_differencer.h"
#include "kvpool/v1/admin_service.grpc.pb.h"
#include "kvpool/v1/attention_service.grpc.pb.h"
#include "kvpool/v1/model_service.grpc.pb.h"
#include "kvpool/v1/read_service.grpc.pb.h"
#include "kvpool/v1/sequence_service.grpc.pb.h"
#include "kvpool/v1/stats_service.grpc.pb.h"
#include "kvpool/v1/transport_service.grpc.pb.h"
#include "proto/service_stubs.h"
#include "tests/fuzz/fuzz_check.h"
#include "tests/fuzz/fuzz_daemon.h"
#include "tests/fuzz/fuzz_input.h"
#include "tests/fuzz/quiet_protobuf.h"
#include "tests/fuzz/rpc_catalog.h"

namespace kvpool::fuzz {
namespace {

namespace v1 = ::kvpool::v1;

// Most messages of one client-streaming call.
constexpr int kMaxStreamMessages = 8;

struct Outcome {
  bool ran = false;  // false when the input's bytes are not a request of the RPC
  grpc::Status status;
};

template <typename Message>
bool Parse(absl::string_view bytes, Message* m) {
  return m->ParseFromArray(bytes.data(), static_cast<int>(bytes.size()));
}

template <typename Req, typename Call>
Outcome Unary(absl::string_view bytes, Call call) {
  Req req;
  if (!Parse(bytes, &req)) return {};
  grpc::ClientContext ctx;
  FuzzDaemon::SetDeadline(&ctx);
  return {true, call(&ctx, req)};
}

template <typename Req, typename Resp, typename Open>
Outcome ServerStream(absl::string_view bytes, Open open) {
  Req req;
  if (!Parse(bytes, &req)) return {};
  grpc::ClientContext ctx;
  FuzzDaemon::SetDeadline(&ctx);
  auto reader = open(&ctx, req);
  Resp msg;
  while (reader->Read(&msg)) {
  }
  return {true, reader->Finish()};
}

template <typename Req, typename Resp, typename Open>
Outcome ClientStream(FuzzInput& in, Open open) {
  std::vector<Req> messages;
  absl::string_view piece;
  while (messages.size() < kMaxStreamMessages && in.Framed(&piece)) {
    if (!Parse(piece, &messages.emplace_back())) return {};
  }
  grpc::ClientContext ctx;
  FuzzDaemon::SetDeadline(&ctx);
  Resp resp;
  auto writer = open(&ctx, &resp);
  for (const Req& m : messages) {
    if (!writer->Write(m)) break;  // the daemon answered already
  }
  writer->WritesDone();
  return {true, writer->Finish()};
}

// Whether a successful call of `rpc` may have changed the daemon's state.
bool Mutates(Rpc rpc) {
  switch (rpc) {
    case Rpc::kRegisterModel:
    case Rpc::kDeleteModel:
    case Rpc::kCreateSequence:
    case Rpc::kAppendKv:
    case Rpc::kAppendDecode:
    case Rpc::kSealSequence:
    case Rpc::kReleaseSequence:
      return true;
    default:
      return false;
  }
}

class RpcFuzzer {
 public:
  explicit RpcFuzzer(FuzzDaemon* daemon) : daemon_(daemon), stubs_(daemon->channel()) {
    absl::StatusOr<v1::GetStatsResponse> base = daemon_->StateSnapshot();
    FUZZ_CHECK(base.ok(), base.status().ToString());
    base_ = *std::move(base);
  }

  void Run(FuzzInput& in) {
    const Rpc rpc = static_cast<Rpc>(in.Byte() % kRpcCount);
    const Outcome o = Call(rpc, in);
    if (verbose_) {
      std::fprintf(stderr, "rpc_fuzz: RPC %d %s: %d %s\n", static_cast<int>(rpc),
                   o.ran ? "answered" : "not run (unparseable request)", o.status.error_code(),
                   o.status.error_message().c_str());
    }
    if (!o.ran) return;
    const grpc::StatusCode code = o.status.error_code();
    FUZZ_CHECK(code != grpc::StatusCode::DEADLINE_EXCEEDED,
               "the daemon did not answer within the deadline: " + o.status.error_message());
    FUZZ_CHECK(code != grpc::StatusCode::UNKNOWN && code != grpc::StatusCode::INTERNAL &&
                   code != grpc::StatusCode::DATA_LOSS,
               absl::StrCat("RPC ", static_cast<int>(rpc), " answered code ", code, ": ",
                            o.status.error_message()));
    if (o.status.ok() && Mutates(rpc)) {
      const absl::Status reset = daemon_->Reset();
      FUZZ_CHECK(reset.ok(), reset.ToString());
      return;
    }
    // Nothing else may have changed what the daemon holds.
    absl::StatusOr<v1::GetStatsResponse> now = daemon_->StateSnapshot();
    FUZZ_CHECK(now.ok(), now.status().ToString());
    FUZZ_CHECK(google::protobuf::util::MessageDifferencer::Equals(*now, base_),
               absl::StrCat("RPC ", static_cast<int>(rpc), " (", o.status.error_code(), ": ",
                            o.status.error_message(), ") changed the daemon's state:\n",
                            now->DebugString(), "\nexpected:\n", base_.DebugString()));
  }

 private:
  Outcome Call(Rpc rpc, FuzzInput& in) {
    using grpc::ClientContext;
    const absl::string_view rest =
        rpc == Rpc::kRegisterModel || rpc == Rpc::kAppendKv || rpc == Rpc::kPushKv
            ? absl::string_view()
            : in.Rest();
    switch (rpc) {
      case Rpc::kRegisterModel:
        return ClientStream<v1::RegisterModelRequest, v1::RegisterModelResponse>(
            in, [&](ClientContext* c, v1::RegisterModelResponse* r) {
              return stubs_.models->RegisterModel(c, r);
            });
      case Rpc::kListModels:
        return Unary<v1::ListModelsRequest>(rest, [&](ClientContext* c, const auto& req) {
          v1::ListModelsResponse r;
          return stubs_.models->ListModels(c, req, &r);
        });
      case Rpc::kDescribeModel:
        return ServerStream<v1::DescribeModelRequest, v1::DescribeModelResponse>(
            rest, [&](ClientContext* c, const auto& req) {
              return stubs_.models->DescribeModel(c, req);
            });
      case Rpc::kDeleteModel:
        return Unary<v1::DeleteModelRequest>(rest, [&](ClientContext* c, const auto& req) {
          v1::DeleteModelResponse r;
          return stubs_.models->DeleteModel(c, req, &r);
        });
      case Rpc::kCreateSequence:
        return Unary<v1::CreateSequenceRequest>(rest, [&](ClientContext* c, const auto& req) {
          v1::CreateSequenceResponse r;
          return stubs_.sequences->CreateSequence(c, req, &r);
        });
      case Rpc::kAppendKv:
        return ClientStream<v1::AppendKvRequest, v1::AppendKvResponse>(
            in, [&](ClientContext* c, v1::AppendKvResponse* r) {
              return stubs_.sequences->AppendKv(c, r);
            });
      case Rpc::kAppendDecode:
        return Unary<v1::AppendDecodeRequest>(rest, [&](ClientContext* c, const auto& req) {
          v1::AppendDecodeResponse r;
          return stubs_.sequences->AppendDecode(c, req, &r);
        });
      case Rpc::kSealSequence:
        return Unary<v1::SealSequenceRequest>(rest, [&](ClientContext* c, const auto& req) {
          v1::SealSequenceResponse r;
          return stubs_.sequences->SealSequence(c, req, &r);
        });
      case Rpc::kReleaseSequence:
        return Unary<v1::ReleaseSequenceRequest>(rest, [&](ClientContext* c, const auto& req) {
          v1::ReleaseSequenceResponse r;
          return stubs_.sequences->ReleaseSequence(c, req, &r);
        });
      case Rpc::kDescribeSequence:
        return Unary<v1::DescribeSequenceRequest>(rest, [&](ClientContext* c, const auto& req) {
          v1::SequenceInfo r;
          return stubs_.sequences->DescribeSequence(c, req, &r);
        });
      case Rpc::kLookupPrefix:
        return Unary<v1::LookupPrefixRequest>(rest, [&](ClientContext* c, const auto& req) {
          v1::LookupPrefixResponse r;
          return stubs_.sequences->LookupPrefix(c, req, &r);
        });
      case Rpc::kReadBlocks:
        return ServerStream<v1::ReadBlocksRequest, v1::ReadBlocksResponse>(
            rest,
            [&](ClientContext* c, const auto& req) { return stubs_.reads->ReadBlocks(c, req); });
      case Rpc::kReadKv:
        return ServerStream<v1::ReadKvRequest, v1::ReadKvResponse>(
            rest, [&](ClientContext* c, const auto& req) { return stubs_.reads->ReadKv(c, req); });
      case Rpc::kAttend:
        return Unary<v1::AttendRequest>(rest, [&](ClientContext* c, const auto& req) {
          v1::AttendResponse r;
          return stubs_.attention->Attend(c, req, &r);
        });
      case Rpc::kGetStats:
        return Unary<v1::GetStatsRequest>(rest, [&](ClientContext* c, const auto& req) {
          v1::GetStatsResponse r;
          return stubs_.stats->GetStats(c, req, &r);
        });
      case Rpc::kNegotiate:
        return Unary<v1::NegotiateRequest>(rest, [&](ClientContext* c, const auto& req) {
          v1::NegotiateResponse r;
          return stubs_.transport->Negotiate(c, req, &r);
        });
      case Rpc::kCloseSession:
        return Unary<v1::CloseSessionRequest>(rest, [&](ClientContext* c, const auto& req) {
          v1::CloseSessionResponse r;
          return stubs_.transport->CloseSession(c, req, &r);
        });
      case Rpc::kSetAttentionPlan:
        return Unary<v1::SetAttentionPlanRequest>(rest, [&](ClientContext* c, const auto& req) {
          v1::SetAttentionPlanResponse r;
          return stubs_.transport->SetAttentionPlan(c, req, &r);
        });
      case Rpc::kDropAttentionPlan:
        return Unary<v1::DropAttentionPlanRequest>(rest, [&](ClientContext* c, const auto& req) {
          v1::DropAttentionPlanResponse r;
          return stubs_.transport->DropAttentionPlan(c, req, &r);
        });
      case Rpc::kPushKv:
        return ClientStream<v1::DevicePushRequest, v1::AppendKvResponse>(
            in, [&](ClientContext* c, v1::AppendKvResponse* r) {
              return stubs_.transport->PushKv(c, r);
            });
      case Rpc::kWatchSession:
        return ServerStream<v1::WatchSessionRequest, v1::WatchSessionResponse>(
            rest, [&](ClientContext* c, const auto& req) {
              return stubs_.transport->WatchSession(c, req);
            });
      case Rpc::kReloadTenants:
        return Unary<v1::ReloadTenantsRequest>(rest, [&](ClientContext* c, const auto& req) {
          v1::ReloadTenantsResponse r;
          return stubs_.admin->ReloadTenants(c, req, &r);
        });
      case Rpc::kFetchToDevice:
        return Unary<v1::FetchToDeviceRequest>(rest, [&](ClientContext* c, const auto& req) {
          v1::FetchToDeviceResponse r;
          return stubs_.transport->FetchToDevice(c, req, &r);
        });
      case Rpc::kRpcCount:
        break;
    }
    return {};
  }

  FuzzDaemon* const daemon_;
  ServiceStubs stubs_;
  v1::GetStatsResponse base_;  // the state every input starts from
  // KVPOOL_FUZZ_VERBOSE=1 prints each input's RPC and answer (for triage).
  const bool verbose_ = std::getenv("KVPOOL_FUZZ_VERBOSE") != nullptr;
};

}  // namespace
}  // namespace kvpool::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const bool quiet = (kvpool::fuzz::QuietProtobufLogs(), true);
  (void)quiet;
  static kvpool::fuzz::RpcFuzzer* fuzzer =
      new kvpool::fuzz::RpcFuzzer(&kvpool::fuzz::FuzzDaemon::Get());
  kvpool::fuzz::FuzzInput in(data, size);
  fuzzer->Run(in);
  return 0;
}
