// How the CUDA kernels report data-dependent errors (an item index out of range) without a
// host synchronisation on the decode path.
//
// Every CudaStream owns one DeviceErrorRecord in mapped pinned host memory and a 4-byte
// claim word in device memory. A kernel that finds a bad item skips it, and the first
// thread that wins atomicCAS(claim, 0, 1) fills the record and publishes it by writing
// op_seq last. The host never waits for this: Stream::Synchronize and Event::Wait read the
// record after the work they waited for has completed (docs/architecture.md#errors-and-integrity). Only the first
// failure of a stream is recorded; it is sticky.
//
// Plain structs shared by host code and kernels; no CUDA includes.
#ifndef KVTIER_KERNELS_CUDA_DEVICE_ERROR_H_
#define KVTIER_KERNELS_CUDA_DEVICE_ERROR_H_

#include <cstdint>

namespace kvtier::cuda {

// Which op failed.
enum class KernelOp : int32_t {
  kRecall = 1,
  kOffload = 2,
  kGatherSlabs = 3,
  kScatterSlabs = 4,
  kScorePages = 5,
  kTopK = 6,
  kQueryCosine = 7,
  kReplace = 8,
  kSparseAttention = 9,
  kDenseAttention = 10,
  // 11 was QuantizeSlots (INT8 storage, removed).
  kMoveHeadSlots = 12,
  kSelectionLoss = 13,
};

// Which field of the failing item was out of range.
enum class ItemField : int32_t {
  kHostPage = 1,
  kKvHead = 2,
  kDstSlot = 3,
  kSrcSlot = 4,
  kSummaryPage = 5,
  // Fields of the arithmetic ops' arrays (item = the array index; the range is [0, limit),
  // so an inclusive bound b is reported as limit b + 1).
  kNumPages = 6,      // num_pages[b]
  kHeadK = 7,         // head_k[b·Hkv + h]
  kSelectedPage = 8,  // selected[...]: a page with no host page (host_page_of < 0)
  kPartialLen = 9,    // partial_len[b]
  kSlotTable = 10,    // slot_table[i]: a page ≥ 0 or -1
  kSeqLen = 11,       // seq_len[b]
  kSlot = 12,         // items[i].slot / src_slot / dst_slot of the policy ops
  kCurrentPage = 13,  // current[...] of SelectionLoss: a page or kEmptySlot
  kFreshPage = 14,    // fresh[...] of SelectionLoss: a page or kEmptySlot
};

struct DeviceErrorRecord {
  uint64_t op_seq;  // 0: no failure; else the stream's sequence number of the failing op
  int32_t op;       // KernelOp
  int32_t field;    // ItemField
  int64_t item;     // index into the op's items
  int64_t value;    // the offending value
  int64_t limit;    // the valid range is [0, limit)
};

// What a kernel launch carries to report a failure.
struct DeviceErrorSink {
  int32_t* claim;             // device memory; 0 until the first failure
  DeviceErrorRecord* record;  // device view of the stream's mapped host record
  uint64_t op_seq;            // this op's sequence number on its stream (≥ 1)
};

}  // namespace kvtier::cuda

#endif  // KVTIER_KERNELS_CUDA_DEVICE_ERROR_H_
