// Instantiates the codec kernels for any supported head dim (run-time D).
#include "kernels/cuda/codec_kernels.cuh"

namespace kvpool::cuda::internal {

template int LaunchArrival<0>(const ArrivalParams& p, CUstream_st* stream);
template int LaunchArrivalJobs<0>(const ArrivalJobsParams& p, CUstream_st* stream);
template int LaunchDequant<0>(const DequantParams& p, CUstream_st* stream);

}  // namespace kvpool::cuda::internal
