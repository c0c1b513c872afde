#include "daemon/cold_tier.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/status.h"

namespace kvtier::daemon {
namespace {

constexpr char kMagic[4] = {'K', 'V', 'T', 'C'};
constexpr uint16_t kVersion = 2;         // written: bound to its page (identity)
constexpr uint16_t kUnboundVersion = 1;  // read only: no identity, a 64-bit length

void PutLe(char* p, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) p[i] = static_cast<char>((v >> (8 * i)) & 0xff);
}
uint64_t GetLe(const char* p, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= uint64_t{static_cast<unsigned char>(p[i])} << (8 * i);
  return v;
}
// CRC-32C (Castagnoli), reflected polynomial 0x82F63B78: the SSE4.2 instruction where the
// CPU has it (about 8 bytes per 3 cycles, several GB/s: the checksum must not cost the cold
// tier a noticeable share of a network's throughput), a table otherwise.
constexpr uint32_t kCrc32cPoly = 0x82F63B78u;

struct Crc32cTable {
  uint32_t t[256];
  constexpr Crc32cTable() : t() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) != 0 ? (c >> 1) ^ kCrc32cPoly : c >> 1;
      t[i] = c;
    }
  }
};
constexpr Crc32cTable kCrc32cTable;

uint32_t Crc32cSoftware(const char* p, size_t n) {
  uint32_t c = 0xffffffffu;
  for (size_t i = 0; i < n; ++i) {
    c = kCrc32cTable.t[(c ^ static_cast<unsigned char>(p[i])) & 0xff] ^ (c >> 8);
  }
  return ~c;
}

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("sse4.2"))) uint32_t Crc32cSse42(const char* p, size_t n) {
  uint64_t c = 0xffffffffu;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    std::memcpy(&w, p + i, 8);
    c = __builtin_ia32_crc32di(c, w);
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  for (; i < n; ++i) c32 = __builtin_ia32_crc32qi(c32, static_cast<unsigned char>(p[i]));
  return ~c32;
}
bool HaveSse42() {
  static const bool have = __builtin_cpu_supports("sse4.2");
  return have;
}
#endif

uint32_t Crc32(const char* p, size_t n) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (HaveSse42()) return Crc32cSse42(p, n);
#endif
  return Crc32cSoftware(p, n);
}

bool ValidPrefix(std::string_view s) {
  if (s.empty() || s.size() > 32) return false;
  return std::all_of(s.begin(), s.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
           c == '_' || c == '.' || c == '-';
  });
}

}  // namespace

uint32_t ColdChecksum(std::string_view data, bool allow_hardware) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (allow_hardware && HaveSse42()) return Crc32cSse42(data.data(), data.size());
#else
  (void)allow_hardware;
#endif
  return Crc32cSoftware(data.data(), data.size());
}

uint32_t ColdIdentity(std::string_view tenant, std::string_view session, int32_t layer,
                      int64_t page) {
  // Length-prefixed, so that no two tuples serialize alike.
  std::string s;
  s.reserve(4 + tenant.size() + 4 + session.size() + 12);
  char n[12];
  for (std::string_view field : {tenant, session}) {
    PutLe(n, field.size(), 4);
    s.append(n, 4);
    s.append(field);
  }
  PutLe(n, static_cast<uint32_t>(layer), 4);
  PutLe(n + 4, static_cast<uint64_t>(page), 8);
  s.append(n, 12);
  return Crc32(s.data(), s.size());
}

std::string EncodeColdValue(uint32_t identity, uint64_t generation, std::string_view data) {
  std::string v(kColdHeaderBytes + data.size(), '\0');
  char* h = v.data();
  std::memcpy(h, kMagic, 4);
  PutLe(h + 4, kVersion, 2);
  PutLe(h + 8, generation, 8);
  PutLe(h + 16, identity, 4);
  PutLe(h + 20, data.size(), 4);
  PutLe(h + 24, Crc32(data.data(), data.size()), 4);
  PutLe(h + 28, Crc32(h, 28), 4);
  if (!data.empty()) std::memcpy(h + kColdHeaderBytes, data.data(), data.size());
  return v;
}

