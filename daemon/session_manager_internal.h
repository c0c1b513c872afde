// Internals of SessionManager (session_manager.h) shared by the sources that define it
// (session_manager.cc, session_admission.cc, session_open.cc, session_streams.cc,
// session_tiering.cc): strings as this abseil takes them, and client-supplied strings made
// safe for messages and logs.
#ifndef KVTIER_DAEMON_SESSION_MANAGER_INTERNAL_H_
#define KVTIER_DAEMON_SESSION_MANAGER_INTERNAL_H_

#include <string>
#include <string_view>

#include "absl/strings/escaping.h"
#include "absl/strings/string_view.h"

namespace kvtier::daemon::session_internal {

// This abseil's string_view is its own type, not std::string_view.
inline absl::string_view Sv(std::string_view s) { return absl::string_view(s.data(), s.size()); }

// A client-supplied string, safe to put in a message or a log line.
inline std::string Printable(std::string_view s) {
  constexpr size_t kMax = 64;
  std::string out = absl::CHexEscape(Sv(s.substr(0, kMax)));
  if (s.size() > kMax) out += "...";
  return out;
}

}  // namespace kvtier::daemon::session_internal

#endif  // KVTIER_DAEMON_SESSION_MANAGER_INTERNAL_H_
