#include "client/kv_files.h"

#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/bf16.h"
#include "kernels/safetensors.h"

namespace kvpool::client {
namespace {

// A tensor's element type and bytes, whichever container it came from.
struct RawTensor {
  std::string name;
  v1::DType wire = v1::DTYPE_UNSPECIFIED;
  bool f64 = false;  // F64 data to narrow to FP32
  std::vector<int64_t> shape;
  absl::string_view bytes;
};

absl::StatusOr<RawTensor> FromSafetensor(const SafetensorsTensor& t) {
  RawTensor r;
  r.name = t.name;
  r.shape = t.shape;
  r.bytes = t.bytes;
  switch (t.dtype) {
    case SafetensorsDtype::kBF16:
      r.wire = v1::DTYPE_BF16;
      break;
    case SafetensorsDtype::kF16:
      r.wire = v1::DTYPE_FP16;
      break;
    case SafetensorsDtype::kF32:
      r.wire = v1::DTYPE_FP32;
      break;
    case SafetensorsDtype::kF64:
      r.wire = v1::DTYPE_FP32;
      r.f64 = true;
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat("tensor '", t.name, "' has dtype ",
                                                     SafetensorsDtypeName(t.dtype),
                                                     "; K/V must be BF16, F16, F32 or F64"));
  }
  return r;
}

absl::StatusOr<RawTensor> FromNpy(const NpyArray& a, const std::string& name) {
  RawTensor r;
  r.name = name;
  r.shape = a.shape;
  r.bytes = a.data;
  switch (a.dtype) {
    case NpyDtype::kBF16:
      r.wire = v1::DTYPE_BF16;
      break;
    case NpyDtype::kF16:
      r.wire = v1::DTYPE_FP16;
      break;
    case NpyDtype::kF32:
      r.wire = v1::DTYPE_FP32;
      break;
    case NpyDtype::kF64:
      r.wire = v1::DTYPE_FP32;
      r.f64 = true;
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat(name, " has dtype ", NpyDescr(a.dtype),
                                                     "; K/V must be bfloat16, f2, f4 or f8"));
  }
  return r;
}

std::string ToWireBytes(const RawTensor& t, absl::string_view slice) {
  if (!t.f64) return std::string(slice);
  const size_t n = slice.size() / sizeof(double);
  std::string out(n * sizeof(float), '\0');
  for (size_t i = 0; i < n; ++i) {
    double d;
    std::memcpy(&d, slice.data() + i * sizeof(double), sizeof(double));
    const float f = static_cast<float>(d);
    std::memcpy(out.data() + i * sizeof(float), &f, sizeof(float));
  }
  return out;
}

size_t ElemBytes(const RawTensor& t) { return t.f64 ? 8 : (t.wire == v1::DTYPE_FP32 ? 4 : 2); }

