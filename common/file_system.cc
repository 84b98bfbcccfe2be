#include "common/file_system.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <climits>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace shardopt {

namespace {

absl::Status Errno(const std::string& what, const std::string& path) {
  const int e = errno;
  const std::string msg = absl::StrCat(what, " '", path, "': ", std::strerror(e));
  if (e == ENOSPC || e == EDQUOT) return absl::ResourceExhaustedError(msg);
  if (e == ENOENT) return absl::NotFoundError(msg);
  if (e == EACCES || e == EPERM) return absl::PermissionDeniedError(msg);
  return absl::UnavailableError(msg);
}

absl::Status NotRegular(const std::string& path, const char* what) {
  return absl::FailedPreconditionError(
      absl::StrCat("'", path, "' is ", what, "; refusing to use it"));
}

class PosixWritableFile : public WritableFile {
 public:
  PosixWritableFile(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  ~PosixWritableFile() override {
    if (fd_ >= 0) ::close(fd_);
  }
  absl::Status Append(const void* data, size_t n) override {
    const char* p = static_cast<const char*>(data);
    while (n > 0) {
      const ssize_t w = ::write(fd_, p, n);
      if (w < 0) {
        if (errno == EINTR) continue;
        return Errno("cannot write", path_);
      }
      p += w;
      n -= static_cast<size_t>(w);
    }
    return absl::OkStatus();
  }
  absl::Status Sync() override {
    if (::fdatasync(fd_) != 0) return Errno("cannot fsync", path_);
    return absl::OkStatus();
  }
  absl::Status Close() override {
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) return Errno("cannot close", path_);
    return absl::OkStatus();
  }

