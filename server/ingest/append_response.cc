#include "server/ingest/append_response.h"

#include "server/proto_convert.h"

namespace kvpool::server {

void FillAppendKvResponse(const AppendResult& r, v1::AppendKvResponse* out) {
  FillSequenceInfo(r.info, out->mutable_sequence());
  out->set_to_history(r.to_history);
  out->set_to_sink(r.to_sink);
  out->set_to_recent(r.to_recent);
  for (const PrefixUnitKey& k : r.published) FillPrefixUnit(k, out->add_published_units());
}

void FillAppendDecodeResponse(const AppendResult& r, v1::AppendDecodeResponse* out) {
  FillSequenceInfo(r.info, out->mutable_sequence());
  out->set_demoted_tokens(r.demoted);
  for (const PrefixUnitKey& k : r.published) FillPrefixUnit(k, out->add_published_units());
}

}  // namespace kvpool::server
