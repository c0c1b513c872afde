#include "bench/host_memory.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <numeric>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "kernels/cpu/thread_pool.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define KVTIER_READ_AVX2 1
#else
#define KVTIER_READ_AVX2 0
#endif

namespace kvtier::bench {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;
constexpr int64_t kAssumedLlc = 32 * kMiB;

// "32768K" / "1M" / "512" (a sysfs cache size) in bytes; 0 when it does not parse.
int64_t ParseCacheSize(absl::string_view s) {
  s = absl::StripAsciiWhitespace(s);
  int64_t unit = 1;
  if (absl::ConsumeSuffix(&s, "K")) {
    unit = 1024;
  } else if (absl::ConsumeSuffix(&s, "M")) {
    unit = kMiB;
  }
  int64_t v = 0;
  return absl::SimpleAtoi(s, &v) && v > 0 ? v * unit : 0;
}

#if KVTIER_READ_AVX2
__attribute__((target("avx2"))) uint64_t ReadSumAvx2(const uint8_t* p, size_t n) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  size_t i = 0;
  for (; i + 128 <= n; i += 128) {
    a0 = _mm256_add_epi64(a0, _mm256_loadu_si256(reinterpret_cast<const __m256i_u*>(p + i)));
    a1 = _mm256_add_epi64(a1, _mm256_loadu_si256(reinterpret_cast<const __m256i_u*>(p + i + 32)));
    a2 = _mm256_add_epi64(a2, _mm256_loadu_si256(reinterpret_cast<const __m256i_u*>(p + i + 64)));
    a3 = _mm256_add_epi64(a3, _mm256_loadu_si256(reinterpret_cast<const __m256i_u*>(p + i + 96)));
  }
  const __m256i s = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), s);
  uint64_t sum = lanes[0] + lanes[1] + lanes[2] + lanes[3];
  for (; i < n; ++i) sum += p[i];
  return sum;
}
#endif

// The portable loop: eight independent 64-bit sums (the compiler vectorises it).
uint64_t ReadSumPortable(const uint8_t* p, size_t n) {
  uint64_t acc[8] = {};
  size_t i = 0;
  for (; i + 64 <= n; i += 64) {
    uint64_t w[8];
    std::memcpy(w, p + i, sizeof(w));
    for (int j = 0; j < 8; ++j) acc[j] += w[j];
  }
  uint64_t sum = 0;
  for (uint64_t a : acc) sum += a;
  for (; i < n; ++i) sum += p[i];
  return sum;
}

bool HaveAvx2() {
#if KVTIER_READ_AVX2
  static const bool have = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") != 0;
  }();
  return have;
#else
  return false;
#endif
}

}  // namespace

CacheInfo LastLevelCache() {
  // sysfs first: glibc's sysconf reports the whole package's L3 on some CPUs, not the
  // slice the calling core shares.
  int best_level = 0;
  int64_t best = 0;
  for (int i = 0; i < 16; ++i) {
    const std::string dir = absl::StrCat("/sys/devices/system/cpu/cpu0/cache/index", i, "/");
    std::ifstream level_in(dir + "level"), type_in(dir + "type"), size_in(dir + "size");
    if (!level_in) break;
    int level = 0;
    std::string type, size;
    level_in >> level;
    type_in >> type;
    size_in >> size;
    const int64_t bytes = ParseCacheSize(size);
    if (type != "Instruction" && bytes > 0 && level > best_level) {
      best_level = level;
      best = bytes;
    }
  }
  if (best > 0) return CacheInfo{best, absl::StrFormat("sysfs, L%d", best_level)};
#ifdef _SC_LEVEL3_CACHE_SIZE
  const long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
  if (l3 > 0) return CacheInfo{l3, "sysconf, L3"};
#endif
#ifdef _SC_LEVEL2_CACHE_SIZE
  const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
  if (l2 > 0) return CacheInfo{l2, "sysconf, L2"};
#endif
  return CacheInfo{kAssumedLlc, "assumed"};
}

uint64_t ReadSum(const void* p, size_t bytes) {
  const auto* b = static_cast<const uint8_t*>(p);
#if KVTIER_READ_AVX2
  if (HaveAvx2()) return ReadSumAvx2(b, bytes);
#endif
  return ReadSumPortable(b, bytes);
}

uint64_t ParallelReadSum(ThreadPool& pool, const void* p, size_t bytes) {
  const auto* base = static_cast<const uint8_t*>(p);
  const int64_t parts = int64_t{pool.num_threads()} * 8;
  const size_t part = (bytes / static_cast<size_t>(parts) + 4095) / 4096 * 4096;
  std::vector<uint64_t> sums(static_cast<size_t>(parts), 0);
  pool.ParallelFor(parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const size_t off = std::min(bytes, static_cast<size_t>(i) * part);
      sums[static_cast<size_t>(i)] = ReadSum(base + off, std::min(part, bytes - off));
    }
  });
  return std::accumulate(sums.begin(), sums.end(), uint64_t{0});
}

}  // namespace kvtier::bench
