/* kvpool's decode attention as a library for inference engines: a pure C interface
 * (libkvpool_attention.so) over the blocks kvpool stores, 2-bit history blocks and BF16 sink and
 * recent pages, in host memory (CPU path) or in the memory of a CUDA device (kvpool's GPU
 * kernel). One call is one decode step of one layer for a batch of sequences; the engine calls
 * it once per layer per step (docs/attention-backend.md).
 *
 *   kvpool_attention_desc desc;
 *   kvpool_attention_desc_init(&desc);            // struct_size and defaults
 *   desc.q_heads = 64; desc.kv_heads = 8; desc.head_dim = 128; desc.device = 0;
 *   ... pools, tiers, num_seqs, token bounds ...
 *   uint64_t bytes;
 *   if (kvpool_attention_workspace_bytes(&desc, &bytes) != KVPOOL_ATTENTION_OK) {
 *     fprintf(stderr, "%s\n", kvpool_attention_last_error());
 *   }
 *   kvpool_attention_io io;
 *   kvpool_attention_io_init(&io);
 *   io.queries = q; io.out = out; io.lse = lse; io.workspace = ws; io.workspace_bytes = bytes;
 *   io.stream = stream;                           // a cudaStream_t, device path only
 *   int rc = kvpool_attention_decode(&desc, &io);
 *
 * Semantics, per sequence b and query head j (served by KV head j / (q_heads / kv_heads)), with
 * q' = q * M_K:  l_t = q'_j . k'_t / sqrt(head_dim) over the sink, history and recent tokens;
 * lse_j = ln sum_t exp(l_t);  out_j = (sum_t exp(l_t - lse_j) v'_t) * M_V^T.  An empty sequence
 * gives lse = -inf and a zero output.
 *
 * Errors: the functions that can fail return a status code with the numbering of
 * absl::StatusCode and gRPC (0 = OK); kvpool_attention_last_error() then says why, in words. A call that fails writes no
 * output. ABI: the structs begin with struct_size (set it to sizeof, or call the *_init
 * functions); later versions only append fields, and read the fields a caller's size covers.
 * Thread-safety: stateless; calls from many threads may run at once (each device call needs its
 * own workspace, or calls on one stream).
 */
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The version of this interface: major * 10000 + minor * 100 + patch. A library answers the
 * major it implements; a caller built against a later minor checks kvpool_attention_version(). */
#define KVPOOL_ATTENTION_VERSION 10000

/* Status codes (absl::StatusCode / gRPC numbering). */
#define KVPOOL_ATTENTION_OK 0
#define KVPOOL_ATTENTION_INVALID_ARGUMENT 3
#define KVPOOL_ATTENTION_RESOURCE_EXHAUSTED 8
#define KVPOOL_ATTENTION_FAILED_PRECONDITION 9
#define KVPOOL_ATTENTION_UNIMPLEMENTED 12
#define KVPOOL_ATTENTION_INTERNAL 13
#define KVPOOL_ATTENTION_UNAVAILABLE 14

/* kvpool_attention_desc.quant_method */
#define KVPOOL_ATTENTION_QUANT_UNIFORM 0
#define KVPOOL_ATTENTION_QUANT_LLOYD_MAX 1
#define KVPOOL_ATTENTION_QUANT_BYPASS 2
/* kvpool_attention_desc.scale_dtype */
#define KVPOOL_ATTENTION_SCALE_FP16 0
#define KVPOOL_ATTENTION_SCALE_BF16 1

/* kvpool_attention_desc.device for host memory. */
#define KVPOOL_ATTENTION_HOST (-1)

/* A pool of blocks of one layout: block id b starts at base + b * block_stride bytes; ids
 * outside [0, num_blocks) are invalid. block_stride 0 means the layout's block size. */
typedef struct kvpool_attention_pool {
  const void* base;
  int64_t num_blocks;
  int64_t block_stride; /* bytes, 0 or a multiple of 16 */
} kvpool_attention_pool;

/* One tier of every sequence: sequence i holds the tokens at positions
 * [first_token[i], first_token[i] + num_tokens[i]) of its block table row
 * block_tables + i * block_table_stride (entry p / block_tokens holds position p at slot
 * p % block_tokens). int32 arrays in the memory the call runs on. */
typedef struct kvpool_attention_tier {
  const int32_t* block_tables; /* [num_seqs][block_table_stride] */
  int32_t block_table_stride;
  const int32_t* first_token; /* [num_seqs] */
  const int32_t* num_tokens;  /* [num_seqs] */
} kvpool_attention_tier;

