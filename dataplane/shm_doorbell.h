// Waiting on a 32-bit word of shared memory between processes (the shared-memory channel's
// doorbell and slot states, shm_wire.h): spin for a short while, the lowest latency for a decode
// worker's back-to-back calls, then block in the kernel (a futex on the shared word) so an idle
// channel burns no CPU.
//
// A waiter announces that it blocks through a `sleeping` word of its own; a ringer that changes
// the watched word issues the wake-up system call only when the waiter is (or may be) asleep, so
// a spinning pair makes no system calls at all.
//
//   // daemon
//   uint32_t seen = bell.load();
//   WaitWhileEqual(bell, seen, sleeping, absl::Microseconds(50), absl::Milliseconds(100));
//   // client
//   RingAfterStore(bell, bell.load() + 1, sleeping);
//
// The words are std::atomic<uint32_t> placed in the shared mapping (lock-free, address-free).
// Thread-safe.
#pragma once

#include <atomic>
#include <cstdint>

#include "absl/time/time.h"

namespace kvpool::server {

static_assert(std::atomic<uint32_t>::is_always_lock_free);
static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t));

// The word at `p` of a shared mapping (4-byte aligned).
inline std::atomic<uint32_t>* SharedWord(void* p) { return static_cast<std::atomic<uint32_t>*>(p); }

// Waits while *word == value: spins up to `spin`, then blocks (announcing it in *sleeping) until
// the word changes, a wake-up arrives or `timeout` (from the call) passes. Returns the word's
// value when it returns, which may still equal `value` (timeout, spurious wake-up).
uint32_t WaitWhileEqual(std::atomic<uint32_t>& word, uint32_t value,
                        std::atomic<uint32_t>& sleeping, absl::Duration spin,
                        absl::Duration timeout);

// Stores `value` into *word and wakes its waiter if it announced that it sleeps.
void StoreAndWake(std::atomic<uint32_t>& word, uint32_t value, std::atomic<uint32_t>& sleeping);
// Adds 1 to *word and wakes its waiter as StoreAndWake.
void IncrementAndWake(std::atomic<uint32_t>& word, std::atomic<uint32_t>& sleeping);

}  // namespace kvpool::server
