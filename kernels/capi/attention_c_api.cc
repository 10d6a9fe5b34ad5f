// The C API (kvpool_attention.h): reads the caller's structs by their struct_size, checks every
// value, turns them into kvpool's own description (QuantConfig, PagedKvBatch) and runs the host
// path (kernels/paged_attention) or the device path (device_attention.h). absl::Status becomes
// the int code and the thread's last-error text; no exception leaves the library.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <new>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/block_layout.h"
#include "kernels/capi/device_attention.h"
#include "kernels/capi/kvpool_attention.h"
#include "kernels/codec_config.h"
#include "kernels/paged_attention.h"
#include "kernels/paged_kv.h"
#include "kernels/row_codec.h"

namespace kvpool::capi {
namespace {

thread_local std::string last_error;

// The caller's struct as this library knows it: the bytes its struct_size covers over a
// default-initialized one. Smaller than the first version's struct is an error.
template <typename T>
absl::StatusOr<T> ReadVersioned(const T* in, void (*init)(T*), const char* name) {
  if (in == nullptr) return absl::InvalidArgumentError(absl::StrCat(name, " is NULL"));
  T out;
  init(&out);
  if (in->struct_size < sizeof(T)) {
    return absl::InvalidArgumentError(absl::StrCat(name, ".struct_size is ", in->struct_size,
                                                   ", expected at least ", sizeof(T),
                                                   " (call the _init function)"));
  }
  std::memcpy(&out, in, sizeof(T));
  return out;
}

absl::StatusOr<QuantConfig> QuantConfigOf(const kvpool_attention_desc& d) {
  QuantConfig cfg;
  cfg.bits = d.bits;
  cfg.group_size = d.group_size;
  switch (d.quant_method) {
    case KVPOOL_ATTENTION_QUANT_UNIFORM:
      cfg.method = QuantMethod::kUniform;
      break;
    case KVPOOL_ATTENTION_QUANT_LLOYD_MAX:
      cfg.method = QuantMethod::kLloydMax;
      break;
    case KVPOOL_ATTENTION_QUANT_BYPASS:
      cfg.method = QuantMethod::kBypass;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("quant_method ", d.quant_method, " is not 0, 1 or 2"));
  }
  switch (d.scale_dtype) {
    case KVPOOL_ATTENTION_SCALE_FP16:
      cfg.scale_dtype = ScaleDtype::kFp16;
      break;
    case KVPOOL_ATTENTION_SCALE_BF16:
      cfg.scale_dtype = ScaleDtype::kBf16;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("scale_dtype ", d.scale_dtype, " is not 0 or 1"));
  }
  cfg.block_tokens = d.block_tokens;
  // Decode reads no tier sizes; a demotion batch of one block keeps Validate's rule satisfied.
  cfg.demotion_batch = d.block_tokens;
  if (!IsSupportedHeadDim(d.head_dim)) {
    return absl::InvalidArgumentError(
        absl::StrCat("head_dim ", d.head_dim, " is not a power of two in [32, 256]"));
  }
  KVPOOL_RETURN_IF_ERROR(cfg.Validate(d.head_dim));
  return cfg;
}

absl::Status CheckTierArrays(const kvpool_attention_tier& t, const char* name, int32_t bound) {
  if (t.first_token == nullptr || t.num_tokens == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ".first_token and ", name, ".num_tokens must not be NULL"));
  }
  if (t.block_table_stride < 0) {
    return absl::InvalidArgumentError(absl::StrCat(name, ".block_table_stride is negative"));
  }
  if (bound > 0 && (t.block_tables == nullptr || t.block_table_stride < 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ".block_tables must be non-NULL with a stride >= 1 when the batch has tokens"));
  }
  return absl::OkStatus();
}

absl::Status CheckPool(const kvpool_attention_pool& p, const char* name, int32_t bound) {
  if (p.num_blocks < 0 || p.block_stride < 0 || p.block_stride % 16 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ": num_blocks must be >= 0 and block_stride 0 or a positive multiple of 16"));
  }
  if (bound > 0 && (p.base == nullptr || p.num_blocks < 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " must hold blocks (non-NULL base, num_blocks >= 1)"));
  }
  if (p.base != nullptr && reinterpret_cast<uintptr_t>(p.base) % 16 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(name, ".base must be 16-byte aligned"));
  }
  return absl::OkStatus();
}