/* A decode batch of one model and layer, and where it runs. */
typedef struct kvpool_attention_desc {
  uint32_t struct_size; /* sizeof(kvpool_attention_desc) */
  int32_t q_heads;
  int32_t kv_heads;
  int32_t head_dim;
  /* The model's codec (kvpool's QuantConfig) of the history blocks. */
  int32_t bits;                       /* 2 or 4 (ignored by BYPASS); default 2 */
  int32_t group_size;                 /* dims per scale/min pair, 0 = head_dim; default 0 */
  int32_t quant_method;               /* KVPOOL_ATTENTION_QUANT_*; default UNIFORM */
  int32_t scale_dtype;                /* KVPOOL_ATTENTION_SCALE_*; default FP16 */
  int32_t block_tokens;               /* tokens per block of both pools; default 16 */
  kvpool_attention_pool history_pool; /* the history tier's blocks (the codec above) */
  kvpool_attention_pool bf16_pool;    /* the sink and recent tiers' BF16 pages */
  kvpool_attention_tier sink;         /* in bf16_pool */
  kvpool_attention_tier history;      /* in history_pool */
  kvpool_attention_tier recent;       /* in bf16_pool */
  int32_t num_seqs;
  int32_t max_history_tokens; /* >= every sequence's history tokens */
  int32_t max_bf16_tokens;    /* >= every sequence's sink + recent tokens */
  /* KVPOOL_ATTENTION_HOST: every pointer is host memory, the CPU path runs on the calling
   * thread. >= 0: every pointer is memory of that CUDA device, the GPU kernel runs there. */
  int32_t device;
} kvpool_attention_desc;

/* The per-call buffers, in the memory the call runs on. */
typedef struct kvpool_attention_io {
  uint32_t struct_size;    /* sizeof(kvpool_attention_io) */
  const float* queries;    /* [num_seqs][q_heads][head_dim] fp32, original basis */
  const float* rotation_k; /* [head_dim][head_dim] fp32 row-major, x_rot = x * M; NULL = I */
  const float* rotation_v; /* the same for V; NULL = I */
  float* out;              /* [num_seqs][q_heads][head_dim] fp32, original basis */
  float* lse;              /* [num_seqs][q_heads] fp32, natural log */
  void* workspace;         /* kvpool_attention_workspace_bytes() bytes (NULL when 0) */
  uint64_t workspace_bytes;
  void* stream; /* device path: the cudaStream_t to enqueue on (NULL = legacy default) */
} kvpool_attention_io;

/* Fills `desc` / `io` with zeros, the defaults above, device = HOST and struct_size. */
void kvpool_attention_desc_init(kvpool_attention_desc* desc);
void kvpool_attention_io_init(kvpool_attention_io* io);

/* KVPOOL_ATTENTION_VERSION of the library (to compare with the header's). */
int32_t kvpool_attention_version(void);

/* 1 when the library was built with the CUDA kernel, else 0 (its device path answers
 * UNAVAILABLE). */
int32_t kvpool_attention_has_cuda(void);

/* The workspace the call on `desc` needs, in bytes, in the memory of desc->device (0 on the
 * host path). Checks the descriptor's values (not the contents of its arrays). */
int32_t kvpool_attention_workspace_bytes(const kvpool_attention_desc* desc, uint64_t* bytes);

/* One decode step of one layer for desc->num_seqs sequences.
 * Host path: runs on the calling thread and returns when out and lse are written; the block
 * tables are checked too (a block id outside its pool, tokens beyond a table row, negative
 * counts, counts above the token bounds: INVALID_ARGUMENT, nothing written).
 * Device path: enqueues the kernels on io->stream and returns; out and lse are ready when the
 * stream reaches that point. The arrays live on the device and are not read by the host: the
 * caller guarantees their contents (token counts within the bounds, block ids within the pools).
 * Codes: INVALID_ARGUMENT (descriptor, sizes, null or misplaced pointers), UNIMPLEMENTED (a codec
 * or shape the path does not run: the GPU kernel needs head_dim 64 or 128, 2-bit history with
 * group_size = head_dim and at most 16 query heads per KV head), FAILED_PRECONDITION (workspace
 * too small), UNAVAILABLE (no CUDA in this build, or no such device), INTERNAL (a CUDA error). */
int32_t kvpool_attention_decode(const kvpool_attention_desc* desc, const kvpool_attention_io* io);

/* Why the calling thread's last failed call failed ("" after a success). Valid until the next
 * call of this library on the same thread. */
const char* kvpool_attention_last_error(void);

#ifdef __cplusplus
} /* extern "C" */
#endif
