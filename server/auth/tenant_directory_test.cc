// The tenants-file parser and the lookups it serves: validation with precise messages, token
// hashes compared whole, certificate names, and the authentication rules on top.
#include "server/auth/tenant_directory.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "server/auth/authenticate.h"
#include "server/auth/token_hash.h"

namespace kvpool::server {
namespace {

std::string Entry(const std::string& name, const std::string& role, const std::string& token,
                  const std::string& cert = "") {
  std::string e = absl::StrCat("tenant { name: \"", name, "\" role: ", role);
  if (!token.empty()) absl::StrAppend(&e, " token_sha256: \"", HexOf(Sha256Of(token)), "\"");
  if (!cert.empty()) absl::StrAppend(&e, " certificate_name: \"", cert, "\"");
  return e + " }\n";
}

std::shared_ptr<const TenantDirectory> Parsed(const std::string& text) {
  auto d = TenantDirectory::Parse(text, "t.txtpb");
  EXPECT_TRUE(d.ok()) << d.status();
  return d.ok() ? *d : nullptr;
}

void ExpectRejected(const std::string& text, const std::string& fragment) {
  auto d = TenantDirectory::Parse(text, "t.txtpb");
  ASSERT_FALSE(d.ok()) << text;
  EXPECT_TRUE(absl::IsInvalidArgument(d.status()));
  EXPECT_NE(d.status().message().find(fragment), std::string::npos)
      << d.status().message() << " lacks '" << fragment << "'";
  EXPECT_NE(d.status().message().find("t.txtpb"), std::string::npos);
}

TEST(TokenHashTest, KnownVectorAndHexRoundTrip) {
  EXPECT_EQ(HexOf(Sha256Of("test")),
            "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08");
  auto d = DigestFromHex("9F86D081884C7D659A2FEAA0C55AD015A3BF4F1B2B0B822CD15D6C15B0F00A08");
  ASSERT_TRUE(d.ok());
  EXPECT_TRUE(DigestsEqual(*d, Sha256Of("test")));
  EXPECT_FALSE(DigestsEqual(*d, Sha256Of("tesT")));
  EXPECT_FALSE(DigestFromHex("abc").ok());
  EXPECT_FALSE(DigestFromHex(std::string(63, 'a') + "g").ok());
}

TEST(TenantDirectoryTest, ParsesTenantsAndLooksThemUp) {
  auto dir = Parsed(Entry("team-a", "ROLE_TENANT", "tok-a", "team-a.example") +
                    Entry("ops", "ROLE_ADMIN", "tok-ops") +
                    Entry("router.1", "ROLE_ROUTER", "", "router-cn"));
  ASSERT_NE(dir, nullptr);
  ASSERT_EQ(dir->tenants().size(), 3u);
  ASSERT_NE(dir->ByToken("tok-a"), nullptr);
  EXPECT_EQ(dir->ByToken("tok-a")->name, "team-a");
  EXPECT_EQ(dir->ByToken("tok-ops")->role, v1::ROLE_ADMIN);
  EXPECT_EQ(dir->ByToken("tok-b"), nullptr);
  EXPECT_EQ(dir->ByToken(""), nullptr);
  EXPECT_EQ(dir->ByToken(std::string(TenantDirectory::kMaxTokenBytes + 1, 'x')), nullptr);
  EXPECT_EQ(dir->ByCertificateName("router-cn")->name, "router.1");
  EXPECT_EQ(dir->ByCertificateName("router"), nullptr);
  EXPECT_EQ(dir->Find("ops")->role, v1::ROLE_ADMIN);
  EXPECT_EQ(dir->Find("nobody"), nullptr);
}

TEST(TenantDirectoryTest, RejectsBadFilesPrecisely) {
  ExpectRejected("tenant { name: ", "line 1");
  ExpectRejected("", "no tenant");
  ExpectRejected(Entry("bad name", "ROLE_TENANT", "t"), "name must match");
  ExpectRejected(Entry("", "ROLE_TENANT", "t"), "name must match");
  ExpectRejected(Entry(std::string(65, 'a'), "ROLE_TENANT", "t"), "name must match");
  ExpectRejected(Entry("a", "ROLE_TENANT", "t1") + Entry("a", "ROLE_TENANT", "t2"),
                 "duplicate name");
  ExpectRejected(Entry("a", "ROLE_UNSPECIFIED", "t"), "role must be");
  ExpectRejected("tenant { name: \"a\" role: ROLE_TENANT }", "no token_sha256");
  ExpectRejected("tenant { name: \"a\" role: ROLE_TENANT token_sha256: \"abcd\" }",
                 "64 hex characters");
  ExpectRejected(absl::StrCat("tenant { name: \"a\" role: ROLE_TENANT token_sha256: \"",
                              std::string(64, 'z'), "\" }"),
                 "not a hex digit");
  ExpectRejected(Entry("a", "ROLE_TENANT", "same") + Entry("b", "ROLE_TENANT", "same"),
                 "already tenant 'a'");
  ExpectRejected(Entry("a", "ROLE_TENANT", "", "cn") + Entry("b", "ROLE_TENANT", "", "cn"),
                 "certificate_name");
  ExpectRejected("tenant { name: \"a\" role: ROLE_TENANT certificate_name: \"x\\ny\" }",
                 "certificate_name");
  ExpectRejected("tenant { name: \"a\" rol: ROLE_TENANT }", "line 1");
}

TEST(AuthenticateTest, TokensCertificatesAndTheirConflicts) {
  auto dir = Parsed(Entry("a", "ROLE_TENANT", "tok-a", "cert-a") +
                    Entry("b", "ROLE_ADMIN", "tok-b", "cert-b"));
  ASSERT_NE(dir, nullptr);
  auto with = [](std::vector<std::string> auth, bool cert, std::vector<std::string> uris,
                 std::string cn) {
    PresentedCredentials c;
    c.authorization = std::move(auth);
    c.has_certificate = cert;
    c.uri_sans = std::move(uris);
    c.common_name = std::move(cn);
    return c;
  };
  auto ok = Authenticate(*dir, with({"Bearer tok-a"}, false, {}, ""));
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(ok->tenant, "a");
  EXPECT_EQ(Authenticate(*dir, with({"bearer tok-b"}, false, {}, ""))->role, v1::ROLE_ADMIN);
  // The URI SAN wins over the CN; the CN is used only without a kvpool URI.
  EXPECT_EQ(Authenticate(*dir, with({}, true, {"spiffe://x", "kvpool://tenant/cert-b"}, "cert-a"))
                ->tenant,
            "b");
  EXPECT_EQ(Authenticate(*dir, with({}, true, {"spiffe://x"}, "cert-a"))->tenant, "a");
  for (const PresentedCredentials& bad :
       {with({}, false, {}, ""), with({"Bearer nope"}, false, {}, ""),
        with({"Basic tok-a"}, false, {}, ""), with({"tok-a"}, false, {}, ""),
        with({"Bearer tok-a", "Bearer tok-a"}, false, {}, ""), with({}, true, {}, "cert-c"),
        with({"Bearer tok-a"}, true, {}, "cert-b"), with({}, false, {}, "cert-a")}) {
    const auto r = Authenticate(*dir, bad);
    EXPECT_TRUE(absl::IsUnauthenticated(r.status())) << r.status();
  }
  // A token of a tenant plus a certificate no tenant lists: the token decides.
  EXPECT_EQ(Authenticate(*dir, with({"Bearer tok-a"}, true, {}, "unlisted"))->tenant, "a");
}

}  // namespace
}  // namespace kvpool::server
