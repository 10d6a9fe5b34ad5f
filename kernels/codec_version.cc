// PLACEHOLDER: being written (replace this whole file).
#include "kernels/codec_version.h"