namespace {

// DecodeColdValue's checks: the value's generation, or why the value is refused.
absl::StatusOr<uint64_t> CheckColdValue(std::string_view value, uint32_t identity,
                                        uint64_t expected_generation) {
  if (value.size() < kColdHeaderBytes) {
    return absl::DataLossError(absl::StrFormat(
        "cold value of %d bytes: shorter than its %d-byte header", value.size(), kColdHeaderBytes));
  }
  const char* h = value.data();
  if (std::memcmp(h, kMagic, 4) != 0) return absl::DataLossError("cold value: bad magic");
  if (GetLe(h + 28, 4) != Crc32(h, 28)) {
    return absl::DataLossError("cold value: header checksum mismatch");
  }
  const uint64_t version = GetLe(h + 4, 2);
  if (version != kVersion && version != kUnboundVersion) {
    return absl::DataLossError(absl::StrFormat("cold value: version %d, expected %d or %d",
                                               version, kVersion, kUnboundVersion));
  }
  const bool bound = version == kVersion;
  if (bound && GetLe(h + 16, 4) != identity) {
    return absl::DataLossError(absl::StrFormat(
        "cold value: a value of another page (identity %08x; this key's is %08x)",
        GetLe(h + 16, 4), identity));
  }
  const uint64_t bytes = bound ? GetLe(h + 20, 4) : GetLe(h + 16, 8);
  if (bytes != value.size() - kColdHeaderBytes) {
    return absl::DataLossError(absl::StrFormat("cold value: header says %d bytes, %d follow",
                                               bytes, value.size() - kColdHeaderBytes));
  }
  const std::string_view data = value.substr(kColdHeaderBytes);
  if (GetLe(h + 24, 4) != Crc32(data.data(), data.size())) {
    return absl::DataLossError("cold value: payload checksum mismatch");
  }
  const uint64_t generation = GetLe(h + 8, 8);
  if (expected_generation != 0 && generation != expected_generation) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "cold value of generation %d, expected %d (a stale commit)", generation,
        expected_generation));
  }
  return generation;
}

}  // namespace

absl::StatusOr<ColdPage> DecodeColdValue(std::string_view value, uint32_t identity,
                                         uint64_t expected_generation) {
  ColdPage page;
  KVTIER_ASSIGN_OR_RETURN(page.generation, CheckColdValue(value, identity, expected_generation));
  page.data = std::string(value.substr(kColdHeaderBytes));
  return page;
}

absl::StatusOr<ColdPage> DecodeColdValueInPlace(std::string&& value, uint32_t identity,
                                                uint64_t expected_generation) {
  ColdPage page;
  KVTIER_ASSIGN_OR_RETURN(page.generation, CheckColdValue(value, identity, expected_generation));
  // In place: a fresh buffer of a page's size would be fresh memory to fault in, which costs
  // far more than moving the bytes down over the header.
  value.erase(0, kColdHeaderBytes);
  page.data = std::move(value);
  return page;
}

absl::StatusOr<std::unique_ptr<ColdTier>> ColdTier::Create(RedisCluster* cluster,
                                                           std::string prefix) {
  if (cluster == nullptr) return absl::InvalidArgumentError("cold tier: no cluster");
  if (!ValidPrefix(prefix)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "cold tier key prefix \"%s\": must be 1 to 32 of [A-Za-z0-9_.-]", prefix));
  }
  return std::unique_ptr<ColdTier>(new ColdTier(cluster, std::move(prefix)));
}

std::string ColdKey(std::string_view prefix, std::string_view tenant, std::string_view session,
                    int32_t layer, int64_t page) {
  std::string key;
  ((((((key += prefix) += ':') += tenant) += ":{") += session) += ':');
  key += absl::StrCat(layer, "}:", page);
  return key;
}

