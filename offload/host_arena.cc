#include "offload/host_arena.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <numa.h>
#include <numaif.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/status.h"

// Older libc headers may lack these; the values are the kernel's ABI.
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
#ifndef MFD_HUGE_2MB
#define MFD_HUGE_2MB (21U << 26)
#endif

namespace kvtier {
namespace {

constexpr char kDefaultName[] = "kvtier-arena";
constexpr size_t kMaxMemfdName = 249;  // memfd_create's limit, excluding the NUL

size_t BasePageBytes() { return static_cast<size_t>(sysconf(_SC_PAGESIZE)); }

size_t RoundUp(size_t x, size_t multiple) { return (x + multiple - 1) / multiple * multiple; }

// An errno as a Status with `what` in front. Running out of memory or of descriptors is
// RESOURCE_EXHAUSTED (abseil's mapping of ENOMEM, ENOSPC, EMFILE, ENFILE).
absl::Status SysError(int err, const std::string& what) { return absl::ErrnoToStatus(err, what); }

// Maps `bytes` of `fd` MAP_SHARED at a kHugePageBytes-aligned address: every process that maps
// the arena then sees offsets aligned within it (session regions, hugepages) aligned in its
// own address space too (at a larger page's alignment when the file's pages are larger).
// Reserves bytes + alignment, maps the file over the aligned part and
// returns the slack. `populate` fills the page tables now (MAP_POPULATE): right for a mapping
// of an arena that already holds its memory (Map), wrong for a new one that must first be
// bound to its NUMA node (Create). MAP_FAILED with errno set on failure.
// `page` is the file's page size: a hugetlbfs with pages larger than 2 MiB needs its own.
void* MapShared(int fd, size_t bytes, bool populate, size_t page = HostArena::kHugePageBytes) {
  const size_t kAlign = std::max(HostArena::kHugePageBytes, page);
  void* reserved =
      mmap(nullptr, bytes + kAlign, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (reserved == MAP_FAILED) return MAP_FAILED;
  const auto start = reinterpret_cast<uintptr_t>(reserved);
  const uintptr_t aligned = RoundUp(start, kAlign);
  void* data = mmap(reinterpret_cast<void*>(aligned), bytes, PROT_READ | PROT_WRITE,
                    MAP_SHARED | MAP_FIXED | (populate ? MAP_POPULATE : 0), fd, 0);
  if (data == MAP_FAILED) {
    const int err = errno;
    munmap(reserved, bytes + kAlign);
    errno = err;
    return MAP_FAILED;
  }
  if (aligned > start) munmap(reserved, aligned - start);
  const uintptr_t end = aligned + bytes;
  const uintptr_t reserved_end = start + bytes + kAlign;
  if (reserved_end > end) munmap(reinterpret_cast<void*>(end), reserved_end - end);
  return data;
}

absl::Status ValidateBytes(size_t bytes) {
  if (bytes == 0 || bytes > HostArena::kMaxBytes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "arena size %d bytes: must be in [1, %d] (4 TiB)", bytes, HostArena::kMaxBytes));
  }
  return absl::OkStatus();
}

// One integer from a sysfs file, or nullopt when it cannot be read.
std::optional<int64_t> ReadSysfsInt(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "re");
  if (f == nullptr) return std::nullopt;
  long long value = 0;  // NOLINT(runtime/int): fscanf's type
  const bool ok = std::fscanf(f, "%lld", &value) == 1;
  std::fclose(f);
  return ok ? std::optional<int64_t>(value) : std::nullopt;
}

// Free 2 MiB hugepages on `node` (when >= 0 and its sysfs entry exists), else host-wide;
// 0 when the kernel has no 2 MiB hugepage pool.
int64_t FreeHugePages(int node) {
  if (node >= 0) {
    const std::optional<int64_t> on_node = ReadSysfsInt(absl::StrFormat(
        "/sys/devices/system/node/node%d/hugepages/hugepages-2048kB/free_hugepages", node));
    if (on_node) return *on_node;
  }
  return ReadSysfsInt("/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages").value_or(0);
}

