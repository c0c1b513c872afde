// ArenaReport::ToString: one line per aspect of the arena, saying what happened and, where
// an option was not honoured, why and what to change.
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "offload/host_arena.h"

namespace kvtier {
namespace {

const char* ModeName(HugePages mode) {
  switch (mode) {
    case HugePages::kOff:
      return "off";
    case HugePages::kAuto:
      return "auto";
    case HugePages::kRequire:
      return "require";
  }
  return "?";
}

std::string HugePagesLine(const ArenaReport& r) {
  if (r.hugetlb) {
    const std::string pages = r.page_bytes == HostArena::kHugePageBytes
                                  ? std::string("2 MiB")
                                  : absl::StrFormat("%d-byte", r.page_bytes);
    std::string line =
        absl::StrFormat("hugepages (%s): yes, %s hugetlb (%d needed, %d free)",
                        ModeName(r.hugepages_mode), pages, r.needed_hugepages, r.free_hugepages);
    if (!r.path.empty()) absl::StrAppend(&line, "; the arena file is on hugetlbfs");
    return line;
  }
  std::string line = absl::StrCat("hugepages (", ModeName(r.hugepages_mode), "): no");
  if (!r.hugepages_note.empty()) absl::StrAppend(&line, ": ", r.hugepages_note);
  if (r.transparent_hugepages) {
    absl::StrAppend(&line, "; base pages advised MADV_HUGEPAGE (transparent hugepages)");
  }
  return line;
}

std::string NumaLine(const ArenaReport& r) {
  switch (r.numa_policy) {
    case NumaPolicy::kBind:
      return absl::StrFormat("numa: bound to node %d (node free %d bytes)", r.numa_node,
                             r.node_free_bytes);
    case NumaPolicy::kPreferred:
      return absl::StrCat("numa: ", r.numa_note);
    case NumaPolicy::kNone:
      return absl::StrCat("numa: not bound: ", r.numa_note);
  }
  return "numa: ?";
}

std::string LockLine(const ArenaReport& r) {
  if (r.locked) {
    return r.memlock_limit_bytes == UINT64_MAX
               ? std::string("lock: locked (RLIMIT_MEMLOCK unlimited)")
               : absl::StrFormat("lock: locked (RLIMIT_MEMLOCK %d bytes)", r.memlock_limit_bytes);
  }
  return absl::StrCat("lock: not locked: ", r.lock_note);
}

std::string PrefaultLine(const ArenaReport& r) {
  std::string line =
      r.prefaulted ? absl::StrCat("prefault: ", r.prefault_method) : std::string("prefault: no");
  absl::StrAppend(&line, r.sealed ? "; sealed against shrink/grow"
                                  : absl::StrCat("; not sealed: ", r.seal_note));
  return line;
}

}  // namespace

std::string ArenaReport::ToString() const {
  std::string out = absl::StrFormat("arena \"%s\": %d bytes (requested %d), %d pages of %d bytes%s",
                                    name, mapped_bytes, requested_bytes,
                                    page_bytes == 0 ? 0 : mapped_bytes / page_bytes, page_bytes,
                                    mapped_existing ? ", mapped from an existing arena fd" : "");
  if (!path.empty()) {
    absl::StrAppend(&out, "\nfile: ", path,
                    existed ? " (existed: contents kept)" : " (created: new, zero-filled)");
  }
  if (mapped_existing) {
    absl::StrAppend(&out, "\nhugepages: ", hugetlb ? "yes, 2 MiB hugetlb" : "no");
    return out;  // the creator chose pages, binding and locking
  }
  for (const std::string& line :
       {HugePagesLine(*this), NumaLine(*this), LockLine(*this), PrefaultLine(*this)}) {
    absl::StrAppend(&out, "\n", line);
  }
  return out;
}

}  // namespace kvtier
