// JSON string escaping, shared by the daemon's JSON logs and the benchmarks' reports.
#ifndef KVTIER_CORE_JSON_H_
#define KVTIER_CORE_JSON_H_

#include <string>
#include <string_view>

namespace kvtier {

// `text` escaped for the inside of a JSON string (quotes, backslashes, control characters).
std::string JsonEscape(std::string_view text);

}  // namespace kvtier

#endif  // KVTIER_CORE_JSON_H_
