// The kvtierd binary as a process: serves until SIGTERM then exits 0 removing its sockets; exit 2
// for bad configuration or flags, 1 when start-up fails; --print-default-config prints a
// configuration its own parser reads; the systemd unit's command line is accepted.
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "daemon/config.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvtier::daemon {
namespace {

using ::testing::HasSubstr;

// Safety nets against a hung child; never timing assertions.
constexpr absl::Duration kStartDeadline = absl::Seconds(120);

std::string ReadFile(const std::string& path) {
  std::ifstream file(path);
  std::ostringstream text;
  text << file.rdbuf();
  return text.str();
}

bool Exists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0;
}

bool Connects(const std::string& path) {
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  path.copy(addr.sun_path, sizeof(addr.sun_path) - 1);
  const bool ok = ::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == 0;
  ::close(fd);
  return ok;
}

// A started kvtierd with its stdout and stderr going to files.
struct Child {
  pid_t pid = -1;
  std::string out_path, err_path;
};

class KvtierdProcessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = absl::StrCat(::testing::TempDir(), "kvtierdp_XXXXXX");
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
  }

  Child Spawn(const std::vector<std::string>& args) {
    Child child;
    child.out_path = absl::StrCat(dir_, "/out", spawned_, ".txt");
    child.err_path = absl::StrCat(dir_, "/err", spawned_, ".txt");
    ++spawned_;
    std::vector<std::string> argv_strings = {KVTIERD_PATH};
    argv_strings.insert(argv_strings.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (std::string& a : argv_strings) argv.push_back(a.data());
    argv.push_back(nullptr);
    child.pid = ::fork();
    if (child.pid == 0) {
      const int out = ::open(child.out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
      const int err = ::open(child.err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
      ::dup2(out, STDOUT_FILENO);
      ::dup2(err, STDERR_FILENO);
      ::execv(argv[0], argv.data());
      ::_exit(127);
    }
    EXPECT_GT(child.pid, 0);
    return child;
  }

  // The child's exit status (WEXITSTATUS), or -1 when it did not exit normally.
  static int WaitExit(const Child& child) {
    int status = 0;
    EXPECT_EQ(::waitpid(child.pid, &status, 0), child.pid);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }

  // Runs kvtierd to completion; its exit code, stdout and stderr.
  int Run(const std::vector<std::string>& args, std::string* out, std::string* err) {
    const Child child = Spawn(args);
    const int code = WaitExit(child);
    *out = ReadFile(child.out_path);
    *err = ReadFile(child.err_path);
    return code;
  }

  // Polls until `socket` accepts connections; false when the child exited first or the deadline
  // passed.
  static bool WaitForSocket(const Child& child, const std::string& socket) {
    const absl::Time deadline = absl::Now() + kStartDeadline;
    while (absl::Now() < deadline) {
      if (Connects(socket)) return true;
      int status = 0;
      if (::waitpid(child.pid, &status, WNOHANG) == child.pid) return false;
      const timespec pause = {0, 10'000'000};  // between polls
      ::nanosleep(&pause, nullptr);
    }
    return false;
  }

  std::string WriteConfig(const std::string& text) {
    const std::string path = absl::StrCat(dir_, "/kvtierd", spawned_, ".toml");
    std::ofstream(path) << text;
    return path;
  }

  std::string SmallConfig() const {
    return absl::StrCat("[server]\nunix_socket = \"", dir_,
                        "/kvtierd.sock\"\nshutdown_grace_ms = 5000\n",
                        "[[tenant]]\nname = \"t0\"\nhost_memory_bytes = 16777216\n",
                        "hugepages = \"off\"\nlock = false\n");
  }

  std::string dir_;
  int spawned_ = 0;
};

TEST_F(KvtierdProcessTest, ServesUntilSigtermThenExitsZeroRemovingItsSockets) {
  const std::string socket = dir_ + "/kvtierd.sock";
  const Child child = Spawn({"--config", WriteConfig(SmallConfig()), "--log-format", "json"});
  ASSERT_TRUE(WaitForSocket(child, socket)) << ReadFile(child.err_path);
  EXPECT_TRUE(Exists(socket + ".attach"));
  ASSERT_EQ(::kill(child.pid, SIGTERM), 0);
  EXPECT_EQ(WaitExit(child), 0) << ReadFile(child.err_path);
  EXPECT_FALSE(Exists(socket));
  EXPECT_FALSE(Exists(socket + ".attach"));
  const std::string log = ReadFile(child.err_path);
  EXPECT_THAT(log, HasSubstr(R"("msg":"shutdown: done)"));
}

TEST_F(KvtierdProcessTest, StartupFailureExitsOneSayingWhatToFix) {
  // Something live already listens on the socket path.
  const std::string socket = dir_ + "/kvtierd.sock";
  const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  socket.copy(addr.sun_path, sizeof(addr.sun_path) - 1);
  ASSERT_EQ(::bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::listen(fd, 4), 0);
  std::string out, err;
  EXPECT_EQ(Run({"--config", WriteConfig(SmallConfig())}, &out, &err), 1);
  EXPECT_THAT(err, HasSubstr("in use"));
  EXPECT_THAT(err, HasSubstr(socket));
  ::close(fd);
}

TEST_F(KvtierdProcessTest, CheckConfigOnABadFileExitsTwoNamingTheKey) {
  std::string out, err;
  const std::string path = WriteConfig("[server]\nunix_socket = \"/x.sock\"\nbogus_key = 1\n");
  EXPECT_EQ(Run({"--config", path, "--check-config"}, &out, &err), 2);
  EXPECT_THAT(err, HasSubstr("server.bogus_key"));
  EXPECT_THAT(err, HasSubstr("line 3"));
}

TEST_F(KvtierdProcessTest, CheckConfigReportsBadValuesAndFlags) {
  std::string out, err;
  EXPECT_EQ(Run({"--config", WriteConfig(SmallConfig()), "--log-level", "loud", "--check-config"},
                &out, &err),
            2);
  EXPECT_THAT(err, HasSubstr("log.level"));
  EXPECT_EQ(Run({"--frobnicate"}, &out, &err), 2);
  EXPECT_THAT(err, HasSubstr("--frobnicate"));
  EXPECT_EQ(Run({"--config", WriteConfig(SmallConfig()), "--check-config"}, &out, &err), 0) << err;
}

TEST_F(KvtierdProcessTest, PrintDefaultConfigOutputParses) {
  std::string out, err;
  ASSERT_EQ(Run({"--print-default-config"}, &out, &err), 0) << err;
  EXPECT_EQ(out, DefaultConfigToml());
  absl::StatusOr<DaemonConfig> config = ParseConfigToml(out, DaemonConfig{});
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(*config, DefaultConfig());
}

TEST_F(KvtierdProcessTest, AcceptsTheSystemdUnitsCommandLine) {
  // ExecStart's flags, with the example configuration in place of /etc/kvtier/kvtierd.toml.
  const std::string unit = ReadFile(absl::StrCat(KVTIER_SOURCE_DIR, "/deploy/kvtierd.service"));
  std::vector<std::string> args;
  for (absl::string_view line : absl::StrSplit(unit, '\n')) {
    if (absl::ConsumePrefix(&line, "ExecStart=")) {
      args = absl::StrSplit(line, ' ', absl::SkipEmpty());
    }
  }
  ASSERT_FALSE(args.empty());
  args.erase(args.begin());  // the installed binary's path
  for (std::string& arg : args) {
    if (arg == "/etc/kvtier/kvtierd.toml") {
      arg = absl::StrCat(KVTIER_SOURCE_DIR, "/deploy/kvtierd.example.toml");
    }
  }
  args.push_back("--check-config");
  std::string out, err;
  EXPECT_EQ(Run(args, &out, &err), 0) << err;
  EXPECT_THAT(out, HasSubstr("configuration OK"));
}

}  // namespace
}  // namespace kvtier::daemon
