// Instantiates the codec kernels for head dim 128.
#include "kernels/cuda/codec_kernels.cuh"

namespace kvpool::cuda::internal {

template int LaunchArrival<128>(const ArrivalParams& p, CUstream_st* stream);
template int LaunchArrivalJobs<128>(const ArrivalJobsParams& p, CUstream_st* stream);
template int LaunchDequant<128>(const DequantParams& p, CUstream_st* stream);

}  // namespace kvpool::cuda::internal