 private:
  int fd_;
  std::string path_;
};

class Posix : public FileSystem {
 public:
  absl::StatusOr<std::unique_ptr<WritableFile>> NewWritableFile(const std::string& path) override {
    // A leftover (or planted) file or symlink of this name is removed, never
    // written through; then the file is created anew, exclusively.
    const EntryKind k = Kind(path);
    if (k == EntryKind::kDirectory || k == EntryKind::kOther) {
      return absl::FailedPreconditionError(
          absl::StrCat("cannot create '", path, "': a ",
                       k == EntryKind::kDirectory ? "directory" : "special file",
                       " of that name is in the way"));
    }
    if (k != EntryKind::kMissing && ::unlink(path.c_str()) != 0 && errno != ENOENT) {
      return Errno("cannot replace", path);
    }
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd < 0) return Errno("cannot create", path);
    return std::unique_ptr<WritableFile>(new PosixWritableFile(fd, path));
  }
  absl::Status ReadAt(const std::string& path, uint64_t offset, size_t n, void* out) override {
    // O_NOFOLLOW: a symlink is refused; O_NONBLOCK: a FIFO never blocks the
    // open; the fstat below then refuses anything but a regular file.
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) {
      if (errno == ELOOP) return NotRegular(path, "a symbolic link");
      return Errno("cannot open", path);
    }
    struct stat st;
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      return NotRegular(path, "not a regular file");
    }
    if (offset > static_cast<uint64_t>(st.st_size) ||
        n > static_cast<uint64_t>(st.st_size) - offset) {
      ::close(fd);
      return absl::DataLossError(absl::StrCat("'", path, "' is truncated: wanted ", n,
                                              " bytes at offset ", offset, ", it has ",
                                              st.st_size));
    }
    char* p = static_cast<char*>(out);
    size_t done = 0;
    while (done < n) {
      const ssize_t r = ::pread(fd, p + done, n - done, static_cast<off_t>(offset + done));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) {
        ::close(fd);
        if (r == 0) {
          return absl::DataLossError(
              absl::StrCat("'", path, "' is truncated: wanted ", n, " bytes at offset ", offset));
        }
        return Errno("cannot read", path);
      }
      done += static_cast<size_t>(r);
    }
    ::close(fd);
    return absl::OkStatus();
  }
  absl::StatusOr<uint64_t> FileSize(const std::string& path) override {
    struct stat st;
    if (::lstat(path.c_str(), &st) != 0) return Errno("cannot stat", path);
    if (S_ISLNK(st.st_mode)) return NotRegular(path, "a symbolic link");
    if (!S_ISREG(st.st_mode)) return NotRegular(path, "not a regular file");
    return static_cast<uint64_t>(st.st_size);
  }
  EntryKind Kind(const std::string& path) override {
    struct stat st;
    if (::lstat(path.c_str(), &st) != 0) return EntryKind::kMissing;
    if (S_ISLNK(st.st_mode)) return EntryKind::kSymlink;
    if (S_ISREG(st.st_mode)) return EntryKind::kFile;
    if (S_ISDIR(st.st_mode)) return EntryKind::kDirectory;
    return EntryKind::kOther;
  }
  absl::Status Rename(const std::string& from, const std::string& to) override {
    if (::rename(from.c_str(), to.c_str()) != 0) return Errno("cannot rename", from);
    return absl::OkStatus();
  }
  absl::Status SyncDir(const std::string& dir) override {
    const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return Errno("cannot open directory", dir);
    const int r = ::fsync(fd);
    ::close(fd);
    if (r != 0) return Errno("cannot fsync directory", dir);
    return absl::OkStatus();
  }
  absl::Status MakeDirs(const std::string& dir) override {
    std::string cur;
    for (size_t i = 0; i <= dir.size(); ++i) {
      if (i == dir.size() || dir[i] == '/') {
        cur = dir.substr(0, i);
        if (!cur.empty() && ::mkdir(cur.c_str(), 0755) != 0 && errno != EEXIST) {
          return Errno("cannot create directory", cur);
        }
      }
    }
    return absl::OkStatus();
  }
  absl::StatusOr<std::vector<std::string>> ListDir(const std::string& dir) override {
    DIR* d = ::opendir(dir.c_str());
    if (d == nullptr) return Errno("cannot list", dir);
    std::vector<std::string> out;
    while (dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (name != "." && name != "..") out.push_back(name);
    }
    ::closedir(d);
    return out;
  }
  bool Exists(const std::string& path) override { return ::access(path.c_str(), F_OK) == 0; }
  absl::Status Remove(const std::string& path) override {
    if (::unlink(path.c_str()) != 0 && errno != ENOENT) return Errno("cannot remove", path);
    return absl::OkStatus();
  }
  absl::Status RemoveDir(const std::string& dir) override {
    if (::rmdir(dir.c_str()) != 0 && errno != ENOENT) return Errno("cannot remove directory", dir);
    return absl::OkStatus();
  }
};

class FaultyFile : public WritableFile {
 public:
  FaultyFile(FaultInjectingFileSystem* fs, std::unique_ptr<WritableFile> base)
      : fs_(fs), base_(std::move(base)) {}
  absl::Status Append(const void* data, size_t n) override {
    if (absl::Status s = fs_->Op(); !s.ok()) return s;
    if (absl::Status s = fs_->Spend(n); !s.ok()) return s;
    return base_->Append(data, n);
  }
  absl::Status Sync() override {
    if (absl::Status s = fs_->Op(); !s.ok()) return s;
    return base_->Sync();
  }
  absl::Status Close() override { return base_->Close(); }

 private:
  FaultInjectingFileSystem* fs_;
  std::unique_ptr<WritableFile> base_;
};

}  // namespace

FileSystem* PosixFileSystem() {
  static Posix* fs = new Posix;
  return fs;
}

absl::Status FaultInjectingFileSystem::Op() {
  const int64_t n = ops_.fetch_add(1) + 1;
  const int64_t limit = crash_after_.load();
  if (limit >= 0 && n > limit)
    return absl::UnavailableError("injected crash: nothing more is written");
  return absl::OkStatus();
}

