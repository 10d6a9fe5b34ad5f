#include "tests/bench/bench_prefill.h"

#include <memory>

#include "common/status_macros.h"

namespace kvpool::bench {

absl::Status PrefillLayer0(const client::KvpoolClient& c, const std::string& id,
                           const std::vector<Bf16>& k, const std::vector<Bf16>& v, int tokens,
                           size_t row_values) {
  ::kvpool::v1::AppendKvHeader header;
  header.set_sequence_id(id);
  header.set_token_start(0);
  header.set_num_tokens(tokens);
  header.set_dtype(::kvpool::v1::DTYPE_BF16);
  header.set_end_of_prefill(true);
  KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<client::AppendStream> stream, c.OpenAppend(header));
  const size_t bytes = static_cast<size_t>(tokens) * row_values * sizeof(Bf16);
  if (k.size() * sizeof(Bf16) < bytes || v.size() * sizeof(Bf16) < bytes) {
    return absl::InvalidArgumentError("prefill rows shorter than the sequence");
  }
  KVPOOL_RETURN_IF_ERROR(stream->WriteLayer(
      0, 0, tokens, absl::string_view(reinterpret_cast<const char*>(k.data()), bytes),
      absl::string_view(reinterpret_cast<const char*>(v.data()), bytes)));
  return stream->Finish().status();
}

}  // namespace kvpool::bench
