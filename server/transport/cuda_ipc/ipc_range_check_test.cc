// A CUDA IPC buffer's rows must lie inside its allocation, 16-byte aligned.
#include "server/transport/cuda_ipc/ipc_range_check.h"

#include <cstdint>

#include "gtest/gtest.h"

namespace kvpool::server {
namespace {

TEST(IpcRangeCheckTest, RowsMustLieInsideTheAllocation) {
  EXPECT_TRUE(CheckIpcRange(0, 4096, 4096, "k").ok());
  EXPECT_TRUE(CheckIpcRange(1024, 3072, 4096, "k").ok());
  EXPECT_TRUE(absl::IsInvalidArgument(CheckIpcRange(8, 16, 4096, "k")));       // misaligned
  EXPECT_TRUE(absl::IsInvalidArgument(CheckIpcRange(1024, 3088, 4096, "v")));  // past the end
  EXPECT_TRUE(absl::IsInvalidArgument(CheckIpcRange(8192, 0, 4096, "v")));     // beyond it
  EXPECT_TRUE(absl::IsInvalidArgument(CheckIpcRange(UINT64_MAX - 15, 32, 4096, "k")));
  EXPECT_TRUE(absl::IsInvalidArgument(CheckIpcRange(16, SIZE_MAX, 4096, "k")));  // no wrap
}

}  // namespace
}  // namespace kvpool::server
