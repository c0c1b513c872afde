#include "offload/batch_shared.h"


#include "absl/strings/str_format.h"
#include "core/status.h"

namespace kvtier::retriever_internal {

absl::StatusOr<std::shared_ptr<BatchShared>> BatchShared::Create(const Geometry& g,
                                                                 const SequenceOptions& options,
                                                                 Backend& backend,
                                                                 int32_t max_batch,
                                                                 size_t ring_bytes) {
  if (max_batch < 1 || max_batch > 4096) {
    return absl::InvalidArgumentError(
        absl::StrFormat("batch: max_batch = %d must be in [1, 4096]", max_batch));
  }
  std::shared_ptr<BatchShared> b(new BatchShared(backend, max_batch, g.num_layers));
  if (options.compute_stream != nullptr) {
    b->compute_ = options.compute_stream;
  } else {
    KVTIER_ASSIGN_OR_RETURN(b->own_compute_, backend.CreateStream());
    b->compute_ = b->own_compute_.get();
  }
  // Background work runs at low priority so it yields to attention.
  KVTIER_ASSIGN_OR_RETURN(b->recall_, backend.CreateStream(StreamPriority::kLow));
  KVTIER_ASSIGN_OR_RETURN(b->xform_fg_, backend.CreateStream());
  KVTIER_ASSIGN_OR_RETURN(b->xform_bg_, backend.CreateStream(StreamPriority::kLow));
  KVTIER_ASSIGN_OR_RETURN(b->dma_, backend.CreateStream(StreamPriority::kLow));
  KVTIER_ASSIGN_OR_RETURN(b->ring_, StagingRing::Create(backend, ring_bytes));
  return b;
}

absl::StatusOr<int32_t> BatchShared::TakeSlot() {
  for (int32_t i = 0; i < max_batch_; ++i) {
    if (!used_[i]) {
      used_[i] = true;
      return i;
    }
  }
  return absl::ResourceExhaustedError(
      absl::StrFormat("batch: all %d sequence slots are taken (max_batch)", max_batch_));
}

void BatchShared::FreeSlot(int32_t slot) {
  if (slot >= 0 && slot < max_batch_) used_[slot] = false;
}

absl::StatusOr<DeviceBuffer> BatchShared::View(int32_t layer, Field field, size_t bytes,
                                               int32_t slot) {
  bytes = std::max<size_t>(bytes, 1);
  Stored& s = layers_[layer].fields[field];
  if (s.storage.data() == nullptr) {
    KVTIER_ASSIGN_OR_RETURN(s.storage, backend_.Allocate(bytes * max_batch_));
    s.bytes = bytes;
  } else if (s.bytes != bytes) {
    return absl::InternalError(absl::StrFormat(
        "batch: field %d of layer %d holds %d bytes per sequence, asked for %d", static_cast<int>(field),
        layer, s.bytes, bytes));
  }
  return DeviceBuffer(nullptr, s.storage.as<uint8_t>() + bytes * slot, bytes);
}

absl::Status BatchShared::EnsureCounts(int32_t layer) {
  Layer& l = layers_[layer];
  if (l.live.data() != nullptr) return absl::OkStatus();
  KVTIER_ASSIGN_OR_RETURN(l.live, backend_.Allocate(counts_bytes()));
  KVTIER_ASSIGN_OR_RETURN(l.end, backend_.Allocate(sizeof(int32_t) * kEndRows * max_batch_));
  l.mirror.assign(static_cast<size_t>(kLiveRows) * max_batch_, 0);
  for (int32_t b = 0; b < max_batch_; ++b) *mirror(layer, kPartialPage, b) = -1;
  KVTIER_RETURN_IF_ERROR(backend_.Memset(*compute_, l.end.data(), 0, l.end.size()));
  l.dirty = true;
  return absl::OkStatus();
}

absl::Status BatchShared::ReserveWorkspace(size_t bytes) {
  if (bytes <= workspace_.size()) return absl::OkStatus();
  // Outside any step (creation, or a managed layer's explicit growth): the old buffer may
  // still be read by queued attention, so wait for the stream before it goes.
  if (workspace_.data() != nullptr) KVTIER_RETURN_IF_ERROR(compute_->Synchronize());
  KVTIER_ASSIGN_OR_RETURN(workspace_, backend_.Allocate(bytes));
  return absl::OkStatus();
}

}  // namespace kvtier::retriever_internal
