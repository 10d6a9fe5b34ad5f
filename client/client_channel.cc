#include "client/client_channel.h"

#include <cstdlib>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/file_read.h"
#include "grpcpp/support/client_interceptor.h"

namespace kvpool::client {
namespace {

// Adds the bearer token to every call's initial metadata.
class BearerInterceptor : public grpc::experimental::Interceptor {
 public:
  explicit BearerInterceptor(const std::string* header) : header_(header) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      methods->GetSendInitialMetadata()->emplace("authorization", *header_);
    }
    methods->Proceed();
  }

 private:
  const std::string* header_;
};

class BearerInterceptorFactory : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit BearerInterceptorFactory(std::string token) : header_("Bearer " + std::move(token)) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(
      grpc::experimental::ClientRpcInfo* /*info*/) override {
    return new BearerInterceptor(&header_);
  }

 private:
  const std::string header_;  // lives as long as the channel that owns the factory
};

absl::StatusOr<std::string> ReadPem(const char* what, const std::string& path) {
  absl::StatusOr<std::string> text = ReadRegularFile(path, 1u << 20);
  if (!text.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(what, " ", path, ": ", text.status().message()));
  }
  return text;
}

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::Channel>> OpenChannel(const std::string& target,
                                                           const ChannelSecurity& security,
                                                           grpc::ChannelArguments args) {
  for (char c : security.token) {
    if (c < 0x21 || c > 0x7e) {
      return absl::InvalidArgumentError("the token must be printable ASCII without spaces");
    }
  }
  if (security.tls_cert_file.empty() != security.tls_key_file.empty()) {
    return absl::InvalidArgumentError("a client certificate needs its key (and the reverse)");
  }
  std::shared_ptr<grpc::ChannelCredentials> creds;
  if (!security.tls_root_ca_file.empty()) {
    grpc::SslCredentialsOptions ssl;
    absl::StatusOr<std::string> ca = ReadPem("TLS CA", security.tls_root_ca_file);
    if (!ca.ok()) return ca.status();
    ssl.pem_root_certs = *std::move(ca);
    if (!security.tls_cert_file.empty()) {
      absl::StatusOr<std::string> cert = ReadPem("TLS certificate", security.tls_cert_file);
      if (!cert.ok()) return cert.status();
      absl::StatusOr<std::string> key = ReadPem("TLS key", security.tls_key_file);
      if (!key.ok()) return key.status();
      ssl.pem_cert_chain = *std::move(cert);
      ssl.pem_private_key = *std::move(key);
    }
    if (!security.tls_server_name.empty()) {
      args.SetSslTargetNameOverride(security.tls_server_name);
    }
    creds = grpc::SslCredentials(ssl);
  } else if (!security.tls_cert_file.empty()) {
    return absl::InvalidArgumentError("a client certificate needs TLS: give the CA file too");
  } else {
    creds = grpc::InsecureChannelCredentials();
  }
  if (security.token.empty()) return grpc::CreateCustomChannel(target, creds, args);
  std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(std::make_unique<BearerInterceptorFactory>(security.token));
  return grpc::experimental::CreateCustomChannelWithInterceptors(target, creds, args,
                                                                 std::move(interceptors));
}

absl::StatusOr<std::string> TokenFromEnvironmentOrFile(const char* env, const std::string& file) {
  if (const char* value = std::getenv(env); value != nullptr && value[0] != '\0') return value;
  if (file.empty()) return std::string();
  absl::StatusOr<std::string> text = ReadRegularFile(file, 64 << 10);
  if (!text.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("token file ", file, ": ", text.status().message()));
  }
  absl::string_view line = *text;
  line = line.substr(0, line.find('\n'));
  return std::string(absl::StripAsciiWhitespace(line));
}

}  // namespace kvpool::client
