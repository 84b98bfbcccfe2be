#include "common/memory_file_system.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace shardopt {
namespace {

class MemoryWritableFile : public WritableFile {
 public:
  MemoryWritableFile(MemoryFileSystem* fs, std::string path)
      : fs_(fs), path_(std::move(path)), data_(std::make_shared<MemoryFileSystem::Blob>()) {}
  absl::Status Append(const void* data, size_t n) override {
    if (closed_) return absl::FailedPreconditionError("file is closed");
    data_->Append(static_cast<const char*>(data), n);
    return absl::OkStatus();
  }
  absl::Status Sync() override { return absl::OkStatus(); }
  absl::Status Close() override {
    if (!closed_) fs_->Publish(path_, data_);
    closed_ = true;
    return absl::OkStatus();
  }

 private:
  MemoryFileSystem* fs_;
  std::string path_;
  std::shared_ptr<MemoryFileSystem::Blob> data_;
  bool closed_ = false;
};

}  // namespace

void MemoryFileSystem::Blob::Append(const char* data, size_t n) {
  while (n > 0) {
    const size_t used = size % kChunkBytes;
    if (used == 0) chunks.push_back(std::unique_ptr<char[]>(new char[kChunkBytes]));
    const size_t len = std::min(n, kChunkBytes - used);
    std::memcpy(chunks.back().get() + used, data, len);
    data += len;
    n -= len;
    size += len;
  }
}

void MemoryFileSystem::Blob::Read(uint64_t offset, size_t n, char* out) const {
  while (n > 0) {
    const size_t chunk = static_cast<size_t>(offset / kChunkBytes);
    const size_t at = static_cast<size_t>(offset % kChunkBytes);
    const size_t len = std::min(n, kChunkBytes - at);
    std::memcpy(out, chunks[chunk].get() + at, len);
    out += len;
    offset += len;
    n -= len;
  }
}

std::string MemoryFileSystem::Normalize(const std::string& path) {
  std::string out;
  for (char c : path) {
    if (c == '/' && !out.empty() && out.back() == '/') continue;
    out.push_back(c);
  }
  while (out.size() > 1 && out.back() == '/') out.pop_back();
  return out;
}

std::string MemoryFileSystem::ParentOf(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return "";
  return slash == 0 ? "/" : path.substr(0, slash);
}

bool MemoryFileSystem::DirExistsLocked(const std::string& dir) const {
  return dir.empty() || dir == "/" || dir == "." || dirs_.count(dir) > 0;
}

void MemoryFileSystem::Publish(const std::string& path, std::shared_ptr<Blob> data) {
  absl::MutexLock lock(&mu_);
  files_[path] = std::move(data);
}

absl::StatusOr<std::unique_ptr<WritableFile>> MemoryFileSystem::NewWritableFile(
    const std::string& path) {
  const std::string p = Normalize(path);
  absl::MutexLock lock(&mu_);
  if (!DirExistsLocked(ParentOf(p))) {
    return absl::NotFoundError(absl::StrCat("'", path, "': no such directory"));
  }
  if (dirs_.count(p))
    return absl::FailedPreconditionError(absl::StrCat("'", path, "' is a directory"));
  files_[p] = std::make_shared<const Blob>();
  return std::unique_ptr<WritableFile>(std::make_unique<MemoryWritableFile>(this, p));
}

