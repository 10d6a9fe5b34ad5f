#include "dataplane/shm_doorbell.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>

#include "absl/time/clock.h"

namespace kvpool::server {
namespace {

// Not FUTEX_PRIVATE_FLAG: the word lives in a mapping shared with another process.
void FutexWait(std::atomic<uint32_t>& word, uint32_t value, absl::Duration timeout) {
  const timespec ts = absl::ToTimespec(std::max(timeout, absl::ZeroDuration()));
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT, value, &ts, nullptr, 0);
}

void FutexWakeAll(std::atomic<uint32_t>& word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr,
          0);
}

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

}  // namespace

uint32_t WaitWhileEqual(std::atomic<uint32_t>& word, uint32_t value,
                        std::atomic<uint32_t>& sleeping, absl::Duration spin,
                        absl::Duration timeout) {
  const absl::Time start = absl::Now();
  const absl::Time spin_until = start + spin;
  uint32_t now = word.load(std::memory_order_acquire);
  for (int i = 0; now == value; ++i) {
    CpuRelax();
    now = word.load(std::memory_order_acquire);
    // Reading the clock costs more than a pause: only every few rounds.
    if ((i & 63) == 63 && absl::Now() >= spin_until) break;
  }
  if (now != value) return now;
  // Announce the sleep, then check again: a ringer that stored before seeing the announcement
  // is seen here, one that stored after sees it and wakes (both are sequentially consistent).
  sleeping.store(1, std::memory_order_seq_cst);
  now = word.load(std::memory_order_seq_cst);
  if (now == value) {
    FutexWait(word, value, start + timeout - absl::Now());
    now = word.load(std::memory_order_acquire);
  }
  sleeping.store(0, std::memory_order_relaxed);
  return now;
}

void StoreAndWake(std::atomic<uint32_t>& word, uint32_t value, std::atomic<uint32_t>& sleeping) {
  word.store(value, std::memory_order_seq_cst);
  if (sleeping.load(std::memory_order_seq_cst) != 0) FutexWakeAll(word);
}

void IncrementAndWake(std::atomic<uint32_t>& word, std::atomic<uint32_t>& sleeping) {
  word.fetch_add(1, std::memory_order_seq_cst);
  if (sleeping.load(std::memory_order_seq_cst) != 0) FutexWakeAll(word);
}

}  // namespace kvpool::server
