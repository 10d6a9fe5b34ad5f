// Instantiates the decode attention for head dim 128 (GQA groups of up to 8 and up to 16 queries).
#include "kernels/cuda/decode_attention.cuh"

namespace kvpool::cuda::internal {

template int LaunchDecodeAttention<128, 1>(const AttentionParams& p, CUstream_st* stream);
template int LaunchDecodeAttention<128, 2>(const AttentionParams& p, CUstream_st* stream);
template int AttentionCtasPerSm<128, 1>(AttentionKernelKind kind);
template int AttentionCtasPerSm<128, 2>(AttentionKernelKind kind);

}  // namespace kvpool::cuda::internal
