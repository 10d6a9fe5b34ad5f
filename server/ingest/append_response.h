// The answers of a committed append in the API's messages: AppendKv's (also the answer of a
// device push, TransportService.PushKv) and AppendDecode's.
//
//   FillAppendKvResponse(result, response);
//
// Pure functions; thread-safe.
#pragma once

#include "kvpool/v1/sequence_service.pb.h"
#include "server/sequence_store.h"

namespace kvpool::server {

void FillAppendKvResponse(const AppendResult& r, ::kvpool::v1::AppendKvResponse* out);
void FillAppendDecodeResponse(const AppendResult& r, ::kvpool::v1::AppendDecodeResponse* out);

}  // namespace kvpool::server
