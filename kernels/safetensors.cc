// PLACEHOLDER: being written (replace this whole file).
#include "kernels/safetensors.h"
