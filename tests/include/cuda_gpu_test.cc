// kvtier/cuda.h on a CUDA device, as an engine uses it: the native stream of a kvtier stream
// is the one kvtier enqueues on, and a kvtier stream adopted from the engine's native stream
// enqueues there. Observed two ways: work interleaved between kvtier (Device::Memset) and the
// engine (cudaMemsetAsync on the native handle) lands in program order, compared byte for
// byte with the same writes applied on the CPU; and kvtier's work is captured by a capture
// the engine begins on the native stream (it joins the engine's graph and does not run
// until that graph is launched). Public headers and the CUDA runtime only. Label gpu; skips
// itself without a device.
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "kvtier/cuda.h"
#include "kvtier/device.h"
#include "kvtier/geometry.h"
#include "kvtier/options.h"
#include "kvtier/sequence.h"

namespace kvtier {
namespace {

// Large enough that work on two unordered streams would overlap and show.
constexpr size_t kBytes = size_t{64} << 20;

// One write of the interleaved sequence: `value` into [offset, offset + bytes), by kvtier
// (Device::Memset on the kvtier stream) or by the engine (cudaMemsetAsync on the native one).
struct Write {
  bool by_kvtier;
  size_t offset;
  size_t bytes;
  int value;
};

const std::vector<Write>& Writes() {
  static const std::vector<Write> writes = {
      {true, 0, kBytes, 0x11},
      {false, kBytes / 4, kBytes / 2, 0x22},
      {true, kBytes / 2, kBytes / 8, 0x33},
      {false, 0, kBytes / 16, 0x44},
      {true, kBytes / 32, kBytes / 16, 0x55},
  };
  return writes;
}

// The CPU reference: the writes applied in program order.
std::vector<uint8_t> Reference() {
  std::vector<uint8_t> ref(kBytes, 0);
  for (const Write& w : Writes()) std::memset(ref.data() + w.offset, w.value, w.bytes);
  return ref;
}

class CudaStreamInteropTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (CudaDeviceCount() == 0) {
      GTEST_SKIP() << (CudaBackendBuilt() ? "no usable CUDA device"
                                          : "built without the CUDA backend");
    }
    absl::StatusOr<std::unique_ptr<Device>> device = CreateDevice(DeviceKind::kCuda);
    ASSERT_TRUE(device.ok()) << device.status();
    device_ = *std::move(device);
    absl::StatusOr<int> ordinal = CudaDeviceOrdinal(*device_);
    ASSERT_TRUE(ordinal.ok()) << ordinal.status();
    ordinal_ = *ordinal;
    ASSERT_EQ(cudaSetDevice(ordinal_), cudaSuccess);
    absl::StatusOr<DeviceBuffer> buffer = device_->Allocate(kBytes);
    ASSERT_TRUE(buffer.ok()) << buffer.status();
    buffer_ = *std::move(buffer);
  }

  // The interleaved writes on `stream` (kvtier's) and `native` (the engine's handle of it).
  void Interleave(Stream& stream, cudaStream_t native) {
    auto* base = buffer_.as<uint8_t>();
    for (const Write& w : Writes()) {
      if (w.by_kvtier) {
        ASSERT_TRUE(device_->Memset(stream, base + w.offset, w.value, w.bytes).ok());
      } else {
        ASSERT_EQ(cudaMemsetAsync(base + w.offset, w.value, w.bytes, native), cudaSuccess);
      }
    }
  }

  // The buffer's bytes, read on `stream` after everything enqueued there.
  std::vector<uint8_t> Download(Stream& stream) {
    std::vector<uint8_t> host(kBytes);
    EXPECT_TRUE(device_->Copy(stream, host.data(), buffer_.data(), kBytes).ok());
    EXPECT_TRUE(stream.Synchronize().ok());
    return host;
  }

  // Begins a capture on `native` (the engine's), has kvtier memset the first byte to
  // `value` on `stream`, and ends the capture: kvtier's memset must be the graph's one node
  // and must not have run. Launches the graph on `native`; then it has.
  void ExpectKvtierWorkCapturedByTheEngine(Stream& stream, cudaStream_t native, int value) {
    const uint8_t before = Download(stream)[0];
    ASSERT_NE(before, value);
    ASSERT_EQ(cudaStreamBeginCapture(native, cudaStreamCaptureModeRelaxed), cudaSuccess);
    const absl::Status memset = device_->Memset(stream, buffer_.data(), value, 1);
    cudaGraph_t graph = nullptr;
    ASSERT_EQ(cudaStreamEndCapture(native, &graph), cudaSuccess);
    ASSERT_TRUE(memset.ok()) << memset;
    size_t nodes = 0;
    ASSERT_EQ(cudaGraphGetNodes(graph, nullptr, &nodes), cudaSuccess);
    EXPECT_EQ(nodes, 1u);
    EXPECT_EQ(Download(stream)[0], before);  // captured, not run
    cudaGraphExec_t exec = nullptr;
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, native), cudaSuccess);
    EXPECT_EQ(Download(stream)[0], value);
    EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
    EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  }

  std::unique_ptr<Device> device_;
  int ordinal_ = -1;
  DeviceBuffer buffer_;
};

