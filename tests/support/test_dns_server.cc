#include "tests/support/test_dns_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <utility>

#include "absl/strings/ascii.h"

namespace kvpool::testing {
namespace {

constexpr size_t kHeaderBytes = 12;
constexpr size_t kMaxUdpReply = 512;  // plain DNS over UDP, no EDNS
constexpr size_t kMaxNameBytes = 255;
constexpr uint16_t kTypeA = 1, kClassIn = 1;
constexpr uint8_t kRcodeNoError = 0, kRcodeNxDomain = 3, kRcodeNotImplemented = 4;

uint16_t ReadU16(const uint8_t* p) { return static_cast<uint16_t>((p[0] << 8) | p[1]); }
void AppendU16(std::string* out, uint16_t v) {
  out->push_back(static_cast<char>(v >> 8));
  out->push_back(static_cast<char>(v & 0xff));
}

bool ParseAddresses(const std::vector<std::string>& ipv4, std::vector<uint32_t>* out) {
  out->clear();
  for (const std::string& ip : ipv4) {
    in_addr a{};
    if (inet_pton(AF_INET, ip.c_str(), &a) != 1) return false;
    out->push_back(a.s_addr);
  }
  return true;
}

}  // namespace

TestDnsServer::TestDnsServer(std::string name, std::vector<std::string> ipv4)
    : name_(absl::AsciiStrToLower(name)) {
  {
    absl::MutexLock lock(&mu_);
    if (!ParseAddresses(ipv4, &addresses_)) return;
  }
  const int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    close(fd);
    return;
  }
  fd_ = fd;
  port_ = ntohs(addr.sin_port);
  thread_ = std::thread([this] { Serve(); });
}

TestDnsServer::~TestDnsServer() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
  if (fd_ >= 0) close(fd_);
}

bool TestDnsServer::SetAddresses(const std::vector<std::string>& ipv4) {
  std::vector<uint32_t> parsed;
  if (!ParseAddresses(ipv4, &parsed)) return false;
  absl::MutexLock lock(&mu_);
  addresses_ = std::move(parsed);
  return true;
}

void TestDnsServer::Serve() {
  uint8_t buffer[2048];
  while (!stop_) {
    pollfd p{fd_, POLLIN, 0};
    // A short wait so that the destructor's stop is seen soon.
    if (poll(&p, 1, 50) <= 0) continue;
    sockaddr_in from{};
    socklen_t from_len = sizeof(from);
    const ssize_t n = recvfrom(fd_, buffer, sizeof(buffer), MSG_DONTWAIT,
                               reinterpret_cast<sockaddr*>(&from), &from_len);
    if (n <= 0) continue;
    const std::string reply = Answer(buffer, static_cast<size_t>(n));
    if (reply.empty()) continue;
    (void)sendto(fd_, reply.data(), reply.size(), 0, reinterpret_cast<sockaddr*>(&from), from_len);
    ++answered_;
  }
}

std::string TestDnsServer::Answer(const uint8_t* query, size_t size) {
  if (size < kHeaderBytes) return "";
  const uint16_t flags = ReadU16(query + 2);
  const bool is_response = (flags & 0x8000) != 0;
  const uint8_t opcode = (flags >> 11) & 0xf;
  if (is_response || ReadU16(query + 4) != 1) return "";  // one question, a query

  // The question: labels (no compression in a question), then type and class.
  size_t at = kHeaderBytes;
  std::string name;
  for (;;) {
    if (at >= size) return "";
    const uint8_t label = query[at++];
    if (label == 0) break;
    if (label > 63 || label > size - at) return "";
    if (!name.empty()) name.push_back('.');
    name.append(reinterpret_cast<const char*>(query + at), label);
    if (name.size() > kMaxNameBytes) return "";
    at += label;
  }
  if (size - at < 4) return "";
  const uint16_t qtype = ReadU16(query + at);
  const uint16_t qclass = ReadU16(query + at + 2);
  at += 4;
  const size_t question_end = at;

  std::vector<uint32_t> addresses;
  uint8_t rcode = kRcodeNoError;
  if (opcode != 0) {
    rcode = kRcodeNotImplemented;
  } else if (absl::AsciiStrToLower(name) != name_) {
    rcode = kRcodeNxDomain;
  } else if (qtype == kTypeA && qclass == kClassIn) {
    absl::MutexLock lock(&mu_);
    addresses = addresses_;
  }  // other types of the name (AAAA): no error, no record

  std::string reply;
  reply.push_back(static_cast<char>(query[0]));  // the query's id
  reply.push_back(static_cast<char>(query[1]));
  // QR, the opcode, AA, RD as asked; RA; the rcode.
  const uint16_t reply_flags =
      static_cast<uint16_t>(0x8000 | (opcode << 11) | 0x0400 | (flags & 0x0100) | 0x0080 | rcode);
  const size_t fit = (kMaxUdpReply - question_end) / 16;
  const bool truncated = addresses.size() > fit;
  if (truncated) addresses.resize(fit);
  AppendU16(&reply, static_cast<uint16_t>(reply_flags | (truncated ? 0x0200 : 0)));
  AppendU16(&reply, 1);
  AppendU16(&reply, static_cast<uint16_t>(addresses.size()));
  AppendU16(&reply, 0);
  AppendU16(&reply, 0);
  reply.append(reinterpret_cast<const char*>(query + kHeaderBytes), question_end - kHeaderBytes);
  for (uint32_t a : addresses) {
    AppendU16(&reply, 0xc000 | kHeaderBytes);  // the name: a pointer to the question's
    AppendU16(&reply, kTypeA);
    AppendU16(&reply, kClassIn);
    AppendU16(&reply, 0);  // TTL: 0, never cached
    AppendU16(&reply, 0);
    AppendU16(&reply, 4);
    reply.append(reinterpret_cast<const char*>(&a), 4);
  }
  return reply;
}

}  // namespace kvpool::testing
