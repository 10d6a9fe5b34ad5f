// Instantiates the codec kernels for head dim 64.
#include "kernels/cuda/codec_kernels.cuh"

namespace kvpool::cuda::internal {

template int LaunchArrival<64>(const ArrivalParams& p, CUstream_st* stream);
template int LaunchArrivalJobs<64>(const ArrivalJobsParams& p, CUstream_st* stream);
template int LaunchDequant<64>(const DequantParams& p, CUstream_st* stream);

}  // namespace kvpool::cuda::internal
