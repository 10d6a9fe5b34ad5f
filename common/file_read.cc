#include "common/file_read.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/openat2.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <climits>
#include <cstring>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/quote.h"

namespace kvpool {
namespace {

// Closes a descriptor on scope exit.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

absl::Status OpenError(int err, absl::string_view path) {
  switch (err) {
    case ENOENT:
    case ENOTDIR:
      return absl::NotFoundError(absl::StrCat("no file ", Quote(path)));
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(absl::StrCat("file ", Quote(path), " is not readable"));
    case ELOOP:
      return absl::InvalidArgumentError(
          absl::StrCat("file ", Quote(path), ": too many symbolic links"));
    case ENAMETOOLONG:
      return absl::InvalidArgumentError(absl::StrCat("file name ", Quote(path), " is too long"));
    case EMFILE:
    case ENFILE:
    case ENOMEM:
      return absl::ResourceExhaustedError(
          absl::StrCat("cannot open ", Quote(path), ": ", std::strerror(err)));
    default:
      return absl::InternalError(
          absl::StrCat("cannot open ", Quote(path), ": ", std::strerror(err)));
  }
}

// Reads all of the open file `fd` (named `path` in messages) when it is a regular file of at
// most `max_bytes`.
absl::StatusOr<std::string> ReadOpenFile(int fd, absl::string_view path, uint64_t max_bytes) {
  struct stat st;
  if (fstat(fd, &st) != 0) return OpenError(errno, path);
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(Quote(path), " is not a regular file"));
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size > max_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("file ", Quote(path), " has ", size,
                                                   " bytes, more than the limit of ", max_bytes));
  }
  std::string bytes(size, '\0');
  size_t done = 0;
  while (done < size) {
    const ssize_t n = read(fd, bytes.data() + done, size - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      return absl::DataLossError(
          absl::StrCat("error reading ", Quote(path), ": ", std::strerror(errno)));
    }
    if (n == 0) break;
    done += static_cast<size_t>(n);
  }
  char extra;
  ssize_t more;
  do {
    more = read(fd, &extra, 1);
  } while (more < 0 && errno == EINTR);
  if (done != size || more != 0) {
    return absl::DataLossError(absl::StrCat("file ", Quote(path), " changed while being read"));
  }
  return bytes;
}

// Whether `relative` stays inside its directory by its text alone: not absolute, and no ".."
// climbs above the start.
bool LexicallyBeneath(absl::string_view relative) {
  if (absl::StartsWith(relative, "/")) return false;
  int depth = 0;
  for (absl::string_view part : absl::StrSplit(relative, '/')) {
    if (part.empty() || part == ".") continue;
    if (part == "..") {
      if (--depth < 0) return false;
    } else {
      ++depth;
    }
  }
  return true;
}

absl::Status Outside(absl::string_view relative) {
  return absl::PermissionDeniedError(
      absl::StrCat(Quote(relative), " is not a path inside the directory"));
}

// openat2(RESOLVE_BENEATH): -1 with errno ENOSYS where the kernel lacks it.
int OpenBeneath(int dir_fd, const std::string& relative) {
  struct open_how how;
  std::memset(&how, 0, sizeof(how));
  how.flags = O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY;
  how.resolve = RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS;
  return static_cast<int>(syscall(SYS_openat2, dir_fd, relative.c_str(), &how, sizeof(how)));
}

}  // namespace

absl::StatusOr<std::string> ReadRegularFile(const std::string& path, uint64_t max_bytes) {
  if (path.empty()) return absl::InvalidArgumentError("file name is empty");
  if (path.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError("file name contains a NUL byte");
  }
  // Non-blocking: opening a FIFO must not wait for a writer (it is then refused by fstat).
  Fd fd(open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY));
  if (fd.get() < 0) return OpenError(errno, path);
  return ReadOpenFile(fd.get(), path, max_bytes);
}

absl::StatusOr<std::string> ReadRegularFileBeneath(const std::string& dir,
                                                   absl::string_view relative, uint64_t max_bytes) {
  if (relative.empty()) return absl::InvalidArgumentError("file name is empty");
  if (relative.find('\0') != absl::string_view::npos) {
    return absl::InvalidArgumentError("file name contains a NUL byte");
  }
  if (!LexicallyBeneath(relative)) return Outside(relative);
  Fd dir_fd(open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dir_fd.get() < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("directory ", Quote(dir), " cannot be opened: ", std::strerror(errno)));
  }
  const std::string rel(relative);
  int raw = OpenBeneath(dir_fd.get(), rel);
  if (raw < 0 && errno == ENOSYS) {
    // No openat2: resolve the whole path and check where it lands.
    char dir_real[PATH_MAX];
    char file_real[PATH_MAX];
    if (realpath(dir.c_str(), dir_real) == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat("directory ", Quote(dir), " is not accessible"));
    }
    const std::string joined = absl::StrCat(dir_real, "/", rel);
    if (realpath(joined.c_str(), file_real) == nullptr) return OpenError(errno, relative);
    if (!absl::StartsWith(file_real, absl::StrCat(dir_real, "/"))) return Outside(relative);
    raw = open(file_real, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  } else if (raw < 0 && errno == EXDEV) {
    // A step would leave the directory (a symbolic link outside, an absolute link).
    return Outside(relative);
  }
  if (raw < 0) return OpenError(errno, relative);
  Fd fd(raw);
  return ReadOpenFile(fd.get(), relative, max_bytes);
}

}  // namespace kvpool
