// FUZZ_CHECK: a property a fuzz target asserts on every input. A violation prints the condition
// and aborts, which libFuzzer (and the replay driver's CTest run) reports as a crash.
//
//   FUZZ_CHECK(reparsed.ok(), reparsed.status().ToString());
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>

#define FUZZ_CHECK(cond, what)                                                              \
  do {                                                                                      \
    if (!(cond)) {                                                                          \
      std::fprintf(stderr, "%s:%d: FUZZ_CHECK(%s) failed: %s\n", __FILE__, __LINE__, #cond, \
                   std::string(what).c_str());                                              \
      std::abort();                                                                         \
    }                                                                                       \
  } while (false)
