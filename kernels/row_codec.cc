// PLACEHOLDER: being written (replace this whole file).
#include "kernels/row_codec.h"
