// HostArena: one memfd-backed MAP_SHARED mapping that holds a tenant's host tier
// (docs/architecture.md#processes, docs/architecture.md#errors-and-integrity). The daemon creates
// it — on 2 MiB hugepages when the host has them, bound to a NUMA node, prefaulted and locked — and
// passes fd() to local clients, which map the same memory with Map(). The memfd is sealed against
// shrinking and growing, so a client cannot truncate it under the daemon.
//
// With ArenaOptions::path the arena is a file on tmpfs or hugetlbfs instead, whose contents
// outlive the daemon: a restarted daemon's Create maps the same bytes again (and never
// writes, truncates or grows an existing file). A file is not sealed.
//
// Every choice the host could limit (hugepages, NUMA binding, mlock) is best effort unless
// the options require it, and report() says what happened and what to change.
//
// Registration with a device (pinning for DMA) goes through Backend::RegisterHost in
// chunks of at most Backend::kMaxRegisterBytes; the arena unregisters in its destructor.
//
// Thread-compatible: data(), size(), fd() and report() are immutable and may be read from
// any thread; RegisterWith and Unregister must not run concurrently with each other.
#ifndef KVTIER_OFFLOAD_HOST_ARENA_H_
#define KVTIER_OFFLOAD_HOST_ARENA_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace kvtier {

enum class HugePages : uint8_t {
  kOff = 0,      // normal pages, no transparent-hugepage advice
  kAuto = 1,     // 2 MiB hugetlb pages when enough are free, else normal pages with
                 // MADV_HUGEPAGE (transparent hugepages)
  kRequire = 2,  // 2 MiB hugetlb pages or RESOURCE_EXHAUSTED
};

struct ArenaOptions {
  size_t bytes = 0;  // in (0, HostArena::kMaxBytes]; rounded up to the page size used
  std::string name;  // memfd name (visible in /proc/<pid>/fd); empty: "kvtier-arena"
  HugePages hugepages = HugePages::kAuto;
  int numa_node = -1;  // OS index of the node to bind to; -1: no binding
  bool lock = true;    // mlock the mapping (best effort)
  // A file to map instead of a memfd (tmpfs or hugetlbfs): created with `bytes` when absent,
  // mapped as it is when present; empty: an anonymous memfd. See HostArena::Create. (The
  // initializer keeps designated initializers that leave it out free of warnings.)
  std::string path = "";
};

enum class NumaPolicy : uint8_t {
  kNone = 0,       // not bound (not asked, or not possible: see numa_note)
  kBind = 1,       // MPOL_BIND to the node
  kPreferred = 2,  // MPOL_PREFERRED: the node had less free memory than the arena needs
};

// What Create or Map did, and what limited it. Each `*_note` is empty when the option was
// honoured in full, and otherwise says why not and what to change.
struct ArenaReport {
  std::string name;
  std::string path;      // the arena file (ArenaOptions::path); empty: an anonymous memfd
  bool existed = false;  // the file was there: its contents were kept
  size_t requested_bytes = 0;
  size_t mapped_bytes = 0;       // requested_bytes rounded up to page_bytes
  size_t page_bytes = 0;         // 2 MiB with hugetlb, else the base page size
  bool mapped_existing = false;  // made by Map(): no hugepage choice, binding or locking

  HugePages hugepages_mode = HugePages::kAuto;
  bool hugetlb = false;                // backed by 2 MiB hugetlb pages
  bool transparent_hugepages = false;  // normal pages advised with MADV_HUGEPAGE
  int64_t free_hugepages = -1;         // free 2 MiB hugepages seen (-1: not looked)
  int64_t needed_hugepages = 0;        // 2 MiB hugepages the arena needs
  std::string hugepages_note;

  int numa_node = -1;  // as requested
  NumaPolicy numa_policy = NumaPolicy::kNone;
  int64_t node_free_bytes = -1;  // numa_node_size64's free memory of the node (-1: unknown)
  std::string numa_note;

  bool locked = false;
  uint64_t memlock_limit_bytes = 0;  // RLIMIT_MEMLOCK soft limit; UINT64_MAX: unlimited
  std::string lock_note;

  bool prefaulted = false;
  std::string prefault_method;  // "MADV_POPULATE_WRITE" or "touch"
  bool sealed = false;          // F_SEAL_SHRINK | F_SEAL_GROW applied (never for a file)
  std::string seal_note;

  // Several lines, one per aspect, e.g.
  //   arena "t0": 8388608 bytes (requested 8000000), 4 pages of 2097152 bytes
  //   hugepages: yes, 2 MiB hugetlb (4 needed, 512 free)
  //   numa: bound to node 1 (node free 101234688 bytes)
  //   lock: locked (RLIMIT_MEMLOCK unlimited)
  //   prefault: MADV_POPULATE_WRITE; sealed against shrink/grow
  // and, for a file arena, a second line
  //   file: /dev/shm/kvtier-a.arena (existed: contents kept)
  std::string ToString() const;
};