// Why hugetlb pages cannot back the arena: the counts and the knob to turn.
std::string HugePageShortfall(const ArenaReport& r) {
  const std::string where = r.numa_node >= 0 ? absl::StrFormat(" on node %d", r.numa_node) : "";
  return absl::StrFormat(
      "%d free 2 MiB hugepages%s, %d needed for %d bytes; raise vm.nr_hugepages by at least "
      "%d (sysctl -w vm.nr_hugepages=..., or the node's nr_hugepages in "
      "/sys/devices/system/node/node*/hugepages/hugepages-2048kB)",
      r.free_hugepages, where, r.needed_hugepages, r.requested_bytes,
      r.needed_hugepages - r.free_hugepages);
}

int OpenMemfd(const std::string& name, bool hugetlb) {
  std::string memfd_name = name.empty() ? std::string(kDefaultName) : name;
  if (memfd_name.size() > kMaxMemfdName) memfd_name.resize(kMaxMemfdName);
  unsigned flags = MFD_CLOEXEC | MFD_ALLOW_SEALING;
  if (hugetlb) flags |= MFD_HUGETLB | MFD_HUGE_2MB;
  return memfd_create(memfd_name.c_str(), flags);
}

// Seals the size so no holder of the fd (a client) can truncate the arena under the daemon
// (a SIGBUS) or grow it; F_SEAL_SEAL stops anyone adding write seals later.
void Seal(int fd, ArenaReport& r) {
  if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) == 0) {
    r.sealed = true;
    return;
  }
  r.seal_note = absl::StrCat("F_ADD_SEALS failed (", std::strerror(errno),
                             "): clients could resize the arena file");
}

// The selected value of the shmem transparent-hugepage knob (memfd memory is shmem), e.g.
// "never" or "advise"; empty when the kernel has no such knob.
std::string ShmemThpSetting() {
  std::FILE* f = std::fopen("/sys/kernel/mm/transparent_hugepage/shmem_enabled", "re");
  if (f == nullptr) return "";
  char line[256] = {};
  const bool ok = std::fgets(line, sizeof(line), f) != nullptr;
  std::fclose(f);
  const char* open = ok ? std::strchr(line, '[') : nullptr;
  const char* close = open != nullptr ? std::strchr(open, ']') : nullptr;
  return close != nullptr ? std::string(open + 1, close) : "";
}

// Advises transparent hugepages for a base-page arena and records whether the kernel will
// honour the advice for shmem.
void AdviseHugePages(void* data, size_t bytes, ArenaReport& r) {
  const std::string setting = ShmemThpSetting();
  const bool honoured =
      setting == "advise" || setting == "always" || setting == "within_size" || setting == "force";
  r.transparent_hugepages = madvise(data, bytes, MADV_HUGEPAGE) == 0 && honoured;
  if (!r.transparent_hugepages) {
    absl::StrAppend(&r.hugepages_note, r.hugepages_note.empty() ? "" : "; ",
                    "no transparent hugepages either: shmem_enabled is \"", setting,
                    "\" (set /sys/kernel/mm/transparent_hugepage/shmem_enabled to advise)");
  }
}

// An open arena file: the fd, whether this Create made it, and its filesystem.
struct ArenaFile {
  int fd = -1;
  bool created = false;  // by this call (O_EXCL): removed again when Create fails
  bool hugetlbfs = false;
  size_t page_bytes = 0;  // the filesystem's page size
  size_t size = 0;        // st_size when opened
};

// Opens `path` read-write, creating it (0600) when absent. Two steps, so that Create knows
// whether the file is its own to remove on failure.
absl::StatusOr<ArenaFile> OpenArenaFile(const std::string& path) {
  ArenaFile f;
  for (int attempt = 0; attempt < 8 && f.fd < 0; ++attempt) {
    f.fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (f.fd >= 0) break;
    if (errno != ENOENT) break;
    f.fd = open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (f.fd >= 0) {
      f.created = true;
      break;
    }
    if (errno != EEXIST) break;  // EEXIST: another process made it meanwhile; open that
  }
  if (f.fd < 0) return SysError(errno, absl::StrCat("opening the arena file ", path));
  struct stat st {};
  struct statfs fs {};
  if (fstat(f.fd, &st) != 0 || fstatfs(f.fd, &fs) != 0) {
    const int err = errno;
    close(f.fd);
    if (f.created) unlink(path.c_str());
    return SysError(err, absl::StrCat("stat of the arena file ", path));
  }
  if (!S_ISREG(st.st_mode)) {
    close(f.fd);
    return absl::FailedPreconditionError(
        absl::StrCat("arena file ", path, " is not a regular file"));
  }
  // The arena's contents are trusted when mapped again: a file another user made (e.g. in
  // the shared /dev/shm, perhaps a symlink) is not the daemon's own arena.
  if (st.st_uid != geteuid()) {
    close(f.fd);
    return absl::FailedPreconditionError(
        absl::StrFormat("arena file %s is owned by uid %d, not by this process's uid %d; "
                        "remove it or give it to uid %d",
                        path, st.st_uid, geteuid(), geteuid()));
  }
  f.hugetlbfs = static_cast<uint64_t>(fs.f_type) == static_cast<uint64_t>(HUGETLBFS_MAGIC);
  f.page_bytes = f.hugetlbfs && fs.f_bsize > 0 ? static_cast<size_t>(fs.f_bsize) : BasePageBytes();
  f.size = st.st_size > 0 ? static_cast<size_t>(st.st_size) : 0;
  return f;
}