// Adds the layers of a [L, T, H, D] or [T, H, D] tensor pair to `kv`.
absl::Status AddStacked(const RawTensor& k, const RawTensor& v, KvHistory* kv) {
  if (k.shape != v.shape) {
    return absl::InvalidArgumentError(absl::StrCat("k shape [", absl::StrJoin(k.shape, ", "),
                                                   "] differs from v shape [",
                                                   absl::StrJoin(v.shape, ", "), "]"));
  }
  if (k.wire != v.wire || k.f64 != v.f64) {
    return absl::InvalidArgumentError("k and v must have the same dtype");
  }
  std::vector<int64_t> shape = k.shape;
  if (shape.size() == 3) shape.insert(shape.begin(), 1);
  if (shape.size() != 4 || shape[0] < 1 || shape[1] < 1 || shape[2] < 1 || shape[3] < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        k.name,
        ": expected a shape [layers, tokens, kv_heads, head_dim] or [tokens, kv_heads, "
        "head_dim] with positive sizes, got [",
        absl::StrJoin(k.shape, ", "), "]"));
  }
  if (shape[1] > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError("too many tokens");
  }
  kv->dtype = k.wire;
  kv->num_layers = static_cast<int>(shape[0]);
  kv->num_tokens = static_cast<int>(shape[1]);
  kv->kv_heads = static_cast<int>(shape[2]);
  kv->head_dim = static_cast<int>(shape[3]);
  const size_t layer_bytes = static_cast<size_t>(shape[1] * shape[2] * shape[3]) * ElemBytes(k);
  for (int l = 0; l < kv->num_layers; ++l) {
    kv->k.push_back(ToWireBytes(k, k.bytes.substr(l * layer_bytes, layer_bytes)));
    kv->v.push_back(ToWireBytes(v, v.bytes.substr(l * layer_bytes, layer_bytes)));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<uint32_t>> TokenIdsFromRaw(absl::string_view name, size_t elem,
                                                      bool is_signed, int64_t count,
                                                      absl::string_view bytes) {
  std::vector<uint32_t> ids(count);
  for (int64_t i = 0; i < count; ++i) {
    int64_t value = 0;
    if (elem == 8) {
      std::memcpy(&value, bytes.data() + i * 8, 8);
    } else if (elem == 4) {
      if (is_signed) {
        int32_t x;
        std::memcpy(&x, bytes.data() + i * 4, 4);
        value = x;
      } else {
        uint32_t x;
        std::memcpy(&x, bytes.data() + i * 4, 4);
        value = x;
      }
    } else if (is_signed) {
      int16_t x;
      std::memcpy(&x, bytes.data() + i * 2, 2);
      value = x;
    } else {
      uint16_t x;
      std::memcpy(&x, bytes.data() + i * 2, 2);
      value = x;
    }
    if (value < 0 || value > std::numeric_limits<uint32_t>::max()) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, "[", i, "] = ", value, " is not a valid token id"));
    }
    ids[i] = static_cast<uint32_t>(value);
  }
  return ids;
}

}  // namespace

absl::StatusOr<KvHistory> LoadKvSafetensors(const std::string& path) {
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::ReadFile(path);
  if (!file.ok()) return file.status();
  KvHistory kv;
  const SafetensorsTensor* k = file->Find("k");
  const SafetensorsTensor* v = file->Find("v");
  if (k != nullptr || v != nullptr) {
    if (k == nullptr || v == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": has only one of 'k' and 'v'"));
    }
    absl::StatusOr<RawTensor> rk = FromSafetensor(*k);
    if (!rk.ok()) return rk.status();
    absl::StatusOr<RawTensor> rv = FromSafetensor(*v);
    if (!rv.ok()) return rv.status();
    if (absl::Status s = AddStacked(*rk, *rv, &kv); !s.ok()) return s;
  } else {
    // Per-layer tensors layers.<i>.k / layers.<i>.v, i = 0, 1, ...
    for (int l = 0;; ++l) {
      const SafetensorsTensor* lk = file->Find(absl::StrCat("layers.", l, ".k"));
      const SafetensorsTensor* lv = file->Find(absl::StrCat("layers.", l, ".v"));
      if (lk == nullptr && lv == nullptr) break;
      if (lk == nullptr || lv == nullptr) {
        return absl::InvalidArgumentError(
            absl::StrCat(path, ": layer ", l, " has only one of k and v"));
      }
      absl::StatusOr<RawTensor> rk = FromSafetensor(*lk);
      if (!rk.ok()) return rk.status();
      absl::StatusOr<RawTensor> rv = FromSafetensor(*lv);
      if (!rv.ok()) return rv.status();
      if (rk->shape.size() != 3) {
        return absl::InvalidArgumentError(
            absl::StrCat(lk->name, ": expected [tokens, kv_heads, head_dim]"));
      }
      KvHistory layer;
      if (absl::Status s = AddStacked(*rk, *rv, &layer); !s.ok()) return s;
      if (l > 0 && (layer.dtype != kv.dtype || layer.num_tokens != kv.num_tokens ||
                    layer.kv_heads != kv.kv_heads || layer.head_dim != kv.head_dim)) {
        return absl::InvalidArgumentError(
            absl::StrCat(path, ": layer ", l, " differs in shape or dtype from layer 0"));
      }
      kv.dtype = layer.dtype;
      kv.num_tokens = layer.num_tokens;
      kv.kv_heads = layer.kv_heads;
      kv.head_dim = layer.head_dim;
      kv.num_layers = l + 1;
      kv.k.push_back(std::move(layer.k[0]));
      kv.v.push_back(std::move(layer.v[0]));
    }
    if (kv.num_layers == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": no 'k'/'v' tensors and no 'layers.<i>.k'/'layers.<i>.v'"));
    }
  }
  if (const SafetensorsTensor* ids = file->Find("token_ids"); ids != nullptr) {
    bool is_signed = true;
    size_t elem = 0;
    switch (ids->dtype) {
      case SafetensorsDtype::kI64:
        elem = 8;
        break;
      case SafetensorsDtype::kI32:
        elem = 4;
        break;
      case SafetensorsDtype::kI16:
        elem = 2;
        break;
      default:
        return absl::InvalidArgumentError("token_ids must be I64, I32 or I16");
    }
    if (ids->shape.size() != 1 || ids->shape[0] != kv.num_tokens) {
      return absl::InvalidArgumentError(
          absl::StrCat("token_ids must have shape [", kv.num_tokens, "]"));
    }
    absl::StatusOr<std::vector<uint32_t>> parsed =
        TokenIdsFromRaw("token_ids", elem, is_signed, ids->shape[0], ids->bytes);
    if (!parsed.ok()) return parsed.status();
    kv.token_ids = *std::move(parsed);
  }
  return kv;
}

