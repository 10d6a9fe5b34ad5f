/* kvpool_attention.h compiles as C99 (-pedantic -Werror), and the library answers through it:
 * the version, and a descriptor error with its message, from a C caller. */
#include <stdio.h>
#include <string.h>

#include "kernels/capi/kvpool_attention.h"

int main(void) {
  kvpool_attention_desc desc;
  kvpool_attention_io io;
  uint64_t bytes = 0;
  int32_t rc;
  if (kvpool_attention_version() != KVPOOL_ATTENTION_VERSION) {
    fprintf(stderr, "version %d, header %d\n", (int)kvpool_attention_version(),
            KVPOOL_ATTENTION_VERSION);
    return 1;
  }
  kvpool_attention_desc_init(&desc);
  kvpool_attention_io_init(&io);
  if (desc.struct_size != sizeof(desc) || io.struct_size != sizeof(io) ||
      desc.device != KVPOOL_ATTENTION_HOST || desc.bits != 2 || desc.block_tokens != 16) {
    fprintf(stderr, "the _init functions did not set the defaults\n");
    return 1;
  }
  /* q_heads = 0: an invalid descriptor. */
  rc = kvpool_attention_workspace_bytes(&desc, &bytes);
  if (rc != KVPOOL_ATTENTION_INVALID_ARGUMENT || strlen(kvpool_attention_last_error()) == 0) {
    fprintf(stderr, "expected INVALID_ARGUMENT with a message, got %d\n", (int)rc);
    return 1;
  }
  printf("C caller: version %d, error '%s'\n", (int)kvpool_attention_version(),
         kvpool_attention_last_error());
  return 0;
}