std::string LimitText(uint64_t bytes) {
  return bytes == UINT64_MAX ? "unlimited" : absl::StrFormat("%d bytes", bytes);
}

uint64_t MemlockLimit() {
  rlimit rl{};
  if (getrlimit(RLIMIT_MEMLOCK, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY) return UINT64_MAX;
  return static_cast<uint64_t>(rl.rlim_cur);
}

}  // namespace

std::vector<std::pair<size_t, size_t>> PlanRegistrationChunks(size_t bytes, size_t max_chunk) {
  KVTIER_CHECK(max_chunk > 0);
  std::vector<std::pair<size_t, size_t>> chunks;
  chunks.reserve(bytes / max_chunk + 1);
  for (size_t offset = 0; offset < bytes; offset += max_chunk) {
    chunks.emplace_back(offset, std::min(max_chunk, bytes - offset));
  }
  return chunks;
}

absl::StatusOr<std::unique_ptr<HostArena>> HostArena::Create(const ArenaOptions& options) {
  KVTIER_RETURN_IF_ERROR(ValidateBytes(options.bytes));
  ArenaReport report;
  report.name = options.name.empty() ? std::string(kDefaultName) : options.name;
  report.requested_bytes = options.bytes;
  report.hugepages_mode = options.hugepages;
  report.numa_node = options.numa_node;
  if (!options.path.empty()) return CreateFile(options, std::move(report));
  if (options.hugepages == HugePages::kOff) {
    report.hugepages_note = "not requested";
    return CreateWith(options, /*hugetlb=*/false, std::move(report));
  }
  report.needed_hugepages =
      static_cast<int64_t>(RoundUp(options.bytes, kHugePageBytes) / kHugePageBytes);
  report.free_hugepages = FreeHugePages(options.numa_node);
  if (report.free_hugepages < report.needed_hugepages) {
    report.hugepages_note = HugePageShortfall(report);
    if (options.hugepages == HugePages::kRequire) {
      return absl::ResourceExhaustedError(
          absl::StrCat("hugepages required but unavailable: ", report.hugepages_note));
    }
    return CreateWith(options, /*hugetlb=*/false, std::move(report));
  }
  absl::StatusOr<std::unique_ptr<HostArena>> arena = CreateWith(options, /*hugetlb=*/true, report);
  if (arena.ok()) return arena;
  if (options.hugepages == HugePages::kRequire) {
    return absl::Status(
        arena.status().code(),
        absl::StrFormat("hugepages required: %d free 2 MiB hugepages, %d needed, "
                        "but the hugetlb arena failed: %s",
                        report.free_hugepages, report.needed_hugepages, arena.status().message()));
  }
  // The pool looked big enough but the kernel refused (a race, a cgroup hugetlb limit).
  report.hugepages_note =
      absl::StrCat("hugetlb arena failed (", arena.status().message(), ") although ",
                   report.free_hugepages, " of ", report.needed_hugepages, " needed looked free");
  return CreateWith(options, /*hugetlb=*/false, std::move(report));
}

