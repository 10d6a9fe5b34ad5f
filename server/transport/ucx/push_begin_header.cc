#include "server/transport/ucx/push_begin_header.h"

#include <utility>

namespace kvpool::server {

::kvpool::v1::AppendKvHeader AppendHeaderOfPushBegin(const ucx::wire::PushBeginHeader& h,
                                                     ucx::wire::PushBegin begin) {
  ::kvpool::v1::AppendKvHeader header;
  header.set_sequence_id(std::move(begin.sequence_id));
  header.set_token_start(h.token_start);
  header.set_num_tokens(h.num_tokens);
  header.set_dtype(::kvpool::v1::DTYPE_BF16);
  header.set_end_of_prefill((h.flags & ucx::wire::kEndOfPrefill) != 0);
  header.mutable_token_ids()->Add(begin.token_ids.begin(), begin.token_ids.end());
  return header;
}

}  // namespace kvpool::server
