// PLACEHOLDER: being written (replace this whole file).
#include "kernels/attention.h"