absl::StatusOr<std::unique_ptr<HostArena>> HostArena::CreateWith(const ArenaOptions& options,
                                                                 bool hugetlb, ArenaReport report) {
  report.hugetlb = hugetlb;
  report.page_bytes = hugetlb ? kHugePageBytes : BasePageBytes();
  report.mapped_bytes = RoundUp(options.bytes, report.page_bytes);
  const size_t bytes = report.mapped_bytes;
  const int fd = OpenMemfd(report.name, hugetlb);
  if (fd < 0) return SysError(errno, "memfd_create for the arena");
  // From here the arena owns fd (and later the mapping): every error path cleans up.
  std::unique_ptr<HostArena> arena(new HostArena(nullptr, 0, fd));
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    return SysError(errno, absl::StrFormat("sizing the arena memfd to %d bytes", bytes));
  }
  Seal(fd, report);
  arena->size_ = bytes;
  arena->report_ = std::move(report);
  KVTIER_RETURN_IF_ERROR(arena->MapAndPrepare(options, /*keep_contents=*/false));
  return arena;
}

absl::StatusOr<std::unique_ptr<HostArena>> HostArena::CreateFile(const ArenaOptions& options,
                                                                 ArenaReport report) {
  const std::string& path = options.path;
  KVTIER_ASSIGN_OR_RETURN(const ArenaFile file, OpenArenaFile(path));
  // From here the arena owns file.fd (and later the mapping).
  std::unique_ptr<HostArena> arena(new HostArena(nullptr, 0, file.fd));
  report.path = path;
  report.existed = file.size > 0;
  report.hugetlb = file.hugetlbfs;
  report.page_bytes = file.page_bytes;
  report.mapped_bytes = RoundUp(options.bytes, file.page_bytes);
  report.sealed = false;
  report.seal_note = "a file arena is not sealed";
  const size_t bytes = report.mapped_bytes;
  // A file this call made (or found empty) is removed (emptied) again on failure, so that
  // a later Create starts afresh instead of meeting a file of a wrong size.
  const auto fail = [&](absl::Status status) {
    if (report.existed) return status;
    if (file.created) {
      unlink(path.c_str());
    } else {
      (void)!ftruncate(file.fd, 0);
    }
    return status;
  };
  if (file.hugetlbfs) {
    report.needed_hugepages = static_cast<int64_t>(bytes / file.page_bytes);
    if (file.page_bytes == kHugePageBytes) report.free_hugepages = FreeHugePages(options.numa_node);
    if (options.hugepages == HugePages::kOff) {
      report.hugepages_note = "the file is on hugetlbfs: hugetlb pages although hugepages = off";
    }
  } else if (options.hugepages == HugePages::kRequire) {
    return fail(absl::FailedPreconditionError(absl::StrCat(
        "hugepages required but the arena file ", path,
        " is not on hugetlbfs; put it on a hugetlbfs mount (e.g. /dev/hugepages) or set "
        "hugepages to auto")));
  } else if (options.hugepages == HugePages::kOff) {
    report.hugepages_note = "not requested";
  } else {
    report.hugepages_note = absl::StrCat("the arena file ", path, " is not on hugetlbfs");
  }
  if (report.existed && file.size != bytes) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "arena file %s holds %d bytes, but this arena is %d bytes (%d requested, rounded up to "
        "%d-byte pages); the file is left as it is: restore the size the tenant had or remove "
        "the file (its sessions are lost)",
        path, file.size, bytes, options.bytes, file.page_bytes));
  }
  if (!report.existed && ftruncate(file.fd, static_cast<off_t>(bytes)) != 0) {
    return fail(SysError(errno, absl::StrFormat("sizing the arena file %s to %d bytes%s", path,
                                                bytes, file.hugetlbfs ? " on hugetlbfs" : "")));
  }
  arena->size_ = bytes;
  arena->report_ = std::move(report);
  absl::Status prepared = arena->MapAndPrepare(options, /*keep_contents=*/arena->report_.existed);
  if (!prepared.ok()) {
    if (!arena->report_.existed) {
      if (file.created) {
        unlink(path.c_str());
      } else {
        (void)!ftruncate(arena->fd_, 0);  // nothing touches the mapping any more
      }
    }
    std::string message = absl::StrCat("arena file ", path, ": ", prepared.message());
    const ArenaReport& r = arena->report_;
    if (r.hugetlb && r.free_hugepages >= 0) {
      absl::StrAppendFormat(&message,
                            " (on hugetlbfs: %d hugepages needed, %d free; raise vm.nr_hugepages)",
                            r.needed_hugepages, r.free_hugepages);
    }
    return absl::Status(prepared.code(), message);
  }
  return arena;
}

