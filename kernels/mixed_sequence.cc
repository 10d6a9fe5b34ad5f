// PLACEHOLDER: being written (replace this whole file).
#include "kernels/mixed_sequence.h"