absl::Status ColdTier::Put(std::string_view tenant, std::string_view session,
                           std::span<const ColdPageRef> pages, absl::Time deadline) {
  std::vector<std::vector<std::string>> commands;
  commands.reserve(pages.size());
  int64_t bytes = 0;
  for (const ColdPageRef& p : pages) {
    if (p.generation == 0 || p.layer < 0 || p.page < 0 || p.data.empty() ||
        p.data.size() > kColdMaxPageBytes) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "cold tier put of layer %d page %d (generation %d, %d bytes): layer and page must be "
          ">= 0, generation >= 1, data non-empty and at most %d bytes",
          p.layer, p.page, p.generation, p.data.size(), kColdMaxPageBytes));
    }
    commands.push_back(
        {"SET", Key(tenant, session, p.layer, p.page),
         EncodeColdValue(ColdIdentity(tenant, session, p.layer, p.page), p.generation, p.data)});
    bytes += static_cast<int64_t>(p.data.size());
  }
  std::vector<absl::StatusOr<RedisReply>> replies = cluster_->Pipeline(commands, deadline);
  for (size_t i = 0; i < replies.size(); ++i) {
    if (!replies[i].ok()) {
      return absl::Status(replies[i].status().code(),
                          absl::StrFormat("cold tier put of layer %d page %d: %s", pages[i].layer,
                                          pages[i].page, replies[i].status().message()));
    }
  }
  MutexLock lock(&mu_);
  stats_.pages_written += static_cast<int64_t>(pages.size());
  stats_.bytes_written += bytes;
  return absl::OkStatus();
}

std::vector<absl::StatusOr<ColdPage>> ColdTier::Get(std::string_view tenant,
                                                    std::string_view session, int32_t layer,
                                                    std::span<const int64_t> pages,
                                                    std::span<const uint64_t> generations,
                                                    absl::Time deadline) {
  std::vector<std::vector<std::string>> commands;
  commands.reserve(pages.size());
  for (int64_t p : pages) commands.push_back({"GET", Key(tenant, session, layer, p)});
  std::vector<absl::StatusOr<RedisReply>> replies = cluster_->Pipeline(commands, deadline);
  std::vector<absl::StatusOr<ColdPage>> out;
  out.reserve(pages.size());
  int64_t read = 0, bytes = 0, failures = 0, recoveries = 0;
  for (size_t i = 0; i < pages.size(); ++i) {
    const uint64_t want = i < generations.size() ? generations[i] : 0;
    const uint32_t identity = ColdIdentity(tenant, session, layer, pages[i]);
    const auto decode = [&](absl::StatusOr<RedisReply>& r) -> absl::StatusOr<ColdPage> {
      if (!r.ok()) return r.status();
      if (r->type == RedisReply::Type::kNil) {
        return absl::NotFoundError(absl::StrFormat("cold tier: layer %d page %d of session %s "
                                                   "is not stored",
                                                   layer, pages[i], session));
      }
      if (r->type != RedisReply::Type::kString) {
        return absl::DataLossError(absl::StrFormat(
            "cold tier: layer %d page %d: the key holds no string value", layer, pages[i]));
      }
      return DecodeColdValueInPlace(std::move(r->str), identity, want);
    };
    absl::StatusOr<ColdPage> page = decode(replies[i]);
    if (absl::IsDataLoss(page.status())) {
      ++failures;
      // A replica may still hold the intact copy (the master's was corrupted, or written over
      // with another page's value, after the write).
      absl::StatusOr<RedisReply> replica = cluster_->RunOnReplica(commands[i], deadline);
      absl::StatusOr<ColdPage> again = decode(replica);
      if (again.ok()) {
        ++recoveries;
        page = std::move(again);
      } else {
        page = absl::DataLossError(absl::StrFormat(
            "cold tier: layer %d page %d of session %s: %s; replica: %s", layer, pages[i],
            session, page.status().message(), again.status().ToString()));
      }
    }
    if (page.ok()) {
      page->layer = layer;
      page->page = pages[i];
      ++read;
      bytes += static_cast<int64_t>(page->data.size());
    }
    out.push_back(std::move(page));
  }
  MutexLock lock(&mu_);
  stats_.pages_read += read;
  stats_.bytes_read += bytes;
  stats_.checksum_failures += failures;
  stats_.replica_recoveries += recoveries;
  return out;
}

absl::Status ColdTier::Delete(std::string_view tenant, std::string_view session, int32_t layer,
                              std::span<const int64_t> pages, absl::Time deadline) {
  std::vector<std::vector<std::string>> commands;
  commands.reserve(pages.size());
  for (int64_t p : pages) commands.push_back({"DEL", Key(tenant, session, layer, p)});
  for (const absl::StatusOr<RedisReply>& r : cluster_->Pipeline(commands, deadline)) {
    if (!r.ok()) return r.status();
  }
  return absl::OkStatus();
}

ColdTierStats ColdTier::stats() const {
  MutexLock lock(&mu_);
  return stats_;
}

}  // namespace kvtier::daemon
