// Where tests put arena files (HostArena's file mode, tenant.arena_path): /dev/shm (tmpfs)
// when it is there and writable, else the test's temporary directory.
#ifndef KVTIER_TESTS_TESTUTIL_ARENA_DIR_H_
#define KVTIER_TESTS_TESTUTIL_ARENA_DIR_H_

#include <sys/stat.h>
#include <unistd.h>

#include <string>

#include "gtest/gtest.h"

namespace kvtier::testing {

inline std::string ArenaFileDir() {
  struct stat st {};
  if (stat("/dev/shm", &st) == 0 && S_ISDIR(st.st_mode) && access("/dev/shm", W_OK) == 0) {
    return "/dev/shm";
  }
  std::string dir = ::testing::TempDir();
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  return dir;
}

}  // namespace kvtier::testing

#endif  // KVTIER_TESTS_TESTUTIL_ARENA_DIR_H_
