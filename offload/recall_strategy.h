// Recall strategies (docs/architecture.md#backends): two ways of moving selected (page, KV head)
// slabs from the host tier (HND pages in registered host memory) into a layer's NHD working set,
// bit-exact and interchangeable:
//
//   kBatchedDma  the (page, head) K+V slabs (16 KiB at p = 32, d = 128, fp16) into a
//                double-buffered staging buffer, the plan sorted by host address, runs of
//                adjacent slabs merged into one range, and each chunk's ranges sent as one
//                batched copy (Backend::CopyBatch: cudaMemcpyBatchAsync where the runtime
//                has it); the HND → NHD transform (ScatterSlabs) of chunk n runs on a second
//                stream while chunk n+1 is copied (FreeKV's staging, with fewer copies).
//   kZeroCopy    one gather kernel (the Recall op) reads the registered host arena and
//                writes NHD in one pass; no staging, no copy engine.
//
// The DMA strategy needs the plan on the host (the copy engines are driven by the host);
// the zero-copy gather reads it wherever it is, so a plan made on the device never comes
// back. Which one a sequence uses is its step plan's (offload/step_plan.h): the one
// SequenceOptions names, or the gather, or batched_dma where the host must see the plan.
#ifndef KVTIER_OFFLOAD_RECALL_STRATEGY_H_
#define KVTIER_OFFLOAD_RECALL_STRATEGY_H_

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kvtier/geometry.h"
#include "kvtier/options.h"

namespace kvtier {

// The concrete strategies (RecallStrategy of kvtier/options.h, kAuto aside).
inline constexpr std::array<RecallStrategy, 2> kRecallStrategies = {RecallStrategy::kBatchedDma,
                                                                    RecallStrategy::kZeroCopy};

// Where a recall reads and writes: the host tier's page area (host page i is the HND page at
// host_pages + i · host_page_bytes) and a working set of num_slots NHD slots.
struct RecallTarget {
  const void* host_pages = nullptr;
  int64_t num_host_pages = 0;
  void* k_cache = nullptr;  // [num_slots][p][Hkv][d]
  void* v_cache = nullptr;
  int32_t num_slots = 0;
};

// The zero-copy gather's (Recall op's) arguments: `n` items at `items` into `t`.
RecallArgs ZeroCopyRecallArgs(const Geometry& g, const RecallTarget& t, const RecallItem* items,
                              int32_t n);

// Executes recall plans held on the host with one strategy. Owns its staging buffers (two
// chunks), events and plan buffers (host memory registered with the backend, so kernels can
// read them), so one instance per layer keeps layers in flight from sharing anything.
//
// Thread-compatible. Not reentrant per instance: a plan buffer may be rewritten, and
// Enqueue called again, only once the previous recall has run (an event recorded on `drive`
// after Enqueue has fired, or a later stream waited on one).
class SlabRecaller {
 public:
  // INVALID_ARGUMENT for kAuto, max_items < 1 or chunk_items < 1.
  static absl::StatusOr<std::unique_ptr<SlabRecaller>> Create(Backend& backend, const Geometry& g,
                                                              RecallStrategy strategy,
                                                              int32_t max_items,
                                                              int32_t chunk_items);
  ~SlabRecaller();
  SlabRecaller(const SlabRecaller&) = delete;
  SlabRecaller& operator=(const SlabRecaller&) = delete;

  RecallStrategy strategy() const { return strategy_; }
  int32_t max_items() const { return max_items_; }
  // The plan buffer: max_items RecallItems in registered host memory. Write the plan here
  // (or copy a device plan into it) before Enqueue.
  RecallItem* plan() { return plan_; }

  // Enqueues the recall of plan()[0, n) into `t`. Skip items (host_page == kSkipItem) are
  // dropped; an item out of range is INVALID_ARGUMENT here for the DMA strategies (they read
  // the plan on the host) and fails the stream for kZeroCopy. Work starts on `drive` after
  // what was enqueued there before; when this returns, later work on `drive` runs after the
  // whole recall, transform included. `xform` runs the transforms of the DMA strategies.
  // Returns the number of copy ranges issued (DMA strategies; 0 for kZeroCopy).
  absl::StatusOr<int64_t> Enqueue(Stream& drive, Stream& xform, int32_t n, const RecallTarget& t);

 private:
  SlabRecaller(Backend& backend, const Geometry& g, RecallStrategy strategy, int32_t max_items,
               int32_t chunk_items);
  absl::Status Init();

  Backend& backend_;
  const Geometry g_;
  const RecallStrategy strategy_;
  const int32_t max_items_;
  const int32_t chunk_items_;
  // Page-aligned host buffers of max_items items each, registered with the backend (a
  // registration never shares a page with another): the caller's plan, and the plan in
  // staging order that ScatterSlabs reads.
  RecallItem* plan_ = nullptr;
  RecallItem* ordered_ = nullptr;
  size_t plan_bytes_ = 0;
  bool registered_[2] = {false, false};
  DeviceBuffer staging_[2];  // [chunk][2][p][d]
  std::unique_ptr<Event> staged_[2], freed_[2], done_;
  std::vector<CopyRange> ranges_;  // scratch
};

}  // namespace kvtier

#endif  // KVTIER_OFFLOAD_RECALL_STRATEGY_H_
