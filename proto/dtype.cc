#include "proto/dtype.h"

namespace kvpool {

size_t DTypeSize(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_BF16:
    case v1::DTYPE_FP16:
      return 2;
    case v1::DTYPE_FP32:
      return 4;
    default:
      return 0;
  }
}

}  // namespace kvpool
