// Every side effect of checkpoints on disk goes through this interface, so
// tests can use a fault-injecting version (disk full, crash after N bytes).
#ifndef SHARDOPT_COMMON_FILE_SYSTEM_H_
#define SHARDOPT_COMMON_FILE_SYSTEM_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace shardopt {

class WritableFile {
 public:
  virtual ~WritableFile() = default;
  virtual absl::Status Append(const void* data, size_t n) = 0;
  // fsync: durable when this returns OK.
  virtual absl::Status Sync() = 0;
  virtual absl::Status Close() = 0;
};

// What a path names, without following a final symlink.
enum class EntryKind { kMissing, kFile, kDirectory, kSymlink, kOther };

// Paths are followed through directories, but the last component is never
// followed: a symlink, FIFO, device or directory where a file is expected is
// an error, never something written through, read or waited on.
class FileSystem {
 public:
  virtual ~FileSystem() = default;
  // Creates a new file at `path`, replacing a file or symlink of that name
  // (the link itself, never its target); O_EXCL | O_NOFOLLOW.
  virtual absl::StatusOr<std::unique_ptr<WritableFile>> NewWritableFile(
      const std::string& path) = 0;
  // Reads exactly `n` bytes at `offset` of a regular file; DataLoss if the
  // file is shorter.
  virtual absl::Status ReadAt(const std::string& path, uint64_t offset, size_t n, void* out) = 0;
  // Size of a regular file (FailedPrecondition for anything else).
  virtual absl::StatusOr<uint64_t> FileSize(const std::string& path) = 0;
  virtual EntryKind Kind(const std::string& path) = 0;
  virtual absl::Status Rename(const std::string& from, const std::string& to) = 0;
  // fsync of a directory, so that renames and creations in it are durable.
  virtual absl::Status SyncDir(const std::string& dir) = 0;
  virtual absl::Status MakeDirs(const std::string& dir) = 0;
  virtual absl::StatusOr<std::vector<std::string>> ListDir(const std::string& dir) = 0;
  virtual bool Exists(const std::string& path) = 0;
  virtual absl::Status Remove(const std::string& path) = 0;
  // Removes an empty directory.
  virtual absl::Status RemoveDir(const std::string& dir) = 0;
};

// The real one (POSIX). Thread-safe.
FileSystem* PosixFileSystem();

// Wraps another file system and fails every write once `budget_bytes` bytes
// have been written through it (ENOSPC, like a full disk), or every operation
// after `crash_after_ops` operations (a crash: nothing more reaches the disk).
class FaultInjectingFileSystem : public FileSystem {
 public:
  explicit FaultInjectingFileSystem(FileSystem* base) : base_(base) {}
  void set_budget_bytes(int64_t b) { budget_ = b; }
  void set_crash_after_ops(int64_t ops) { crash_after_ = ops; }
  int64_t ops() const { return ops_.load(); }

  absl::StatusOr<std::unique_ptr<WritableFile>> NewWritableFile(const std::string& path) override;
  absl::Status ReadAt(const std::string& path, uint64_t offset, size_t n, void* out) override;
  absl::StatusOr<uint64_t> FileSize(const std::string& path) override;
  EntryKind Kind(const std::string& path) override;
  absl::Status Rename(const std::string& from, const std::string& to) override;
  absl::Status SyncDir(const std::string& dir) override;
  absl::Status MakeDirs(const std::string& dir) override;
  absl::StatusOr<std::vector<std::string>> ListDir(const std::string& dir) override;
  bool Exists(const std::string& path) override;
  absl::Status Remove(const std::string& path) override;
  absl::Status RemoveDir(const std::string& dir) override;

  // For its files.
  absl::Status Op();
  absl::Status Spend(size_t n);

 private:
  FileSystem* base_;
  std::atomic<int64_t> budget_{-1};
  std::atomic<int64_t> crash_after_{-1};
  std::atomic<int64_t> ops_{0};
};

// Writes `data` to `path` crash-safely: temporary file, fsync, rename,
// directory fsync.
absl::Status WriteFileAtomically(FileSystem* fs, const std::string& path, const std::string& data);
// Reads a whole regular file of at most `max_bytes` bytes (larger ones are
// refused before anything is read).
absl::StatusOr<std::string> ReadWholeFile(FileSystem* fs, const std::string& path,
                                          int64_t max_bytes = 256LL << 20);

// Reads a file the user named (a token, a certificate): symlinks are followed,
// but it must be a regular file of at most `max_bytes`.
absl::StatusOr<std::string> ReadConfigFile(const std::string& path, int64_t max_bytes = 1 << 20);

}  // namespace shardopt

#endif  // SHARDOPT_COMMON_FILE_SYSTEM_H_