TEST_F(CudaStreamInteropTest, NativeStreamOfAKvtierStreamIsTheOneKvtierOrdersItsWorkOn) {
  std::unique_ptr<Stream> stream = device_->CreateStream().value();
  const absl::StatusOr<cudaStream_t> native = NativeCudaStream(*stream);
  ASSERT_TRUE(native.ok()) << native.status();
  ASSERT_NE(*native, nullptr);
  EXPECT_EQ(NativeCudaStream(*stream).value(), *native);  // stable
  int stream_device = -1;
  ASSERT_EQ(cudaStreamGetDevice(*native, &stream_device), cudaSuccess);
  EXPECT_EQ(stream_device, ordinal_);

  Interleave(*stream, *native);
  EXPECT_TRUE(Download(*stream) == Reference());
  ExpectKvtierWorkCapturedByTheEngine(*stream, *native, 0x66);
}

TEST_F(CudaStreamInteropTest, AdoptedEngineStreamRunsKvtierWorkInTheEnginesOrder) {
  cudaStream_t native = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&native, cudaStreamNonBlocking), cudaSuccess);
  {
    absl::StatusOr<std::unique_ptr<Stream>> adopted = AdoptCudaStream(*device_, native);
    ASSERT_TRUE(adopted.ok()) << adopted.status();
    Stream& stream = **adopted;
    EXPECT_EQ(NativeCudaStream(stream).value(), native);

    Interleave(stream, native);
    // Read on another kvtier stream, ordered by an event recorded on the adopted one.
    std::unique_ptr<Stream> reader = device_->CreateStream().value();
    std::unique_ptr<Event> done = device_->CreateEvent().value();
    ASSERT_TRUE(stream.Record(*done).ok());
    ASSERT_TRUE(reader->Wait(*done).ok());
    EXPECT_TRUE(Download(*reader) == Reference());

    ExpectKvtierWorkCapturedByTheEngine(stream, native, 0x77);
  }
  // The kvtier stream is gone; the engine's stream is not.
  EXPECT_EQ(cudaMemsetAsync(buffer_.data(), 0, kBytes, native), cudaSuccess);
  EXPECT_EQ(cudaStreamSynchronize(native), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(native), cudaSuccess);
}

TEST_F(CudaStreamInteropTest, AdoptedStreamServesAsALocalSequencesComputeStream) {
  cudaStream_t native = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&native, cudaStreamNonBlocking), cudaSuccess);
  {
    std::unique_ptr<Stream> adopted = AdoptCudaStream(*device_, native).value();
    Geometry g;
    g.num_layers = 2;
    g.num_q_heads = 4;
    g.num_kv_heads = 2;
    g.head_dim = 64;
    g.page_size = 16;
    g.dtype = DType::kF32;
    SequenceOptions o;
    o.max_tokens = 4096;
    o.compute_stream = adopted.get();
    absl::StatusOr<std::unique_ptr<LocalSequence>> seq = NewLocalSequence(g, o, *device_);
    ASSERT_TRUE(seq.ok()) << seq.status();
    EXPECT_EQ(&(*seq)->compute_stream(), adopted.get());
    const std::vector<float> rows(size_t{40} * g.num_kv_heads * g.head_dim, 0.5f);
    for (int32_t l = 0; l < g.num_layers; ++l) {
      ASSERT_TRUE((*seq)->Append(l, rows.data(), rows.data(), 40).ok());
    }
    EXPECT_TRUE((*seq)->Wait().ok());
  }
  EXPECT_EQ(cudaStreamDestroy(native), cudaSuccess);
}

TEST_F(CudaStreamInteropTest, AdoptCudaStreamRefusesTheDefaultStreams) {
  for (cudaStream_t s :
       {static_cast<cudaStream_t>(nullptr), cudaStreamLegacy, cudaStreamPerThread}) {
    const absl::StatusOr<std::unique_ptr<Stream>> adopted = AdoptCudaStream(*device_, s);
    EXPECT_EQ(adopted.status().code(), absl::StatusCode::kInvalidArgument) << adopted.status();
  }
}

}  // namespace
}  // namespace kvtier
