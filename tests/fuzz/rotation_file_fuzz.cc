// Fuzz target: the rotation-file reader (kernels/rotation_file.h, ParseRotationFile), what
// kvpoold runs on an uploaded RegisterModel file. Any input either fails with InvalidArgument
// or yields a model that serializes and parses back to the same codec version.
#include <cstddef>
#include <cstdint>
#include <string>

#include "kernels/codec_version.h"
#include "kernels/rotation_file.h"
#include "tests/fuzz/fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  absl::StatusOr<kvpool::ModelCodec> model =
      kvpool::ParseRotationFile(std::string(reinterpret_cast<const char*>(data), size));
  if (!model.ok()) {
    FUZZ_CHECK(absl::IsInvalidArgument(model.status()), model.status().ToString());
    return 0;
  }
  FUZZ_CHECK(model->quant.Validate(model->rotations.head_dim()).ok(), "invalid quant config");
  absl::StatusOr<kvpool::ModelCodec> back =
      kvpool::ParseRotationFile(kvpool::SerializeRotationFile(*model));
  FUZZ_CHECK(back.ok(), back.status().ToString());
  FUZZ_CHECK(kvpool::CodecVersionHex(*back) == kvpool::CodecVersionHex(*model),
             "codec version changed in a round trip");
  FUZZ_CHECK(back->model_id == model->model_id && back->objective == model->objective,
             "metadata changed in a round trip");
  return 0;
}
