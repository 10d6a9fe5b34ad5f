// PLACEHOLDER: being written (replace this whole file).
#include "kernels/rotation_file.h"
