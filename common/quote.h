// Quoting untrusted text (ids, paths) in status messages: at most kMaxQuotedBytes of it, escaped,
// so a message stays short and printable whatever the client sent.
//
//   return absl::NotFoundError(absl::StrCat("no sequence ", Quote(id)));
//   // -> no sequence 'seq-1'   or   no sequence 'aaaa...aaaa' (1048576 bytes)
#pragma once

#include <string>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace kvpool {

inline constexpr size_t kMaxQuotedBytes = 64;

// `text` in single quotes with C escapes; longer text is cut to its first kMaxQuotedBytes bytes
// followed by "..." and the full length.
inline std::string Quote(absl::string_view text) {
  if (text.size() <= kMaxQuotedBytes) return absl::StrCat("'", absl::CHexEscape(text), "'");
  return absl::StrCat("'", absl::CHexEscape(text.substr(0, kMaxQuotedBytes)), "...' (", text.size(),
                      " bytes)");
}

}  // namespace kvpool
