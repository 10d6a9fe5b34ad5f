#include "server/logging/request_context.h"

#include <string>
#include <thread>

#include "gtest/gtest.h"

namespace kvpool::server {
namespace {

TEST(RequestIdTest, AcceptsPrintableAsciiUpToTheBound) {
  EXPECT_TRUE(IsValidRequestId("a"));
  EXPECT_TRUE(IsValidRequestId("req-42_x.y:z/{\"q\"}~!"));
  EXPECT_TRUE(IsValidRequestId(std::string(kMaxRequestIdBytes, 'x')));
}

TEST(RequestIdTest, RefusesEmptyLongSpacesControlAndNonAscii) {
  EXPECT_FALSE(IsValidRequestId(""));
  EXPECT_FALSE(IsValidRequestId(std::string(kMaxRequestIdBytes + 1, 'x')));
  EXPECT_FALSE(IsValidRequestId("a b"));
  EXPECT_FALSE(IsValidRequestId("a\nb"));
  EXPECT_FALSE(IsValidRequestId(std::string("a\0b", 3)));
  EXPECT_FALSE(IsValidRequestId("a\x7f"));
  EXPECT_FALSE(IsValidRequestId("caf\xc3\xa9"));
}

TEST(RequestIdTest, KeepsAValidClientIdAndReplacesABadOne) {
  EXPECT_EQ(RequestIdFromClient("client-7"), "client-7");
  const std::string replaced = RequestIdFromClient("bad id\n");
  EXPECT_TRUE(IsValidRequestId(replaced));
  EXPECT_EQ(replaced.find("bad"), std::string::npos);
  EXPECT_TRUE(IsValidRequestId(RequestIdFromClient("")));
}

TEST(RequestIdTest, NewIdsAreValidAndDistinct) {
  const std::string a = NewRequestId();
  const std::string b = NewRequestId();
  EXPECT_EQ(a.size(), 32u);
  EXPECT_TRUE(IsValidRequestId(a));
  EXPECT_NE(a, b);
}

TEST(ScopedRequestIdTest, NestsAndRestores) {
  EXPECT_EQ(CurrentRequestId(), "");
  {
    ScopedRequestId outer("outer");
    EXPECT_EQ(CurrentRequestId(), "outer");
    {
      ScopedRequestId inner("inner");
      EXPECT_EQ(CurrentRequestId(), "inner");
    }
    EXPECT_EQ(CurrentRequestId(), "outer");
  }
  EXPECT_EQ(CurrentRequestId(), "");
}

TEST(ScopedRequestIdTest, IsPerThread) {
  ScopedRequestId scope("main");
  std::string seen = "unset";
  std::thread([&] { seen = std::string(CurrentRequestId()); }).join();
  EXPECT_EQ(seen, "");
  EXPECT_EQ(CurrentRequestId(), "main");
}

}  // namespace
}  // namespace kvpool::server