PagedKvTier TierOf(const kvpool_attention_tier& t) {
  return PagedKvTier{t.block_tables, t.block_table_stride, t.first_token, t.num_tokens};
}

// Everything a call needs, checked and in kvpool's types.
struct Call {
  QuantConfig cfg;
  AttentionShape shape;
  PagedKvBatch batch;
  int device = KVPOOL_ATTENTION_HOST;
};

absl::StatusOr<Call> CallOf(const kvpool_attention_desc* in) {
  KVPOOL_ASSIGN_OR_RETURN(const kvpool_attention_desc d,
                          ReadVersioned(in, &kvpool_attention_desc_init, "desc"));
  if (d.kv_heads < 1 || d.q_heads < 1 || d.q_heads % d.kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "q_heads ", d.q_heads, " must be a positive multiple of kv_heads ", d.kv_heads));
  }
  if (d.device < KVPOOL_ATTENTION_HOST) {
    return absl::InvalidArgumentError(absl::StrCat("device ", d.device, " is not -1 or >= 0"));
  }
  Call call;
  KVPOOL_ASSIGN_OR_RETURN(call.cfg, QuantConfigOf(d));
  call.shape = AttentionShape{d.q_heads, d.kv_heads, d.head_dim};
  call.device = d.device;
  if (d.num_seqs < 1 || d.max_history_tokens < 0 || d.max_bf16_tokens < 0) {
    return absl::InvalidArgumentError(absl::StrCat("need num_seqs >= 1 and token bounds >= 0, got ",
                                                   d.num_seqs, ", ", d.max_history_tokens, ", ",
                                                   d.max_bf16_tokens));
  }
  KVPOOL_RETURN_IF_ERROR(CheckPool(d.history_pool, "history_pool", d.max_history_tokens));
  KVPOOL_RETURN_IF_ERROR(CheckPool(d.bf16_pool, "bf16_pool", d.max_bf16_tokens));
  KVPOOL_RETURN_IF_ERROR(CheckTierArrays(d.sink, "sink", d.max_bf16_tokens));
  KVPOOL_RETURN_IF_ERROR(CheckTierArrays(d.history, "history", d.max_history_tokens));
  KVPOOL_RETURN_IF_ERROR(CheckTierArrays(d.recent, "recent", d.max_bf16_tokens));

  QuantConfig bypass = call.cfg;
  bypass.method = QuantMethod::kBypass;
  PagedKvBatch& b = call.batch;
  // The pools are read only; PagedKvView keeps a mutable pointer for the writers of blocks.
  b.history_pool =
      PagedKvView{static_cast<uint8_t*>(const_cast<void*>(d.history_pool.base)),
                  BlockLayout::ForModel(call.cfg, d.kv_heads, d.head_dim), call.cfg.scale_dtype,
                  d.history_pool.num_blocks, d.history_pool.block_stride};
  b.bf16_pool = PagedKvView{static_cast<uint8_t*>(const_cast<void*>(d.bf16_pool.base)),
                            BlockLayout::ForModel(bypass, d.kv_heads, d.head_dim),
                            call.cfg.scale_dtype, d.bf16_pool.num_blocks, d.bf16_pool.block_stride};
  b.num_seqs = d.num_seqs;
  b.max_history_tokens = d.max_history_tokens;
  b.max_bf16_tokens = d.max_bf16_tokens;
  b.sink = TierOf(d.sink);
  b.history = TierOf(d.history);
  b.recent = TierOf(d.recent);
  return call;
}

absl::StatusOr<size_t> WorkspaceBytes(const kvpool_attention_desc* desc) {
  KVPOOL_ASSIGN_OR_RETURN(const Call call, CallOf(desc));
  if (call.device == KVPOOL_ATTENTION_HOST) return size_t{0};
  return DeviceWorkspaceBytes(call.device, call.cfg, call.shape.q_heads, call.batch);
}

