// The channel a kvpool client talks over: plaintext or TLS (verifying the daemon against a CA,
// optionally presenting a client certificate), and a bearer token added to every call's
// metadata ("authorization: Bearer <token>") by a channel interceptor, so raw stubs on the
// channel carry it too. docs/security.md describes what the daemon accepts.
//
//   ChannelSecurity sec;
//   sec.token = "s3cret";                       // or TokenFromEnvironmentOrFile(...)
//   sec.tls_root_ca_file = "ca.pem";            // TLS on
//   KVPOOL_ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> ch,
//                           OpenChannel("kvpool.example:50051", sec, grpc::ChannelArguments()));
//
// Thread-safe (no shared state).
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/grpcpp.h"

namespace kvpool::client {

struct ChannelSecurity {
  // Bearer token sent on every call; empty: none.
  std::string token;
  // PEM CA bundle that the daemon's certificate must chain to; non-empty turns TLS on.
  std::string tls_root_ca_file;
  // PEM client certificate chain and its key (mutual TLS); both or neither.
  std::string tls_cert_file;
  std::string tls_key_file;
  // Name to verify the daemon's certificate against instead of the target's host.
  std::string tls_server_name;
};

// A channel to `target` with `security` and `args`. InvalidArgument for unreadable files, a
// certificate without its key, or a token with characters metadata cannot carry.
[[nodiscard]] absl::StatusOr<std::shared_ptr<grpc::Channel>> OpenChannel(
    const std::string& target, const ChannelSecurity& security, grpc::ChannelArguments args);

// The token from the environment variable `env` when set, else the first line of `file` when
// given, else "" (keeps tokens off command lines, where other users can read them).
[[nodiscard]] absl::StatusOr<std::string> TokenFromEnvironmentOrFile(const char* env,
                                                                     const std::string& file);

}  // namespace kvpool::client