absl::Status MemoryFileSystem::ReadAt(const std::string& path, uint64_t offset, size_t n,
                                      void* out) {
  std::shared_ptr<const Blob> data;
  {
    absl::MutexLock lock(&mu_);
    auto it = files_.find(Normalize(path));
    if (it == files_.end()) return absl::NotFoundError(absl::StrCat("'", path, "': no such file"));
    data = it->second;
  }
  if (offset > data->size || n > data->size - offset) {
    return absl::DataLossError(
        absl::StrCat("'", path, "' is ", data->size, " bytes: cannot read ", n, " at ", offset));
  }
  data->Read(offset, n, static_cast<char*>(out));
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> MemoryFileSystem::FileSize(const std::string& path) {
  absl::MutexLock lock(&mu_);
  auto it = files_.find(Normalize(path));
  if (it == files_.end()) {
    return absl::FailedPreconditionError(absl::StrCat("'", path, "' is not a regular file"));
  }
  return it->second->size;
}

EntryKind MemoryFileSystem::Kind(const std::string& path) {
  const std::string p = Normalize(path);
  absl::MutexLock lock(&mu_);
  if (files_.count(p)) return EntryKind::kFile;
  if (dirs_.count(p) || p == "/") return EntryKind::kDirectory;
  return EntryKind::kMissing;
}

absl::Status MemoryFileSystem::Rename(const std::string& from, const std::string& to) {
  const std::string f = Normalize(from), t = Normalize(to);
  absl::MutexLock lock(&mu_);
  auto it = files_.find(f);
  if (it == files_.end()) return absl::NotFoundError(absl::StrCat("'", from, "': no such file"));
  if (!DirExistsLocked(ParentOf(t))) {
    return absl::NotFoundError(absl::StrCat("'", to, "': no such directory"));
  }
  auto data = it->second;
  files_.erase(it);
  files_[t] = std::move(data);
  return absl::OkStatus();
}

absl::Status MemoryFileSystem::MakeDirs(const std::string& dir) {
  const std::string d = Normalize(dir);
  absl::MutexLock lock(&mu_);
  for (std::string p = d; !p.empty() && p != "/" && p != "."; p = ParentOf(p)) {
    if (files_.count(p)) {
      return absl::FailedPreconditionError(absl::StrCat("'", p, "' is a file"));
    }
    dirs_.insert(p);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> MemoryFileSystem::ListDir(const std::string& dir) {
  const std::string d = Normalize(dir);
  absl::MutexLock lock(&mu_);
  if (!DirExistsLocked(d))
    return absl::NotFoundError(absl::StrCat("'", dir, "': no such directory"));
  const std::string prefix = d == "/" ? "/" : d + "/";
  std::vector<std::string> out;
  auto child = [&](const std::string& p) {
    if (!absl::StartsWith(p, prefix)) return;
    const std::string rest = p.substr(prefix.size());
    if (!rest.empty() && rest.find('/') == std::string::npos) out.push_back(rest);
  };
  for (const auto& [p, data] : files_) child(p);
  for (const auto& p : dirs_) child(p);
  return out;
}

absl::Status MemoryFileSystem::Remove(const std::string& path) {
  absl::MutexLock lock(&mu_);
  if (files_.erase(Normalize(path)) == 0) {
    return absl::NotFoundError(absl::StrCat("'", path, "': no such file"));
  }
  return absl::OkStatus();
}

absl::Status MemoryFileSystem::RemoveDir(const std::string& dir) {
  const std::string d = Normalize(dir);
  absl::MutexLock lock(&mu_);
  const std::string prefix = d + "/";
  for (const auto& [p, data] : files_) {
    if (absl::StartsWith(p, prefix)) {
      return absl::FailedPreconditionError(absl::StrCat("'", dir, "' is not empty"));
    }
  }
  for (const auto& p : dirs_) {
    if (absl::StartsWith(p, prefix)) {
      return absl::FailedPreconditionError(absl::StrCat("'", dir, "' is not empty"));
    }
  }
  if (dirs_.erase(d) == 0)
    return absl::NotFoundError(absl::StrCat("'", dir, "': no such directory"));
  return absl::OkStatus();
}

int64_t MemoryFileSystem::bytes() const {
  absl::MutexLock lock(&mu_);
  int64_t n = 0;
  for (const auto& [p, data] : files_) n += static_cast<int64_t>(data->size);
  return n;
}

}  // namespace shardopt
