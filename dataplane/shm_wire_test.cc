#include "dataplane/shm_wire.h"

#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#include "dataplane/fd_passing.h"
#include "dataplane/shm_doorbell.h"
#include "gtest/gtest.h"

namespace kvpool::server {
namespace {

TEST(ShmWireTest, LayoutIsAlignedAndBounded) {
  absl::StatusOr<ShmLayout> l = MakeShmLayout(4, 64 * 128 * 4 * 32, 64 * 4 * 32, 64 << 20);
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ(l->slot_bytes % 64, 0u);
  EXPECT_EQ(ShmLayout::queries_at() % 64, 0u);
  EXPECT_GE(ShmLayout::queries_at(), kShmSlotStatusAt + kCallStatusBytes);
  EXPECT_EQ(l->lse_at() + l->max_lse_bytes <= l->slot_bytes, true);
  EXPECT_EQ(l->region_bytes(), kShmSlotsAt + 4 * l->slot_bytes);
  EXPECT_FALSE(MakeShmLayout(0, 1024, 64, 1 << 30).ok());
  EXPECT_FALSE(MakeShmLayout(kShmMaxSlots + 1, 1024, 64, 1 << 30).ok());
  EXPECT_FALSE(MakeShmLayout(1, 1022, 64, 1 << 30).ok());
  EXPECT_FALSE(MakeShmLayout(1, 1024, 2048, 1 << 30).ok());
  EXPECT_FALSE(MakeShmLayout(1, kMaxCallQueryBytes + 4, 64, size_t{1} << 40).ok());
  EXPECT_FALSE(MakeShmLayout(8, 1 << 20, 1 << 10, 1 << 20).ok());  // over the region cap
}

TEST(ShmWireTest, RegionHeaderRoundTripsAndRejectsMismatch) {
  absl::StatusOr<ShmLayout> l = MakeShmLayout(2, 4096, 128, 1 << 20);
  ASSERT_TRUE(l.ok());
  std::vector<uint8_t> region(l->region_bytes(), 0);
  WriteShmRegionHeader(*l, region.data());
  absl::StatusOr<ShmLayout> back = ReadShmRegionHeader(region);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->slot_bytes, l->slot_bytes);
  EXPECT_EQ(back->slots, 2u);
  // A region shorter than its header claims, or a changed field, is refused.
  EXPECT_FALSE(
      ReadShmRegionHeader(absl::MakeConstSpan(region).subspan(0, region.size() - 64)).ok());
  region[8] = 3;
  EXPECT_FALSE(ReadShmRegionHeader(region).ok());
}

TEST(ShmWireTest, HelloAndReplyRoundTrip) {
  ShmHello h{0x1234567890abcdefULL, std::string(kShmSecretBytes, 'k')};
  auto bytes = EncodeShmHello(h);
  absl::StatusOr<ShmHello> got = DecodeShmHello(bytes);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->session_id, h.session_id);
  EXPECT_EQ(got->secret, h.secret);
  bytes[40] = 1;  // padding must stay zero
  EXPECT_FALSE(DecodeShmHello(bytes).ok());
  EXPECT_FALSE(DecodeShmHello(EncodeShmHello({0, h.secret})).ok());
  EXPECT_FALSE(DecodeShmHello(absl::MakeConstSpan(bytes).subspan(1)).ok());

  auto reply = EncodeShmReply({absl::NotFoundError(std::string(500, 'x')), 77});
  absl::StatusOr<ShmReply> r = DecodeShmReply(reply);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(absl::IsNotFound(r->status));
  EXPECT_EQ(r->status.message().size(), kShmReplyBytes - 24);  // cut to fit
  EXPECT_EQ(r->region_bytes, 77u);
  reply[8] = 200;  // no such code
  EXPECT_FALSE(DecodeShmReply(reply).ok());
}

TEST(ShmDoorbellTest, WakesASleepingWaiterAndTimesOutOtherwise) {
  std::atomic<uint32_t> word{5}, sleeping{0};
  // Nobody rings: returns the unchanged value after the timeout.
  EXPECT_EQ(WaitWhileEqual(word, 5, sleeping, absl::Microseconds(10), absl::Milliseconds(20)), 5u);
  EXPECT_EQ(sleeping.load(), 0u);
  std::thread ringer([&] {
    // Ring only once the waiter sleeps in the kernel: the wake-up path is what is tested.
    while (sleeping.load() == 0) std::this_thread::yield();
    IncrementAndWake(word, sleeping);
  });
  EXPECT_EQ(WaitWhileEqual(word, 5, sleeping, absl::ZeroDuration(), absl::Seconds(60)), 6u);
  ringer.join();
}

TEST(FdPassingTest, HandsAMemfdToThePeer) {
  int sv[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  const int mem = memfd_create("fd-passing-test", MFD_CLOEXEC);
  ASSERT_GE(mem, 0);
  ASSERT_EQ(ftruncate(mem, 4096), 0);
  auto* a = static_cast<uint8_t*>(mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, mem, 0));
  ASSERT_NE(a, MAP_FAILED);
  const uint8_t msg[3] = {1, 2, 3};
  ASSERT_TRUE(SendWithFd(sv[0], msg, mem).ok());
  uint8_t got[3] = {};
  absl::StatusOr<int> fd = ReceiveWithFd(sv[1], absl::MakeSpan(got), absl::Seconds(5));
  ASSERT_TRUE(fd.ok()) << fd.status();
  ASSERT_GE(*fd, 0);
  EXPECT_EQ(std::memcmp(got, msg, 3), 0);
  auto* b = static_cast<uint8_t*>(mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, *fd, 0));
  ASSERT_NE(b, MAP_FAILED);
  a[100] = 42;
  EXPECT_EQ(b[100], 42);
  // No message: a deadline; a closed peer: unavailable.
  EXPECT_TRUE(absl::IsDeadlineExceeded(
      ReceiveWithFd(sv[1], absl::MakeSpan(got), absl::Milliseconds(20)).status()));
  close(sv[0]);
  EXPECT_TRUE(
      absl::IsUnavailable(ReceiveWithFd(sv[1], absl::MakeSpan(got), absl::Seconds(5)).status()));
  munmap(a, 4096);
  munmap(b, 4096);
  close(*fd);
  close(mem);
  close(sv[1]);
}

}  // namespace
}  // namespace kvpool::server