absl::Status HostArena::MapAndPrepare(const ArenaOptions& options, bool keep_contents) {
  void* data = MapShared(fd_, size_, /*populate=*/false, report_.page_bytes);
  if (data == MAP_FAILED) {
    return SysError(errno, absl::StrFormat("mmap of %d arena bytes%s", size_,
                                           report_.hugetlb ? " on hugetlb pages" : ""));
  }
  data_ = data;
  if (!report_.hugetlb && options.hugepages != HugePages::kOff) {
    AdviseHugePages(data_, size_, report_);
  }
  BindToNode(options);  // before the first touch, so pages land on the node
  KVTIER_RETURN_IF_ERROR(Prefault(keep_contents));
  if (options.lock) {
    Lock();
  } else {
    report_.lock_note = "not requested";
  }
  return absl::OkStatus();
}

void HostArena::BindToNode(const ArenaOptions& options) {
  ArenaReport& r = report_;
  const int node = options.numa_node;
  if (node < 0) {
    r.numa_note = "not requested (numa_node = -1)";
    return;
  }
  if (numa_available() < 0) {
    r.numa_note = "libnuma unavailable (numa_available() = -1: no NUMA support); not bound";
    return;
  }
  const int max_node = numa_max_node();
  if (node > max_node || numa_bitmask_isbitset(numa_all_nodes_ptr, node) == 0) {
    r.numa_note = absl::StrFormat(
        "node %d out of range: the host has %d NUMA node(s) with memory, highest %d; "
        "not bound",
        node, numa_num_configured_nodes(), max_node);
    return;
  }
  long long free_bytes = -1;  // NOLINT(runtime/int): libnuma's type
  numa_node_size64(node, &free_bytes);
  r.node_free_bytes = free_bytes;
  int mode = MPOL_BIND;
  // Hugetlb pages come from the node's own pool (checked already), not its free memory.
  if (!r.hugetlb && free_bytes >= 0 && static_cast<size_t>(free_bytes) < size_) {
    mode = MPOL_PREFERRED;  // binding would OOM-kill; let the excess spill to other nodes
    r.numa_note = absl::StrFormat(
        "node %d has %d free bytes < %d needed: preferred, not bound (the excess lands on "
        "other nodes)",
        node, free_bytes, size_);
  }
  bitmask* mask = numa_allocate_nodemask();
  numa_bitmask_setbit(mask, static_cast<unsigned>(node));
  const long rc = mbind(data_, size_, mode, mask->maskp, mask->size + 1, 0);  // NOLINT
  const int err = errno;
  numa_free_nodemask(mask);
  if (rc != 0) {
    r.numa_note =
        absl::StrFormat("mbind to node %d failed (%s); not bound", node, std::strerror(err));
    return;
  }
  r.numa_policy = mode == MPOL_BIND ? NumaPolicy::kBind : NumaPolicy::kPreferred;
}

absl::Status HostArena::Prefault(bool keep_contents) {
  int rc;
  do {
    rc = madvise(data_, size_, MADV_POPULATE_WRITE);
  } while (rc != 0 && errno == EINTR);
  if (rc == 0) {
    report_.prefault_method = "MADV_POPULATE_WRITE";
    report_.prefaulted = true;
    return absl::OkStatus();
  }
  const int err = errno;
  if (err != EINVAL) {  // EINVAL: a kernel before 5.14; anything else is a real failure
    const std::string what = absl::StrFormat("prefaulting %d arena bytes", size_);
    if (err == ENOMEM || err == EFAULT) {  // EFAULT: no hugetlb page left to fault in
      return absl::ResourceExhaustedError(absl::StrCat(what, ": ", std::strerror(err)));
    }
    return SysError(err, what);
  }
  // A kernel without MADV_POPULATE_WRITE: touch every page. A new arena is all zeros, so
  // writing a zero keeps it; an arena whose contents are kept is only read (which faults
  // the pages in too).
  volatile char* bytes = static_cast<volatile char*>(data_);
  if (keep_contents) {
    char sink = 0;
    for (size_t offset = 0; offset < size_; offset += report_.page_bytes) sink ^= bytes[offset];
    static_cast<void>(sink);
  } else {
    for (size_t offset = 0; offset < size_; offset += report_.page_bytes) bytes[offset] = 0;
  }
  report_.prefault_method = keep_contents ? "touch (read only)" : "touch";
  report_.prefaulted = true;
  return absl::OkStatus();
}