absl::Status Decode(const kvpool_attention_desc* desc, const kvpool_attention_io* io_in) {
  KVPOOL_ASSIGN_OR_RETURN(const Call call, CallOf(desc));
  KVPOOL_ASSIGN_OR_RETURN(const kvpool_attention_io io,
                          ReadVersioned(io_in, &kvpool_attention_io_init, "io"));
  if (io.queries == nullptr || io.out == nullptr || io.lse == nullptr) {
    return absl::InvalidArgumentError("io.queries, io.out and io.lse must not be NULL");
  }
  if (call.device == KVPOOL_ATTENTION_HOST) {
    KVPOOL_ASSIGN_OR_RETURN(const RowCodec codec, RowCodec::Create(call.cfg, call.shape.head_dim));
    PagedAttentionRotation rotation;
    rotation.k = io.rotation_k;
    rotation.v = io.rotation_v;
    return PagedDecodeAttention(PagedAttentionModel{call.shape, &codec}, call.batch, rotation,
                                PagedAttentionIo{io.queries, io.out, io.lse});
  }
  DeviceIo dio;
  dio.queries = io.queries;
  dio.rotation_k = io.rotation_k;
  dio.rotation_v = io.rotation_v;
  dio.out = io.out;
  dio.lse = io.lse;
  dio.workspace = io.workspace;
  dio.workspace_bytes = static_cast<size_t>(io.workspace_bytes);
  return DeviceDecodeAttention(call.device, call.cfg, call.shape.q_heads, call.batch, dio,
                               io.stream);
}

// The C code of `s`, with its message kept as the thread's last error.
int32_t Report(const absl::Status& s) {
  last_error = s.ok() ? std::string() : std::string(s.message());
  return static_cast<int32_t>(s.code());
}

// Runs `f` so that no exception crosses the C boundary.
template <typename F>
int32_t Guarded(F&& f) {
  try {
    return Report(f());
  } catch (const std::bad_alloc&) {
    return Report(absl::ResourceExhaustedError("out of host memory"));
  } catch (const std::exception& e) {
    return Report(absl::InternalError(e.what()));
  } catch (...) {
    return Report(absl::InternalError("unknown exception"));
  }
}

}  // namespace
}  // namespace kvpool::capi

extern "C" {

void kvpool_attention_desc_init(kvpool_attention_desc* desc) {
  if (desc == nullptr) return;
  std::memset(desc, 0, sizeof(*desc));
  desc->struct_size = sizeof(*desc);
  desc->bits = 2;
  desc->group_size = 0;
  desc->quant_method = KVPOOL_ATTENTION_QUANT_UNIFORM;
  desc->scale_dtype = KVPOOL_ATTENTION_SCALE_FP16;
  desc->block_tokens = 16;
  desc->device = KVPOOL_ATTENTION_HOST;
}

void kvpool_attention_io_init(kvpool_attention_io* io) {
  if (io == nullptr) return;
  std::memset(io, 0, sizeof(*io));
  io->struct_size = sizeof(*io);
}

int32_t kvpool_attention_version(void) { return KVPOOL_ATTENTION_VERSION; }

int32_t kvpool_attention_has_cuda(void) { return kvpool::capi::DevicePathBuilt() ? 1 : 0; }

int32_t kvpool_attention_workspace_bytes(const kvpool_attention_desc* desc, uint64_t* bytes) {
  using kvpool::capi::Guarded;
  return Guarded([&]() -> absl::Status {
    if (bytes == nullptr) return absl::InvalidArgumentError("bytes is NULL");
    KVPOOL_ASSIGN_OR_RETURN(const size_t n, kvpool::capi::WorkspaceBytes(desc));
    *bytes = n;
    return absl::OkStatus();
  });
}

int32_t kvpool_attention_decode(const kvpool_attention_desc* desc, const kvpool_attention_io* io) {
  return kvpool::capi::Guarded([&] { return kvpool::capi::Decode(desc, io); });
}

const char* kvpool_attention_last_error(void) { return kvpool::capi::last_error.c_str(); }

}  // extern "C"
