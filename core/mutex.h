// kvtier::Mutex, MutexLock and CondVar: the locking primitives of every kvtier component.
//
// Why not absl::Mutex: the distribution's abseil is not built with ThreadSanitizer, so
// absl::Mutex's futex-based locking is invisible to a -fsanitize=thread build, which then
// reports every guarded access as a race. These wrap std::mutex and
// std::condition_variable, whose pthread calls TSan intercepts, and keep clang's
// -Wthread-safety annotations (ABSL_GUARDED_BY, ABSL_EXCLUSIVE_LOCKS_REQUIRED) working, as
// leveldb's port::Mutex does.
//
// Thread-safety: Mutex and CondVar are thread-safe; MutexLock is a scoped guard used by
// one thread. Unlike absl::Mutex, nothing re-evaluates a waiter's condition by itself:
// whoever changes state that a CondVar waiter waits for must Signal() or SignalAll() it.
// The mutex is not recursive, has no reader mode and no deadlock detection.
#ifndef KVTIER_CORE_MUTEX_H_
#define KVTIER_CORE_MUTEX_H_

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/time/time.h"

namespace kvtier {

class ABSL_LOCKABLE Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() { mu_.lock(); }
  // REQUIRES: held by the calling thread.
  void Unlock() ABSL_UNLOCK_FUNCTION() { mu_.unlock(); }
  // Tells the thread-safety analysis that the lock is held; checks nothing at run time.
  void AssertHeld() const ABSL_ASSERT_EXCLUSIVE_LOCK() {}

 private:
  friend class CondVar;
  std::mutex mu_;
};

// Holds `mu` from construction to the end of the scope.
class ABSL_SCOPED_LOCKABLE MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) { mu_->Lock(); }
  ~MutexLock() ABSL_UNLOCK_FUNCTION() { mu_->Unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex* const mu_;
};

// A condition variable used with a kvtier::Mutex. Every wait releases `mu` while blocked
// and holds it again on return. Wait and WaitWithTimeout may wake spuriously; prefer
// Await / AwaitWithTimeout, which loop on a predicate. Signal and SignalAll may be called
// with or without the mutex held.
class CondVar {
 public:
  CondVar() = default;
  CondVar(const CondVar&) = delete;
  CondVar& operator=(const CondVar&) = delete;

  void Wait(Mutex* mu) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    Borrow b(mu);
    cv_.wait(b.lock);
  }
  // Returns true when `timeout` expired (≤ 0: at once; InfiniteDuration: never).
  bool WaitWithTimeout(Mutex* mu, absl::Duration timeout) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    Borrow b(mu);
    return cv_.wait_until(b.lock, DeadlineAfter(timeout)) == std::cv_status::timeout;
  }

  // Blocks until pred() is true; pred runs with `mu` held.
  template <class Pred>
  void Await(Mutex* mu, Pred pred) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    Borrow b(mu);
    cv_.wait(b.lock, std::move(pred));
  }
  // Blocks until pred() is true or `timeout` has passed; returns pred()'s last value (note:
  // true means success, the opposite of WaitWithTimeout). pred runs with `mu` held.
  template <class Pred>
  bool AwaitWithTimeout(Mutex* mu, Pred pred, absl::Duration timeout)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    Borrow b(mu);
    return cv_.wait_until(b.lock, DeadlineAfter(timeout), std::move(pred));
  }

  void Signal() { cv_.notify_one(); }
  void SignalAll() { cv_.notify_all(); }

 private:
  using Clock = std::chrono::steady_clock;

  // Lends mu's std::mutex to a std::unique_lock for one wait and takes it back on exit, so
  // the caller (normally a MutexLock) stays its only owner.
  struct Borrow {
    explicit Borrow(Mutex* mu) : lock(mu->mu_, std::adopt_lock) {}
    ~Borrow() { lock.release(); }
    std::unique_lock<std::mutex> lock;
  };

  // now + timeout on the monotonic clock, saturating instead of overflowing.
  static Clock::time_point DeadlineAfter(absl::Duration timeout) {
    const Clock::time_point now = Clock::now();
    if (timeout <= absl::ZeroDuration()) return now;
    const auto wait =
        std::chrono::duration_cast<Clock::duration>(absl::ToChronoNanoseconds(timeout));
    return wait >= Clock::time_point::max() - now ? Clock::time_point::max() : now + wait;
  }

  std::condition_variable cv_;
};

}  // namespace kvtier

#endif  // KVTIER_CORE_MUTEX_H_
