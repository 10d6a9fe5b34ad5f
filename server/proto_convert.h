// Conversions between the kvpool.v1 protobuf messages and the server's own types: enums, quant
// configs, model and sequence descriptions, and tensor payloads (BF16/FP16/FP32 bytes).
//
//   KVPOOL_ASSIGN_OR_RETURN(std::vector<Bf16> rows, DecodeToBf16(v1::DTYPE_FP32, bytes, n));
//   FillModelInfo(*model, totals, &response->mutable_model());
//
// Pure functions; thread-safe.
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kernels/bf16.h"
#include "kernels/codec_config.h"
#include "kernels/rotation.h"
#include "kvpool/v1/common.pb.h"
#include "kvpool/v1/model_service.pb.h"
#include "kvpool/v1/sequence_service.pb.h"
#include "proto/dtype.h"
#include "server/model_registry.h"
#include "server/prefix_index.h"
#include "server/sequence_store.h"

namespace kvpool::server {

namespace v1 = ::kvpool::v1;

// Decodes `bytes` of `dtype` holding exactly `values` elements to BF16 (FP32 and FP16 round to
// nearest even). InvalidArgument for an unknown dtype or a size mismatch (naming `what`).
// OK when `bytes` holds exactly `values` values of `dtype` (BF16, FP16 or FP32); InvalidArgument
// naming `what` otherwise. Cheap: lets a caller refuse a payload before reserving anything.
[[nodiscard]] absl::Status CheckPayload(v1::DType dtype, absl::string_view bytes, size_t values,
                                        const char* what);
[[nodiscard]] absl::StatusOr<std::vector<Bf16>> DecodeToBf16(v1::DType dtype,
                                                             absl::string_view bytes, size_t values,
                                                             const char* what);
// Same to fp32, into `out` (which holds exactly the expected values; nothing is written on
// error).
[[nodiscard]] absl::Status DecodeToFloat(v1::DType dtype, absl::string_view bytes,
                                         absl::Span<float> out, const char* what);

// A request QuantConfig (absent fields = defaults) to the kernels' one. InvalidArgument for an
// unknown enum value. Validation against head_dim happens at registration.
[[nodiscard]] absl::StatusOr<QuantConfig> QuantFromProto(const v1::QuantConfig& q);
void QuantToProto(const QuantConfig& q, v1::QuantConfig* out);

[[nodiscard]] absl::StatusOr<RotationKind> RotationKindFromProto(v1::RotationKind k);
v1::RotationKind RotationKindToProto(RotationKind k);

void FillBlockLayout(const Model& m, v1::BlockLayoutDescriptor* out);
// `sequences` and `pool_bytes` come from the store's totals.
void FillModelInfo(const Model& m, uint64_t sequences, uint64_t pool_bytes, v1::ModelInfo* out);
void FillSequenceInfo(const SequenceInfo& s, v1::SequenceInfo* out);
void FillPrefixUnit(const PrefixUnitKey& k, v1::PrefixUnit* out);

}  // namespace kvpool::server
