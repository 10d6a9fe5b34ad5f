#include "server/auth/server_credentials.h"

#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/file_read.h"
#include "grpcpp/security/tls_certificate_provider.h"
#include "grpcpp/security/tls_credentials_options.h"

namespace kvpool::server {
namespace {

absl::Status CheckPemFile(const char* flag, const std::string& path) {
  absl::StatusOr<std::string> text = ReadRegularFile(path, 1u << 20);
  if (!text.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(flag, "=", path, ": ", text.status().message()));
  }
  if (!absl::StrContains(*text, "-----BEGIN ")) {
    return absl::InvalidArgumentError(absl::StrCat(flag, "=", path, ": no PEM block"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFor(
    const ServerConfig& config, std::shared_ptr<grpc::AuthMetadataProcessor> processor) {
  std::shared_ptr<grpc::ServerCredentials> creds;
  if (!config.tls_cert.empty()) {
    for (auto [flag, path] :
         {std::pair<const char*, const std::string*>{"--tls_cert", &config.tls_cert},
          {"--tls_key", &config.tls_key},
          {"--tls_client_ca", &config.tls_client_ca}}) {
      if (path->empty()) continue;
      if (absl::Status s = CheckPemFile(flag, *path); !s.ok()) return s;
    }
    auto provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
        config.tls_key, config.tls_cert, config.tls_client_ca,
        static_cast<unsigned int>(config.tls_refresh_seconds));
    grpc::experimental::TlsServerCredentialsOptions options(provider);
    options.watch_identity_key_cert_pairs();
    if (!config.tls_client_ca.empty()) {
      options.watch_root_certs();
      // A certificate is optional (a token will do), but one that is shown must verify.
      options.set_cert_request_type(GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY);
    } else {
      options.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
    }
    creds = grpc::experimental::TlsServerCredentials(options);
  } else if (!config.tenants_file.empty()) {
    creds = grpc::experimental::LocalServerCredentials(LOCAL_TCP);
  } else {
    return grpc::InsecureServerCredentials();
  }
  if (creds == nullptr) return absl::InvalidArgumentError("gRPC refused the TLS settings");
  if (processor != nullptr) creds->SetAuthMetadataProcessor(processor);
  return creds;
}

}  // namespace kvpool::server
