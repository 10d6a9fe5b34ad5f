#include "client/local_daemon.h"

#include <fcntl.h>
#include <ftw.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "client/kvpool_client.h"
#include "common/file_read.h"

namespace kvpool::client {
namespace {

std::string ReadWholeFile(const std::string& path) {
  constexpr uint64_t kMaxPortFileBytes = 4096;
  return ReadRegularFile(path, kMaxPortFileBytes).value_or("");
}

std::string DescribeWaitStatus(int status) {
  if (WIFEXITED(status)) return absl::StrCat("exit status ", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    return absl::StrCat("killed by signal ", WTERMSIG(status), " (", strsignal(WTERMSIG(status)),
                        ")");
  }
  return absl::StrCat("wait status ", status);
}

int RemoveEntry(const char* path, const struct stat* /*sb*/, int /*flag*/, struct FTW* /*ftw*/) {
  ::remove(path);
  return 0;
}

}  // namespace

absl::StatusOr<std::string> MakeTempDir(const std::string& prefix) {
  const char* tmp = std::getenv("TMPDIR");
  std::string pattern =
      absl::StrCat(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp", "/", prefix, "-XXXXXX");
  if (mkdtemp(pattern.data()) == nullptr) {
    return absl::InternalError(
        absl::StrCat("mkdtemp(", pattern, ") failed: ", std::strerror(errno)));
  }
  return pattern;
}

void RemoveTree(const std::string& path) {
  if (path.empty()) return;
  nftw(path.c_str(), RemoveEntry, 16, FTW_DEPTH | FTW_PHYS);
}

absl::StatusOr<std::unique_ptr<LocalDaemon>> LocalDaemon::Start(const LocalDaemonOptions& options) {
  if (access(options.binary.c_str(), X_OK) != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "kvpoold binary '", options.binary, "' is not executable: ", std::strerror(errno)));
  }
  auto daemon = std::unique_ptr<LocalDaemon>(new LocalDaemon());
  absl::StatusOr<std::string> dir = MakeTempDir("kvpoold");
  if (!dir.ok()) return dir.status();
  daemon->dir_ = *dir;
  const std::string port_file = daemon->dir_ + "/port";
  daemon->log_path_ = options.inherit_output     ? ""
                      : options.log_file.empty() ? daemon->dir_ + "/kvpoold.log"
                                                 : options.log_file;

  // Everything the child needs is prepared before fork: after it only async-signal-safe calls.
  daemon->host_ = options.listen_host;
  std::vector<std::string> args = {
      options.binary, absl::StrCat("--listen=", options.listen_host, ":", options.listen_port),
      "--port_file=" + port_file};
  args.insert(args.end(), options.flags.begin(), options.flags.end());
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  int log_fd = -1;
  if (!options.inherit_output) {
    log_fd = open(daemon->log_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (log_fd < 0) {
      return absl::InternalError(
          absl::StrCat("cannot create ", daemon->log_path_, ": ", std::strerror(errno)));
    }
  }
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) {
    if (log_fd >= 0) close(log_fd);
    return absl::InternalError(absl::StrCat("fork failed: ", std::strerror(errno)));
  }
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    if (log_fd >= 0) {
      dup2(log_fd, STDOUT_FILENO);
      dup2(log_fd, STDERR_FILENO);
    }
    if (options.max_open_files > 0) {
      struct rlimit lim;
      lim.rlim_cur = lim.rlim_max = options.max_open_files;
      if (setrlimit(RLIMIT_NOFILE, &lim) != 0) _exit(126);
    }
    execv(argv[0], argv.data());
    _exit(127);
  }
  if (log_fd >= 0) close(log_fd);
  daemon->pid_ = pid;

  // Wait for the port file (written atomically by kvpoold once it listens).
  const absl::Time give_up = absl::Now() + options.startup_timeout;
  while (true) {
    const std::string text = ReadWholeFile(port_file);
    int port = 0;
    if (!text.empty() && absl::SimpleAtoi(absl::StripAsciiWhitespace(text), &port) && port > 0) {
      daemon->port_ = port;
      break;
    }
    if (!daemon->Running()) {
      return absl::InternalError(absl::StrCat("kvpoold exited during startup (",
                                              DescribeWaitStatus(daemon->exit_status_), "); log:\n",
                                              daemon->LogTail()));
    }
    if (absl::Now() > give_up) {
      return absl::InternalError(absl::StrCat("kvpoold wrote no port file within ",
                                              absl::FormatDuration(options.startup_timeout),
                                              "; log:\n", daemon->LogTail()));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }

  absl::StatusOr<std::unique_ptr<KvpoolClient>> client =
      KvpoolClient::Connect(daemon->target(), options.client);
  if (!client.ok()) return client.status();
  const absl::Status serving =
      (*client)->WaitForServing(std::max(absl::Seconds(5), give_up - absl::Now()));
  if (!serving.ok()) {
    return absl::InternalError(absl::StrCat("kvpoold on ", daemon->target(),
                                            " did not become SERVING: ", serving.ToString(),
                                            "; log:\n", daemon->LogTail()));
  }
  return daemon;
}

LocalDaemon::~LocalDaemon() {
  if (pid_ > 0 && Running()) {
    kill(pid_, SIGKILL);
    int status = 0;
    waitpid(pid_, &status, 0);
  }
  RemoveTree(dir_);
}

std::string LocalDaemon::target() const { return absl::StrCat(host_, ":", port_); }

std::string LocalDaemon::LogTail(size_t max_bytes) const {
  if (log_path_.empty()) return "";
  const std::string text = ReadWholeFile(log_path_);
  return text.size() <= max_bytes ? text : "..." + text.substr(text.size() - max_bytes);
}

bool LocalDaemon::Running() {
  if (pid_ <= 0 || exited_) return false;
  int status = 0;
  const pid_t r = waitpid(pid_, &status, WNOHANG);
  if (r == pid_) {
    exited_ = true;
    exit_status_ = status;
    return false;
  }
  return r == 0;
}

bool LocalDaemon::WaitExit(absl::Duration timeout, int* wait_status) {
  const absl::Time give_up = absl::Now() + timeout;
  while (Running()) {
    if (absl::Now() > give_up) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  *wait_status = exit_status_;
  return exited_;
}

absl::Status LocalDaemon::Stop(absl::Duration timeout) {
  if (pid_ <= 0) return absl::FailedPreconditionError("kvpoold was not started");
  if (!exited_ && Running()) kill(pid_, SIGTERM);
  int status = 0;
  if (!WaitExit(timeout, &status)) {
    kill(pid_, SIGKILL);
    WaitExit(absl::Seconds(30), &status);
    return absl::InternalError(absl::StrCat("kvpoold did not exit within ",
                                            absl::FormatDuration(timeout),
                                            " of SIGTERM (killed); log:\n", LogTail()));
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return absl::InternalError(
        absl::StrCat("kvpoold stopped with ", DescribeWaitStatus(status), "; log:\n", LogTail()));
  }
  return absl::OkStatus();
}

}  // namespace kvpool::client
