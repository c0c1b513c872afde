#include "kernels/backend.h"

#include "core/status.h"

namespace kvtier {

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    Reset();
    device_ = other.device_;
    data_ = other.data_;
    bytes_ = other.bytes_;
    other.device_ = nullptr;
    other.data_ = nullptr;
    other.bytes_ = 0;
  }
  return *this;
}

void DeviceBuffer::Reset() {
  if (data_ != nullptr && device_ != nullptr) device_->Free(data_);
  device_ = nullptr;
  data_ = nullptr;
  bytes_ = 0;
}

absl::Status Device::CopyBatch(Stream& s, const CopyRange* ranges, size_t n) {
  if (n > 0 && ranges == nullptr) {
    return absl::InvalidArgumentError("CopyBatch: ranges must be non-null when n > 0");
  }
  for (size_t i = 0; i < n; ++i) {
    KVTIER_RETURN_IF_ERROR(Copy(s, ranges[i].dst, ranges[i].src, ranges[i].bytes));
  }
  return absl::OkStatus();
}

absl::Status Backend::BeginCapture(Stream&) {
  return absl::UnimplementedError("BeginCapture: this backend cannot capture streams");
}
absl::StatusOr<std::unique_ptr<Graph>> Backend::EndCapture(Stream&) {
  return absl::UnimplementedError("EndCapture: this backend cannot capture streams");
}

absl::Status Backend::ScorePages(Stream& s, const ScorePagesArgs& a) {
  KVTIER_RETURN_IF_ERROR(ValidateArgs(a));
  return DoScorePages(s, a);
}
absl::Status Backend::TopK(Stream& s, const TopKArgs& a) {
  KVTIER_RETURN_IF_ERROR(ValidateArgs(a));
  return DoTopK(s, a);
}
absl::Status Backend::QueryCosine(Stream& s, const QueryCosineArgs& a) {
  KVTIER_RETURN_IF_ERROR(ValidateArgs(a));
  return DoQueryCosine(s, a);
}
absl::Status Backend::SelectionLoss(Stream& s, const SelectionLossArgs& a) {
  KVTIER_RETURN_IF_ERROR(ValidateArgs(a));
  return DoSelectionLoss(s, a);
}
absl::Status Backend::Recall(Stream& s, const RecallArgs& a) {
  KVTIER_RETURN_IF_ERROR(ValidateArgs(a));
  return DoRecall(s, a);
}
absl::Status Backend::GatherSlabs(Stream& s, const GatherSlabsArgs& a) {
  KVTIER_RETURN_IF_ERROR(ValidateArgs(a));
  return DoGatherSlabs(s, a);
}
absl::Status Backend::ScatterSlabs(Stream& s, const ScatterSlabsArgs& a) {
  KVTIER_RETURN_IF_ERROR(ValidateArgs(a));
  return DoScatterSlabs(s, a);
}
absl::Status Backend::Replace(Stream& s, const ReplaceArgs& a) {
  KVTIER_RETURN_IF_ERROR(ValidateArgs(a));
  return DoReplace(s, a);
}
absl::Status Backend::Offload(Stream& s, const OffloadArgs& a) {
  KVTIER_RETURN_IF_ERROR(ValidateArgs(a));
  return DoOffload(s, a);
}
absl::Status Backend::SparseAttention(Stream& s, const SparseAttentionArgs& a) {
  KVTIER_RETURN_IF_ERROR(ValidateArgs(a));
  return DoSparseAttention(s, a);
}
absl::Status Backend::DenseAttention(Stream& s, const DenseAttentionArgs& a) {
  KVTIER_RETURN_IF_ERROR(ValidateArgs(a));
  return DoDenseAttention(s, a);
}
absl::Status Backend::MoveHeadSlots(Stream& s, const MoveHeadSlotsArgs& a) {
  KVTIER_RETURN_IF_ERROR(ValidateArgs(a));
  return DoMoveHeadSlots(s, a);
}

}  // namespace kvtier