void HostArena::Lock() {
  report_.memlock_limit_bytes = MemlockLimit();
  if (mlock(data_, size_) == 0) {
    report_.locked = true;
    return;
  }
  const int err = errno;
  report_.lock_note = absl::StrFormat(
      "mlock of %d bytes failed (%s): RLIMIT_MEMLOCK is %s and the arena needs %d bytes; "
      "raise LimitMEMLOCK= in the systemd unit or `ulimit -l` (or grant CAP_IPC_LOCK)",
      size_, std::strerror(err), LimitText(report_.memlock_limit_bytes), size_);
}

absl::StatusOr<std::unique_ptr<HostArena>> HostArena::Map(int fd, size_t bytes) {
  KVTIER_RETURN_IF_ERROR(ValidateBytes(bytes));
  struct stat st {};
  if (fd < 0 || fstat(fd, &st) != 0) {
    return absl::InvalidArgumentError(absl::StrFormat("arena fd %d is not an open file", fd));
  }
  struct statfs fs {};
  const bool hugetlb = fstatfs(fd, &fs) == 0 && fs.f_type == HUGETLBFS_MAGIC;
  const size_t page =
      hugetlb ? std::max(kHugePageBytes, static_cast<size_t>(fs.f_bsize)) : BasePageBytes();
  const size_t mapped = RoundUp(bytes, page);
  if (st.st_size < 0 || static_cast<size_t>(st.st_size) < mapped) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "arena fd %d holds %d bytes; cannot map %d bytes (%d rounded up to %d-byte pages)", fd,
        st.st_size, mapped, bytes, page));
  }
  const int dup_fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (dup_fd < 0) return SysError(errno, absl::StrFormat("duplicating arena fd %d", fd));
  std::unique_ptr<HostArena> arena(new HostArena(nullptr, 0, dup_fd));
  void* data = MapShared(dup_fd, mapped, /*populate=*/true, page);
  if (data == MAP_FAILED) {
    return SysError(errno, absl::StrFormat("mmap of %d bytes of arena fd %d", mapped, fd));
  }
  arena->data_ = data;
  arena->size_ = mapped;
  ArenaReport& r = arena->report_;
  r.mapped_existing = true;
  r.name = absl::StrFormat("mapped fd %d", fd);
  r.requested_bytes = bytes;
  r.mapped_bytes = mapped;
  r.page_bytes = page;
  r.hugetlb = hugetlb;
  return arena;
}

HostArena::~HostArena() {
  if (data_ != nullptr) {
    (void)Unregister();  // before munmap: the device must stop using the pages first
    if (report_.locked) munlock(data_, size_);
    munmap(data_, size_);
  }
  if (fd_ >= 0) close(fd_);
}

absl::Status HostArena::RegisterWith(Backend& backend, size_t max_chunk) {
  if (registered_with_ != nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("arena \"", report_.name, "\" is already registered with ",
                     registered_with_->Describe(), "; Unregister() first"));
  }
  if (max_chunk == 0 || max_chunk > Backend::kMaxRegisterBytes) {
    return absl::InvalidArgumentError(absl::StrFormat("max_chunk %d bytes: must be in [1, %d]",
                                                      max_chunk, Backend::kMaxRegisterBytes));
  }
  const size_t page = report_.page_bytes;
  const size_t chunk = max_chunk >= page ? max_chunk / page * page : max_chunk;
  const std::vector<std::pair<size_t, size_t>> plan = PlanRegistrationChunks(size_, chunk);
  registered_with_ = &backend;
  for (size_t i = 0; i < plan.size(); ++i) {
    const auto [offset, length] = plan[i];
    absl::Status s = backend.RegisterHost(static_cast<char*>(data_) + offset, length);
    if (!s.ok()) {
      (void)Unregister();
      return absl::Status(
          s.code(),
          absl::StrFormat("registering arena bytes [%d, %d) (chunk %d of %d) with %s: %s", offset,
                          offset + length, i + 1, plan.size(), backend.Describe(), s.message()));
    }
    registered_.emplace_back(offset, length);
  }
  return absl::OkStatus();
}

absl::Status HostArena::Unregister() {
  absl::Status first;
  for (const auto& [offset, length] : registered_) {
    absl::Status s = registered_with_->UnregisterHost(static_cast<char*>(data_) + offset);
    if (first.ok() && !s.ok()) first = s;
  }
  registered_.clear();
  registered_with_ = nullptr;
  return first;
}

}  // namespace kvtier
