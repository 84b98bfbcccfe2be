// A FileSystem in this process's memory: what a live resize saves its
// optimizer state into (client/resize.h), so that the checkpoint code writes
// and reads it exactly as it does a checkpoint on disk, without the disk.
// Files and directories live in one map; Sync and SyncDir do nothing.
// Thread-safe (the snapshot service reads while nothing writes).
#ifndef SHARDOPT_COMMON_MEMORY_FILE_SYSTEM_H_
#define SHARDOPT_COMMON_MEMORY_FILE_SYSTEM_H_

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "common/file_system.h"

namespace shardopt {

class MemoryFileSystem : public FileSystem {
 public:
  MemoryFileSystem() = default;

  absl::StatusOr<std::unique_ptr<WritableFile>> NewWritableFile(const std::string& path) override;
  absl::Status ReadAt(const std::string& path, uint64_t offset, size_t n, void* out) override;
  absl::StatusOr<uint64_t> FileSize(const std::string& path) override;
  EntryKind Kind(const std::string& path) override;
  absl::Status Rename(const std::string& from, const std::string& to) override;
  absl::Status SyncDir(const std::string&) override { return absl::OkStatus(); }
  absl::Status MakeDirs(const std::string& dir) override;
  absl::StatusOr<std::vector<std::string>> ListDir(const std::string& dir) override;
  bool Exists(const std::string& path) override { return Kind(path) != EntryKind::kMissing; }
  absl::Status Remove(const std::string& path) override;
  absl::Status RemoveDir(const std::string& dir) override;

  // Bytes held by every file.
  int64_t bytes() const;

  // A file's contents: chunks of kChunkBytes (the last one shorter), so that
  // writing a large file never copies what it already holds.
  struct Blob {
    static constexpr size_t kChunkBytes = 8 << 20;
    std::vector<std::unique_ptr<char[]>> chunks;
    size_t size = 0;
    void Append(const char* data, size_t n);
    void Read(uint64_t offset, size_t n, char* out) const;
  };
  // For its files: a file being written (the writer owns it until Close,
  // which publishes it under its path).
  void Publish(const std::string& path, std::shared_ptr<Blob> data);

 private:
  // Paths are normalized: no trailing or doubled '/'.
  static std::string Normalize(const std::string& path);
  static std::string ParentOf(const std::string& path);
  bool DirExistsLocked(const std::string& dir) const ABSL_SHARED_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<const Blob>> files_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> dirs_ ABSL_GUARDED_BY(mu_);
};

}  // namespace shardopt

#endif  // SHARDOPT_COMMON_MEMORY_FILE_SYSTEM_H_