absl::StatusOr<KvHistory> LoadKvNpy(const std::string& k_path, const std::string& v_path) {
  absl::StatusOr<NpyArray> k = ReadNpyFile(k_path);
  if (!k.ok()) return k.status();
  absl::StatusOr<NpyArray> v = ReadNpyFile(v_path);
  if (!v.ok()) return v.status();
  absl::StatusOr<RawTensor> rk = FromNpy(*k, k_path);
  if (!rk.ok()) return rk.status();
  absl::StatusOr<RawTensor> rv = FromNpy(*v, v_path);
  if (!rv.ok()) return rv.status();
  KvHistory kv;
  if (absl::Status s = AddStacked(*rk, *rv, &kv); !s.ok()) return s;
  return kv;
}

absl::StatusOr<std::vector<uint32_t>> TokenIdsFromNpy(const NpyArray& a) {
  if (a.shape.size() != 1) return absl::InvalidArgumentError("token ids must be one-dimensional");
  switch (a.dtype) {
    case NpyDtype::kI64:
      return TokenIdsFromRaw("token_ids", 8, true, a.shape[0], a.data);
    case NpyDtype::kI32:
      return TokenIdsFromRaw("token_ids", 4, true, a.shape[0], a.data);
    case NpyDtype::kU32:
      return TokenIdsFromRaw("token_ids", 4, false, a.shape[0], a.data);
    case NpyDtype::kU16:
      return TokenIdsFromRaw("token_ids", 2, false, a.shape[0], a.data);
    case NpyDtype::kI16:
      return TokenIdsFromRaw("token_ids", 2, true, a.shape[0], a.data);
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("token ids must be i8, i4, u4, i2 or u2, not ", NpyDescr(a.dtype)));
  }
}

absl::StatusOr<std::vector<float>> NpyToFloat(const NpyArray& a) {
  const int64_t n = a.num_elements();
  std::vector<float> out(n);
  for (int64_t i = 0; i < n; ++i) {
    switch (a.dtype) {
      case NpyDtype::kF32:
        std::memcpy(&out[i], a.data.data() + i * 4, 4);
        break;
      case NpyDtype::kF64: {
        double d;
        std::memcpy(&d, a.data.data() + i * 8, 8);
        out[i] = static_cast<float>(d);
        break;
      }
      case NpyDtype::kF16: {
        uint16_t w;
        std::memcpy(&w, a.data.data() + i * 2, 2);
        out[i] = Fp16::FromBits(w).ToFloat();
        break;
      }
      case NpyDtype::kBF16: {
        uint16_t w;
        std::memcpy(&w, a.data.data() + i * 2, 2);
        out[i] = Bf16::FromBits(w).ToFloat();
        break;
      }
      default:
        return absl::InvalidArgumentError(
            absl::StrCat("expected a floating-point array, got ", NpyDescr(a.dtype)));
    }
  }
  return out;
}