// The (offset, length) byte ranges that cover [0, bytes) in order, each at most
// `max_chunk` bytes, all but the last exactly `max_chunk`. Empty when bytes == 0.
// REQUIRES: max_chunk > 0.
std::vector<std::pair<size_t, size_t>> PlanRegistrationChunks(size_t bytes, size_t max_chunk);

class HostArena {
 public:
  // Largest arena Create and Map accept: 4 TiB.
  static constexpr size_t kMaxBytes = size_t{1} << 42;
  static constexpr size_t kHugePageBytes = size_t{2} << 20;

  // Creates, sizes, seals, maps, binds, prefaults and locks a new arena. Errors:
  // INVALID_ARGUMENT for bytes == 0 or > kMaxBytes; RESOURCE_EXHAUSTED (with the byte or
  // page counts) when memory or file descriptors run out, or when hugepages are required
  // and not enough are free. Binding and locking are best effort: see report().
  //
  // With options.path set the arena is that file, opened O_RDWR | O_CREAT (mode 0600), so its
  // contents outlive the process (put it on tmpfs or hugetlbfs). Its page size is its
  // filesystem's: f_bsize on hugetlbfs (report().hugetlb), else the base page size. A new
  // (empty) file is sized to `bytes` rounded up to that page size and prefaulted; an existing
  // one is mapped as it is, and Create never writes, truncates or grows it: another size is
  // FAILED_PRECONDITION naming the path and both sizes, and report().existed says its
  // contents were kept. hugepages: hugetlb is what the filesystem gives; kRequire with a file
  // that is not on hugetlbfs is FAILED_PRECONDITION; kAuto elsewhere advises MADV_HUGEPAGE. A
  // file is not sealed; a file that is not a regular file, or not owned by this process's
  // effective uid, is FAILED_PRECONDITION. When Create fails after creating the file, it
  // removes it again.
  // Errors opening it are the errno's (PERMISSION_DENIED, NOT_FOUND for a missing
  // directory, ...) naming the path.
  static absl::StatusOr<std::unique_ptr<HostArena>> Create(const ArenaOptions& options);

  // Maps `bytes` of an existing arena file (e.g. a HostArena's fd() received over a Unix
  // socket). Duplicates `fd`; the caller keeps its own. INVALID_ARGUMENT for a bad fd, for
  // bytes == 0 or > kMaxBytes, or when the file holds fewer than `bytes` (rounded up to its
  // page size); RESOURCE_EXHAUSTED when the mapping fails for lack of memory.
  static absl::StatusOr<std::unique_ptr<HostArena>> Map(int fd, size_t bytes);

  HostArena(const HostArena&) = delete;
  HostArena& operator=(const HostArena&) = delete;
  // Unregisters from the backend (REQUIRES: it is still alive), then munlock, munmap, close.
  ~HostArena();

  // The mapping starts kHugePageBytes-aligned (Create and Map alike), so an offset aligned
  // within the arena (up to 2 MiB) is aligned in every process that maps it.
  void* data() const { return data_; }
  size_t size() const { return size_; }  // bytes mapped (report().mapped_bytes)
  int fd() const { return fd_; }         // owned by the arena; dup it to keep it longer
  const ArenaReport& report() const { return report_; }

  // Registers the whole mapping with `backend` in chunks of at most `max_chunk` bytes
  // (rounded down to a multiple of the page size when it is at least one page). On failure
  // the chunks already registered are unregistered again. FAILED_PRECONDITION when already
  // registered; INVALID_ARGUMENT unless 0 < max_chunk <= Backend::kMaxRegisterBytes.
  // REQUIRES: `backend` outlives the registration (Unregister or the destructor).
  absl::Status RegisterWith(Backend& backend, size_t max_chunk = Backend::kMaxRegisterBytes);
  // Unregisters every chunk; OK when nothing is registered. Returns the first error and
  // still tries every chunk.
  absl::Status Unregister();
  // (offset, length) of each registered chunk, in registration order.
  const std::vector<std::pair<size_t, size_t>>& registered_chunks() const { return registered_; }

 private:
  HostArena(void* data, size_t size, int fd) : data_(data), size_(size), fd_(fd) {}

  static absl::StatusOr<std::unique_ptr<HostArena>> CreateWith(const ArenaOptions& options,
                                                               bool hugetlb, ArenaReport report);
  static absl::StatusOr<std::unique_ptr<HostArena>> CreateFile(const ArenaOptions& options,
                                                               ArenaReport report);
  // Maps, advises, binds, prefaults and locks size_ bytes of fd_ (data_ still null).
  // keep_contents: the arena holds data already, so the fallback touch only reads.
  absl::Status MapAndPrepare(const ArenaOptions& options, bool keep_contents);
  absl::Status Prefault(bool keep_contents);
  void BindToNode(const ArenaOptions& options);
  void Lock();

  void* data_;
  size_t size_;
  int fd_;
  ArenaReport report_;
  Backend* registered_with_ = nullptr;
  std::vector<std::pair<size_t, size_t>> registered_;
};

}  // namespace kvtier

#endif  // KVTIER_OFFLOAD_HOST_ARENA_H_
