// PeerTable: the connections each peer of a server holds, and the fairness rule of every
// server kvtierd exposes to clients it has not authenticated yet (the attach socket, whose
// peer is a process; /metrics, whose peer is a uid or an IP address). A peer may hold at most
// max_per_peer connections: a further one is refused. When max_total are held, a newcomer
// takes the place of the oldest connection of the peer that holds the most. So one client's
// flood of silent connections cannot keep another client from being answered, whether it
// comes from one peer (it keeps max_per_peer) or from many (each newcomer evicts one of them).
//
// Also PeerCredentials, the peer of a Unix socket as the kernel reports it.
//
// Thread-compatible: a server calls it from its one I/O thread or under its own lock. The
// items are the server's handles on its connections (a pointer, a weak_ptr); the table only
// stores them and hands back the one to close.
#ifndef KVTIER_DAEMON_PEER_TABLE_H_
#define KVTIER_DAEMON_PEER_TABLE_H_

#include <sys/types.h>

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <list>
#include <map>
#include <optional>
#include <utility>

#include "absl/container/flat_hash_map.h"

namespace kvtier::daemon {

struct PeerCredentials {
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;
};

// The credentials of the peer of connected Unix socket `fd` (SO_PEERCRED: the process that
// connected, as it was then); nullopt when the kernel cannot say. The pid is 0 for a process
// in another pid namespace.
std::optional<PeerCredentials> PeerCredentialsOf(int fd);

template <typename Key, typename Item>
class PeerTable {
 public:
  struct Limits {
    uint32_t max_total = 1;     // > 0
    uint32_t max_per_peer = 1;  // in [1, max_total]
  };
  // What Admit decided.
  struct Admission {
    bool admitted = false;  // false: the peer holds max_per_peer already
    uint64_t ticket = 0;    // the admitted connection's, for Remove
    // The connection the admitted one replaced (gone from the table): the server closes it.
    std::optional<Item> evicted;
  };

  explicit PeerTable(Limits limits) : limits_(limits) {}
  PeerTable(const PeerTable&) = delete;
  PeerTable& operator=(const PeerTable&) = delete;

  // Admits a new connection of `peer`, evicting one at max_total (see above).
  Admission Admit(const Key& peer, Item item) {
    auto mine = by_peer_.find(peer);
    if (mine != by_peer_.end() && mine->second.size() >= limits_.max_per_peer) return {};
    Admission out;
    out.admitted = true;
    if (tickets_.size() >= limits_.max_total && !by_peer_.empty()) {
      // The first of the peers that hold the most: its oldest connection.
      const auto heaviest = std::max_element(
          by_peer_.begin(), by_peer_.end(),
          [](const auto& a, const auto& b) { return a.second.size() < b.second.size(); });
      auto [ticket, victim] = std::move(heaviest->second.front());
      out.evicted = std::move(victim);
      Remove(ticket);  // may erase the heaviest peer's entry, which may be `mine`
    }
    mine = by_peer_.try_emplace(peer).first;
    out.ticket = next_ticket_++;
    const auto at = mine->second.insert(mine->second.end(), {out.ticket, std::move(item)});
    tickets_.emplace(out.ticket, Where{mine, at});
    return out;
  }

  // Forgets an admitted connection; false when it is not held (evicted or removed before).
  bool Remove(uint64_t ticket) {
    const auto it = tickets_.find(ticket);
    if (it == tickets_.end()) return false;
    const Where where = it->second;
    tickets_.erase(it);
    where.peer->second.erase(where.at);
    if (where.peer->second.empty()) by_peer_.erase(where.peer);
    return true;
  }

  size_t size() const { return tickets_.size(); }  // connections held, all peers

 private:
  using Held = std::list<std::pair<uint64_t, Item>>;  // (ticket, item), oldest first
  struct Where {
    typename std::map<Key, Held>::iterator peer;  // map and list iterators stay valid
    typename Held::iterator at;
  };

  const Limits limits_;
  std::map<Key, Held> by_peer_;  // every entry non-empty
  absl::flat_hash_map<uint64_t, Where> tickets_;
  uint64_t next_ticket_ = 1;
};

}  // namespace kvtier::daemon

#endif  // KVTIER_DAEMON_PEER_TABLE_H_
