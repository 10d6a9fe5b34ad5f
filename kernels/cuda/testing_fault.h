// Test helper: poisons the process's CUDA context on a device the way a faulty kernel would, for
// the device-health test of kvpoold-fault-injection. Not for production code.
//
//   KVPOOL_RETURN_IF_ERROR(PoisonCudaContext(/*device=*/0));   // every later CUDA call fails
#pragma once

#include "absl/status/status.h"

namespace kvpool::cuda::testing {

// Launches, on a stream of its own on `device`, a kernel that stores to an address outside every
// allocation, and waits for it. OK when that left the context with a sticky error (an illegal
// address: from then on every CUDA call of the process on that device fails); Internal when it
// did not (the store went through, or another error), naming what happened.
[[nodiscard]] absl::Status PoisonCudaContext(int device);

}  // namespace kvpool::cuda::testing