absl::Status WriteKvReadSafetensors(const KvRead& read, const std::string& path) {
  const v1::ReadKvHeader& h = read.header;
  const bool fp32 = h.dtype() == v1::DTYPE_FP32;
  std::string k, v;
  for (const LayerRows& l : read.layers) {
    k += l.k;
    v += l.v;
  }
  const std::vector<int64_t> shape = {static_cast<int64_t>(read.layers.size()), h.num_tokens(),
                                      h.shape().kv_heads(), h.shape().head_dim()};
  SafetensorsWriter w;
  w.SetMetadata("model_id", h.model_id());
  w.SetMetadata("sequence_id", h.sequence_id());
  w.SetMetadata("codec_version", h.codec_version());
  w.SetMetadata("token_start", absl::StrCat(h.token_start()));
  w.SetMetadata("layers", absl::StrJoin(h.layers(), ","));
  const SafetensorsDtype dtype = fp32 ? SafetensorsDtype::kF32 : SafetensorsDtype::kBF16;
  w.AddTensor("k", dtype, shape, k);
  w.AddTensor("v", dtype, shape, v);
  return w.WriteFile(path);
}

absl::Status WriteBlocksReadSafetensors(const BlocksRead& read, const std::string& path) {
  const v1::ReadBlocksHeader& h = read.header;
  const v1::BlockLayoutDescriptor& b = h.block_layout();
  SafetensorsWriter w;
  w.SetMetadata("model_id", h.model_id());
  w.SetMetadata("sequence_id", h.sequence_id());
  w.SetMetadata("codec_version", h.codec_version());
  w.SetMetadata("format_version", absl::StrCat(b.format_version()));
  w.SetMetadata("block_tokens", absl::StrCat(b.tokens()));
  w.SetMetadata("kv_heads", absl::StrCat(b.kv_heads()));
  w.SetMetadata("head_dim", absl::StrCat(b.head_dim()));
  w.SetMetadata("group_size", absl::StrCat(b.group_size()));
  w.SetMetadata("bits", absl::StrCat(b.bits()));
  w.SetMetadata("scale_dtype", b.scale_dtype() == v1::SCALE_DTYPE_BF16 ? "bf16" : "fp16");
  w.SetMetadata("block_bytes", absl::StrCat(b.block_bytes()));
  w.SetMetadata("sink_tokens", absl::StrCat(h.sink_tokens()));
  w.SetMetadata("history_tokens", absl::StrCat(h.history_tokens()));
  w.SetMetadata("recent_tokens", absl::StrCat(h.recent_tokens()));
  for (const LayerBlocks& l : read.layers) {
    std::string blocks;
    for (const v1::KvBlock& block : l.blocks) blocks += block.data();
    const std::string p = absl::StrCat("layers.", l.layer, ".");
    w.AddTensor(p + "blocks", SafetensorsDtype::kU8,
                {static_cast<int64_t>(l.blocks.size()), static_cast<int64_t>(b.block_bytes())},
                blocks);
    const std::vector<int64_t> sink = {h.sink_tokens(), b.kv_heads(), b.head_dim()};
    const std::vector<int64_t> recent = {h.recent_tokens(), b.kv_heads(), b.head_dim()};
    w.AddTensor(p + "sink_k", SafetensorsDtype::kBF16, sink, l.sink_k);
    w.AddTensor(p + "sink_v", SafetensorsDtype::kBF16, sink, l.sink_v);
    w.AddTensor(p + "recent_k", SafetensorsDtype::kBF16, recent, l.recent_k);
    w.AddTensor(p + "recent_v", SafetensorsDtype::kBF16, recent, l.recent_v);
  }
  return w.WriteFile(path);
}

}  // namespace kvpool::client