absl::Status FaultInjectingFileSystem::Spend(size_t n) {
  if (budget_.load() < 0) return absl::OkStatus();
  if (budget_.fetch_sub(static_cast<int64_t>(n)) < static_cast<int64_t>(n)) {
    budget_ = 0;
    return absl::ResourceExhaustedError("No space left on device (injected)");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<WritableFile>> FaultInjectingFileSystem::NewWritableFile(
    const std::string& path) {
  if (absl::Status s = Op(); !s.ok()) return s;
  auto f = base_->NewWritableFile(path);
  if (!f.ok()) return f.status();
  return std::unique_ptr<WritableFile>(new FaultyFile(this, std::move(*f)));
}
absl::Status FaultInjectingFileSystem::ReadAt(const std::string& p, uint64_t o, size_t n,
                                              void* out) {
  return base_->ReadAt(p, o, n, out);
}
absl::StatusOr<uint64_t> FaultInjectingFileSystem::FileSize(const std::string& p) {
  return base_->FileSize(p);
}
EntryKind FaultInjectingFileSystem::Kind(const std::string& p) { return base_->Kind(p); }
absl::Status FaultInjectingFileSystem::Rename(const std::string& a, const std::string& b) {
  if (absl::Status s = Op(); !s.ok()) return s;
  return base_->Rename(a, b);
}
absl::Status FaultInjectingFileSystem::SyncDir(const std::string& d) {
  if (absl::Status s = Op(); !s.ok()) return s;
  return base_->SyncDir(d);
}
absl::Status FaultInjectingFileSystem::MakeDirs(const std::string& d) {
  if (absl::Status s = Op(); !s.ok()) return s;
  return base_->MakeDirs(d);
}
absl::StatusOr<std::vector<std::string>> FaultInjectingFileSystem::ListDir(const std::string& d) {
  return base_->ListDir(d);
}
bool FaultInjectingFileSystem::Exists(const std::string& p) { return base_->Exists(p); }
absl::Status FaultInjectingFileSystem::Remove(const std::string& p) {
  if (absl::Status s = Op(); !s.ok()) return s;
  return base_->Remove(p);
}

absl::Status FaultInjectingFileSystem::RemoveDir(const std::string& d) {
  if (absl::Status s = Op(); !s.ok()) return s;
  return base_->RemoveDir(d);
}

absl::StatusOr<std::string> ReadConfigFile(const std::string& path, int64_t max_bytes) {
  // Symlinks are followed here (mounted secrets are symlinks), but the target
  // must be a regular file: no FIFO, device or directory.
  char resolved[PATH_MAX];
  if (::realpath(path.c_str(), resolved) == nullptr) return Errno("cannot open", path);
  return ReadWholeFile(PosixFileSystem(), resolved, max_bytes);
}

absl::Status WriteFileAtomically(FileSystem* fs, const std::string& path, const std::string& data) {
  const std::string tmp = path + ".tmp";
  auto f = fs->NewWritableFile(tmp);
  if (!f.ok()) return f.status();
  absl::Status s = (*f)->Append(data.data(), data.size());
  if (s.ok()) s = (*f)->Sync();
  absl::Status c = (*f)->Close();
  if (s.ok()) s = c;
  if (s.ok()) s = fs->Rename(tmp, path);
  if (!s.ok()) {
    (void)fs->Remove(tmp);
    return s;
  }
  const size_t slash = path.rfind('/');
  return fs->SyncDir(slash == std::string::npos ? "." : path.substr(0, slash));
}

absl::StatusOr<std::string> ReadWholeFile(FileSystem* fs, const std::string& path,
                                          int64_t max_bytes) {
  auto size = fs->FileSize(path);
  if (!size.ok()) return size.status();
  if (*size > static_cast<uint64_t>(max_bytes)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "'", path, "' has ", *size, " bytes, more than the ", max_bytes, " this file may have"));
  }
  std::string out(*size, '\0');
  if (absl::Status s = fs->ReadAt(path, 0, out.size(), out.data()); !s.ok()) return s;
  return out;
}

}  // namespace shardopt
