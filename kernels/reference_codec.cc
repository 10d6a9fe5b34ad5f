// PLACEHOLDER: being written (replace this whole file).
#include "kernels/reference_codec.h"
