// kvpool-ucx-push: pushes part of a prefill over a UCX channel, prints "PUSHED" and then waits
// to be killed. The fault tests run it as a real client process and SIGKILL it mid-push to check
// that kvpoold rolls the push back and frees its staging (server/transport/ucx/).
//
//   kvpool-ucx-push --target=127.0.0.1:50051 --tls=posix,sysv,cma --sequence=s
//       --tokens=256 --row_values=64 --push_layers=2 --wait_stored
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/time/clock.h"
#include "client/transport/ucx_channel.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051", "kvpoold gRPC address");
ABSL_FLAG(std::string, tls, "posix,sysv,cma", "UCX_TLS of this client");
ABSL_FLAG(std::string, sequence, "s", "Sequence to push to (must exist)");
ABSL_FLAG(int32_t, tokens, 256, "Tokens of the push");
ABSL_FLAG(int32_t, row_values, 64, "kv_heads x head_dim of the model");
ABSL_FLAG(int32_t, push_layers, 1, "Layers pushed before pausing");
ABSL_FLAG(bool, wait_stored, true, "Wait until the pushed layers are stored before pausing");
ABSL_FLAG(int32_t, pause_s, 600, "How long to wait for the kill before exiting (status 3)");

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  kvpool::client::UcxChannelOptions o;
  o.runtime.tls = absl::GetFlag(FLAGS_tls);
  o.runtime.net_devices = "lo";
  o.runtime.keepalive = absl::Milliseconds(500);
  o.client_name = "kvpool-ucx-push";
  auto ch = kvpool::client::UcxChannel::Connect(
      grpc::CreateChannel(absl::GetFlag(FLAGS_target), grpc::InsecureChannelCredentials()), o);
  if (!ch.ok()) {
    std::fprintf(stderr, "connect: %s\n", ch.status().ToString().c_str());
    return 1;
  }
  const int tokens = absl::GetFlag(FLAGS_tokens);
  const size_t bytes = static_cast<size_t>(tokens) * absl::GetFlag(FLAGS_row_values) * 2;
  std::string k(bytes, '\0'), v(bytes, '\0');
  for (size_t i = 0; i + 1 < bytes; i += 2) {  // small finite BF16 values
    k[i + 1] = static_cast<char>(0x3c + (i / 2) % 3);
    v[i + 1] = static_cast<char>(0x3d - (i / 2) % 3);
  }
  auto push =
      (*ch)->BeginPush({absl::GetFlag(FLAGS_sequence), 0, static_cast<uint32_t>(tokens), true, {}});
  if (!push.ok()) {
    std::fprintf(stderr, "begin: %s\n", push.status().ToString().c_str());
    return 1;
  }
  for (int l = 0; l < absl::GetFlag(FLAGS_push_layers); ++l) {
    absl::Status s = (*push)->PushLayer(l, 0, tokens, k, v);
    if (s.ok() && absl::GetFlag(FLAGS_wait_stored)) s = (*push)->WaitLayer(l);
    if (!s.ok()) {
      std::fprintf(stderr, "layer %d: %s\n", l, s.ToString().c_str());
      return 1;
    }
  }
  std::printf("PUSHED\n");
  std::fflush(stdout);
  absl::SleepFor(absl::Seconds(absl::GetFlag(FLAGS_pause_s)));
  return 3;
}
