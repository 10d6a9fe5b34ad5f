// A C ABI over kvpool's CPU codec (kernels/), for the Python fidelity evaluation (ctypes).
//
// It runs the production code path on rows of one (layer, tensor): BF16 arrival, rotation
// (RotationSet::RotateBf16), then either the BF16 tier (rotated BF16 kept as is) or the INT2/INT4
// history (RowCodec::Encode + Decode), and finally the un-rotation (RotationSet::Unrotate), so
// the caller gets back, in the model's original basis, exactly what attention over the stored
// tier computes with. Attention math itself stays with the caller.
//
//   char err[512];
//   void* c = kvpool_eval_codec_create("smollm2.rotation.safetensors", 0, 0, 2, "uniform",
//                                      "fp16", 0.96f, 0.92f, /*use_file_quant=*/0, err, 512);
//   kvpool_eval_codec_roundtrip(c, layer, /*tensor=K*/0, rows, in, tier, history, err, 512);
//   kvpool_eval_codec_destroy(c);
//
// A handle is immutable after creation; roundtrip may be called from several threads.
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// `rotation`: "identity", "hadamard" (both need num_layers and head_dim) or the path of a
// rotation file (then num_layers/head_dim may be 0). With use_file_quant != 0 the quant config
// is the file's; otherwise bits (2|4), quantizer (uniform|lloyd_max), scale_dtype (fp16|bf16)
// and the clip ratios (<= 0: no clip) apply, with G = D. Returns NULL and a message in `err`
// on failure.
void* kvpool_eval_codec_create(const char* rotation, int num_layers, int head_dim, int bits,
                               const char* quantizer, const char* scale_dtype, float clip_k,
                               float clip_v, int use_file_quant, char* err, int err_len);

// `rows` rows of head_dim floats of tensor (0 = K, 1 = V) of `layer`, original basis. Writes
// the BF16-tier view to `tier` and the quantized-history view to `history` (either may be
// NULL), both rows x head_dim in the original basis. Returns 0, or -1 with a message in `err`
// (nothing useful written).
int kvpool_eval_codec_roundtrip(const void* codec, int layer, int tensor, int64_t rows,
                                const float* in, float* tier, float* history, char* err,
                                int err_len);

// The codec's settings: writes clip ratios, bits, head_dim, layers, and the 64-hex-digit codec
// version (plus NUL) to `version` (65 bytes).
void kvpool_eval_codec_info(const void* codec, float* clip_k, float* clip_v, int* bits,
                            int* head_dim, int* num_layers, char* version);

void kvpool_eval_codec_destroy(void* codec);

#ifdef __cplusplus
}
#endif
