// The append header a UCX PUSH_BEGIN describes (dataplane/ucx_wire.h): its fixed header and
// parsed payload decoded into kvpool.v1.AppendKvHeader, the one header every ingest carries and
// the ingest engine validates (server/ingest/append_checks.h). UCX moves BF16 rows only.
//
//   KVPOOL_ASSIGN_OR_RETURN(wire::PushBegin begin, wire::ParsePushBegin(h, payload));
//   v1::AppendKvHeader header = AppendHeaderOfPushBegin(h, std::move(begin));
//
// Pure function; thread-safe.
#pragma once

#include "dataplane/ucx_wire.h"
#include "dataplane/ucx_wire_parse.h"
#include "kvpool/v1/sequence_service.pb.h"

namespace kvpool::server {

::kvpool::v1::AppendKvHeader AppendHeaderOfPushBegin(const ucx::wire::PushBeginHeader& h,
                                                     ucx::wire::PushBegin begin);

}  // namespace kvpool::server
