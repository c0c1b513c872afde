// BatchShared: what the sequences of one decode batch share (docs/retriever.md#batches). A
// Retriever alone is a batch of one. Per layer, every buffer the ops batch over — the working
// set, its slot tables and counts, summaries, host-page maps, queries, scores, selections,
// recall plans, drift flags, policy inputs — is one backend allocation of max_batch
// sequences, contiguous, so one op launch covers a run of sequences in consecutive slots. The
// batch also owns the streams, the pinned staging ring of every small host↔device copy and
// the attention workspace. Everything is allocated when the batch and its sequences are
// created; nothing on the decode path allocates.
//
// Internal. Thread-compatible: one thread drives a batch and its sequences at a time.
#ifndef KVTIER_OFFLOAD_BATCH_SHARED_H_
#define KVTIER_OFFLOAD_BATCH_SHARED_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kvtier/geometry.h"
#include "kvtier/options.h"
#include "kvtier/sequence.h"
#include "offload/host_tier.h"
#include "offload/staging_ring.h"

namespace kvtier::retriever_internal {

// A layer's page counts, one row of max_batch entries each, read by the ops (ScorePages'
// num_pages, TopK's candidates, the attention's partial page). The host owns kLive rows
// (uploaded whole before a step from the batch's mirror); the device writes the kEnd rows,
// EndStep's snapshot for the background selection, which must not see later appends.
enum CountRow : int32_t {
  kFullPages = 0,   // full pages
  kCandidates = 1,  // full pages before the recent window: TopK's candidate end
  kPartialPage = 2,  // logical page being filled, or −1
  kPartialLen = 3,   // its tokens
  kLiveRows = 4,
  kFullAtEnd = 0,   // rows of the snapshot buffer
  kCandAtEnd = 1,
  kEndRows = 2,
};

// The buffers stored per sequence in batch storage.
enum class Field : uint8_t {
  kK, kV, kTable, kQCur, kQPrev, kSummaries, kPageOf, kPooled, kSelected, kItems, kNumMisses,
  kDrifted, kGroupMean, kFresh, kLostMass, kHeadK, kPageFlags, kTokenProb, kCodes,
};

class BatchShared {
 public:
  // `options`: the sequences' (with compute_stream, if any, used as the batch's). REQUIRES:
  // backend (and the compute stream) outlive the batch.
  static absl::StatusOr<std::shared_ptr<BatchShared>> Create(const Geometry& g,
                                                             const SequenceOptions& options,
                                                             Backend& backend, int32_t max_batch,
                                                             size_t ring_bytes);

  int32_t max_batch() const { return max_batch_; }
  Backend& backend() { return backend_; }
  Stream& compute() { return *compute_; }
  Stream& recall() { return *recall_; }
  Stream& xform_fg() { return *xform_fg_; }
  Stream& xform_bg() { return *xform_bg_; }
  Stream& dma() { return *dma_; }
  StagingRing& ring() { return *ring_; }

  // A free slot (lowest first), or RESOURCE_EXHAUSTED when max_batch sequences are in.
  absl::StatusOr<int32_t> TakeSlot();
  void FreeSlot(int32_t slot);

  // A non-owning view of `bytes` for `slot` of (layer, field): the first request of a
  // (layer, field) allocates max_batch × bytes; later ones must ask for the same bytes.
  absl::StatusOr<DeviceBuffer> View(int32_t layer, Field field, size_t bytes, int32_t slot);
  // Count rows of `layer` ([kLiveRows][max_batch] and [kEndRows][max_batch] int32).
  absl::Status EnsureCounts(int32_t layer);
  int32_t* live(int32_t layer, CountRow row, int32_t slot) {
    return layers_[layer].live.as<int32_t>() + row * max_batch_ + slot;
  }
  int32_t* end(int32_t layer, CountRow row, int32_t slot) {
    return layers_[layer].end.as<int32_t>() + row * max_batch_ + slot;
  }
  // The host mirror of the live rows; a sequence writes its column and marks it dirty.
  int32_t* mirror(int32_t layer, CountRow row, int32_t slot) {
    return &layers_[layer].mirror[static_cast<size_t>(row) * max_batch_ + slot];
  }
  void MarkCountsDirty(int32_t layer) { layers_[layer].dirty = true; }
  bool counts_dirty(int32_t layer) const { return layers_[layer].dirty; }
  // The live rows' bytes (kLiveRows × max_batch int32), which the caller uploads from the
  // mirror (row kFullPages, slot 0 is their start) after clearing the dirty mark.
  size_t counts_bytes() const { return sizeof(int32_t) * kLiveRows * max_batch_; }
  void ClearCountsDirty(int32_t layer) { layers_[layer].dirty = false; }

  // The attention workspace (null when the backend needs none), grown only by Reserve.
  void* workspace() const { return workspace_.data(); }
  size_t workspace_bytes() const { return workspace_.size(); }
  absl::Status ReserveWorkspace(size_t bytes);

  // The host tier whose pool every member's pages come from (NewSequenceBatch), kept alive
  // as long as a member is.
  void set_host(std::unique_ptr<HostTier> host) { host_ = std::move(host); }
  HostTier* host() { return host_.get(); }

  // The SequenceBatch object of the members (null for a sequence alone, or once it is gone).
  void set_owner(SequenceBatch* owner) { owner_ = owner; }
  SequenceBatch* owner() const { return owner_; }

 private:
  BatchShared(Backend& backend, int32_t max_batch, int32_t num_layers)
      : backend_(backend), max_batch_(max_batch), layers_(num_layers), used_(max_batch, false) {}
  struct Stored {
    DeviceBuffer storage;
    size_t bytes = 0;  // per sequence
  };
  struct Layer {
    std::map<Field, Stored> fields;
    DeviceBuffer live, end;
    std::vector<int32_t> mirror;
    bool dirty = true;
  };

  Backend& backend_;
  const int32_t max_batch_;
  std::vector<Layer> layers_;
  std::vector<bool> used_;
  std::unique_ptr<HostTier> host_;
  SequenceBatch* owner_ = nullptr;
  std::unique_ptr<StagingRing> ring_;
  DeviceBuffer workspace_;
  // Streams last: destroyed first, running their queued work while the buffers still exist.
  std::unique_ptr<Stream> own_compute_;
  Stream* compute_ = nullptr;
  std::unique_ptr<Stream> recall_, xform_fg_, xform_bg_, dma_;
};

// A batch object over `shared` (offload/sequence_batch.cc), through which a member steps:
// `owner` (the batch of one of a sequence made alone: Retriever::Create, NewLocalSequence)
// registers it as the members' batch; otherwise it is a member's own, for when the batch
// object that made it is gone. Every local sequence steps through SequenceBatch alone.
std::unique_ptr<SequenceBatch> NewBatchObject(const Geometry& g, const SequenceOptions& o,
                                              Backend& backend, std::shared_ptr<BatchShared> shared,
                                              bool owner);

}  // namespace kvtier::retriever_internal

#endif  // KVTIER_OFFLOAD_BATCH_SHARED_H_
