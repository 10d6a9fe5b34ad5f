// Sizes of the element types the API carries (kvpool.v1.DType), one definition for client and
// server.
//
//   const size_t bytes = values * DTypeSize(request.dtype());   // 0: not a valid payload type
#pragma once

#include <cstddef>

#include "kvpool/v1/common.pb.h"

namespace kvpool {

// Bytes of one value of `dtype`: 2 for BF16 and FP16, 4 for FP32, 0 for anything else (including
// DTYPE_UNSPECIFIED and numbers that name no type).
size_t DTypeSize(v1::DType dtype);

}  // namespace kvpool
