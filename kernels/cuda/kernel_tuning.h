// Tuning of the CUDA kernels: which of the kept paths a call takes where the measurements left a
// choice, with the defaults those measurements chose (kernels/cuda/NOTES.md, "Paths and tuning").
// Plain values with no CUDA types and no dependencies, so code built without nvcc includes it:
// kvpoold fills the few fields an operator may change from its --cuda_* flags (server/config.cc);
// the GPU tests and benchmarks set the others to exercise or time the alternatives.
//
//   DecodeAttentionShape shape = ...;
//   shape.tuning.tail_merge = PathChoice::kNever;  // an A/B row: always the merge kernel
//   KVPOOL_RETURN_IF_ERROR(QuantizeOnArrivalJobs(jobs, err, stream, ArrivalTuning{}));
//
// A default-constructed struct is what production runs; no field changes a result beyond the
// rounding of a different summation order.
#pragma once

namespace kvpool::cuda {

// A choice between two kept paths: the rule the measurements chose (kByShape), or one path
// wherever it applies.
enum class PathChoice {
  kByShape,  // the measured rule (see the field)
  kAlways,   // wherever the shape allows it
  kNever,
};

struct AttentionTuning {
  // Daemon flag --cuda_programmatic_launch. Kernels after the query rotation are programmatic
  // dependent launches (they start while their predecessor finishes); false launches them
  // plainly, in stream order.
  bool programmatic_launch = true;
  // Daemon flag --cuda_history_chunk_tokens. Longest INT2 history chunk of one CTA, in tokens
  // (0: no cap). The tensor cores' fp32 accumulation truncates below the accumulator's ulp, a
  // bias that grows with the tokens per accumulator; 16384 keeps the output error at 128K
  // tokens well inside the 1e-2 bound at no measurable cost (NOTES.md, runs 3 and 7).
  int max_history_chunk_tokens = 16384;

  // Benchmark and test fields.
  // Shortest INT2 history chunk of one CTA, in tokens (0: the kernel's minimum). With
  // max_history_chunk_tokens equal to it, a benchmark times a split the cost model did not choose.
  int min_history_chunk_tokens = 0;
  // The BF16 tier kernel runs beside the INT2 history kernel (its programmatic dependent) when
  // both tiers have work; false runs it before, in sequence. Needs programmatic_launch.
  bool tiers_beside_history = true;
  // The INT2 history kernel fills its shared-memory ring with asynchronous copies where the
  // block layout allows (16-token blocks, history starting at a multiple of 16); false uses the
  // ordinary loads that every other layout takes.
  bool history_async_copies = true;
  // GQA groups of up to 4 take the INT2 history kernel's narrow layout (tokens on the MMA M
  // dimension); false gives them the wide layout of groups 5 to 8.
  bool narrow_layout = true;
  // The merge kernel with one CTA per KV head group (groups of up to 8) instead of one per query
  // head. kByShape: from as many (sequence, KV head) groups as SMs.
  PathChoice group_merge = PathChoice::kByShape;
  // The tail merge: the attention CTA that writes a group's last part merges the group (groups
  // of up to 8), no merge kernel. kByShape: from as many (sequence, KV head) groups as SMs.
  PathChoice tail_merge = PathChoice::kByShape;
};

struct ArrivalTuning {
  // Benchmark and test fields.
  // The tensor-core kernel (16-row tiles per warp) takes every configuration it supports (INT2
  // uniform with one group per row, or BF16 bypass pages; D 64 or 128; aligned rows); false
  // sends every configuration to the warp-per-row kernel that all others take.
  bool mma_kernel = true;
  // QuantizeOnArrivalJobs launches once for all of its jobs where the tensor-core kernel takes
  // every one of them; false launches once per job.
  bool fuse_jobs = true;
};

// Everything kvpoold's CUDA backend passes to the kernels.
struct KernelTuning {
  AttentionTuning attention;
  ArrivalTuning arrival;
};

}  // namespace kvpool::cuda
