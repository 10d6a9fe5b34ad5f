#include "kernels/codec_version.h"

#include <openssl/evp.h>

#include <cstring>
#include <memory>
#include <vector>

#include "kernels/block_layout.h"
#include "kernels/rotation_file.h"

namespace kvpool {
namespace {

// Incremental SHA-256 over little-endian fields. EVP calls on a valid context with SHA-256 do
// not fail in practice; if they ever did, the digest stays all zeros, which can never match a
// real version, so a block is never read under the wrong codec.
class Sha256Stream {
 public:
  Sha256Stream() : ctx_(EVP_MD_CTX_new(), &EVP_MD_CTX_free) {
    ok_ = ctx_ != nullptr && EVP_DigestInit_ex(ctx_.get(), EVP_sha256(), nullptr) == 1;
  }

  void Bytes(const void* data, size_t size) {
    if (ok_ && size > 0) ok_ = EVP_DigestUpdate(ctx_.get(), data, size) == 1;
  }
  void U32(uint32_t v) {
    const uint8_t b[4] = {static_cast<uint8_t>(v), static_cast<uint8_t>(v >> 8),
                          static_cast<uint8_t>(v >> 16), static_cast<uint8_t>(v >> 24)};
    Bytes(b, sizeof(b));
  }
  void U64(uint64_t v) {
    U32(static_cast<uint32_t>(v));
    U32(static_cast<uint32_t>(v >> 32));
  }
  void F32(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof(u));
    U32(u);
  }
  // Row-major float32 values, little-endian. x86 and every GPU host we target are
  // little-endian, so the in-memory bytes are the canonical ones.
  void F32Array(const std::vector<float>& v) {
    static_assert(sizeof(float) == 4, "float32 expected");
    Bytes(v.data(), v.size() * sizeof(float));
  }

  CodecVersion Finish() {
    CodecVersion out{};
    unsigned int len = 0;
    if (ok_ && EVP_DigestFinal_ex(ctx_.get(), out.data(), &len) == 1 && len == out.size()) {
      return out;
    }
    return CodecVersion{};
  }

 private:
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> ctx_;
  bool ok_ = false;
};

}  // namespace

CodecVersion ComputeCodecVersion(const ModelCodec& model) {
  const RotationSet& r = model.rotations;
  const QuantConfig& q = model.quant;
  Sha256Stream h;
  static constexpr char kTag[] = "kvpool-codec";  // hashed with its terminating NUL
  h.Bytes(kTag, sizeof(kTag));
  h.U32(static_cast<uint32_t>(kBlockFormatVersion));
  h.U32(static_cast<uint32_t>(r.num_layers()));
  h.U32(static_cast<uint32_t>(r.head_dim()));
  h.U32(static_cast<uint32_t>(r.kind()));
  h.U64(r.kind() == RotationKind::kRandomizedHadamard ? r.seed() : 0);
  h.U32(static_cast<uint32_t>(q.bits));
  h.U32(static_cast<uint32_t>(q.EffectiveGroupSize(r.head_dim())));
  h.U32(static_cast<uint32_t>(q.method));
  h.U32(static_cast<uint32_t>(q.scale_dtype));
  h.F32(q.clip_ratio_k);
  h.F32(q.clip_ratio_v);
  h.U32(static_cast<uint32_t>(q.block_tokens));
  h.U32(model.v_prerotated ? 1u : 0u);
  if (r.kind() == RotationKind::kDense) {
    for (int layer = 0; layer < r.num_layers(); ++layer) {
      h.F32Array(r.Matrix(layer, KvTensor::kKey));
      h.F32Array(r.Matrix(layer, KvTensor::kValue));
    }
  }
  return h.Finish();
}

std::string CodecVersionHex(const ModelCodec& model) { return ToHex(ComputeCodecVersion(model)); }

std::string ToHex(const CodecVersion& v) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  out.reserve(2 * v.size());
  for (uint8_t b : v) {
    out.push_back(kDigits[b >> 4]);
    out.push_back(kDigits[b & 0xf]);
  }
  return out;
}

CodecVersion Sha256(const void* data, size_t size) {
  Sha256Stream h;
  h.Bytes(data, size);
  return h.Finish();
}

}  // namespace kvpool
