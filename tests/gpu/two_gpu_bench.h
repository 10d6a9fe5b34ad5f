// What the two-GPU benchmarks (gpu_transport_bench, gpu_attention_bench) check before they run.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <string>

namespace kvpool::bench {

// NVLink multicast off in this process and in every child it starts (shared hosts).
inline void DisableNvlinkMulticastHere() {
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1", 1);
  setenv("NVSHMEM_DISABLE_NVLS", "1", 1);
}

// Whether this machine and the options allow the run: two GPUs and a kvpoold path. Prints why
// not.
inline bool TwoGpuBenchCanRun(const std::string& kvpoold) {
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus < 2) {
    std::fprintf(stderr, "needs two GPUs (found %d)\n", gpus);
    return false;
  }
  if (kvpoold.empty()) {
    std::fprintf(stderr, "--kvpoold is required\n");
    return false;
  }
  return true;
}

}  // namespace kvpool::bench
