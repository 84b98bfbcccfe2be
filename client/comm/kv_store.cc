#include "client/comm/kv_store.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace shardopt {

absl::StatusOr<std::vector<std::string>> ExchangeRecords(KeyValueStore* store,
                                                         const std::string& key, int rank,
                                                         int world_size, const std::string& value,
                                                         absl::Duration timeout) {
  absl::Status s = store->Set(absl::StrCat(key, "/", rank), value);
  if (!s.ok()) return s;
  std::vector<std::string> out(world_size);
  out[rank] = value;
  for (int p = 0; p < world_size; ++p) {
    if (p == rank) continue;
    auto v = store->Get(absl::StrCat(key, "/", p), timeout);
    if (!v.ok()) {
      return absl::Status(v.status().code(),
                          absl::StrCat("waiting for rank ", p, ": ", v.status().message()));
    }
    out[p] = *std::move(v);
  }
  return out;
}

absl::Status InMemoryKeyValueStore::Set(const std::string& key, const std::string& value) {
  absl::MutexLock lock(&mu_);
  values_[key] = value;
  return absl::OkStatus();
}

absl::StatusOr<std::string> InMemoryKeyValueStore::Get(const std::string& key,
                                                       absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto present = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return values_.count(key) > 0; };
  if (!mu_.AwaitWithTimeout(absl::Condition(&present), timeout)) {
    return absl::DeadlineExceededError(
        absl::StrCat("key '", key, "' not set within ", absl::FormatDuration(timeout)));
  }
  return values_[key];
}

std::string FileKeyValueStore::PathOf(const std::string& key) const {
  // Keys may contain '/': flatten them into one file name.
  std::string name;
  for (char c : key) {
    name += (c == '/' ? '%' : c);
  }
  return dir_ + "/" + name;
}

absl::Status FileKeyValueStore::Set(const std::string& key, const std::string& value) {
  const std::string path = PathOf(key);
  const std::string tmp = absl::StrCat(path, ".tmp.", getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(value.data(), static_cast<std::streamsize>(value.size()));
    if (!out) {
      return absl::UnavailableError(
          absl::StrCat("cannot write '", tmp, "': ", std::strerror(errno)));
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot rename '", tmp, "' to '", path, "': ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> FileKeyValueStore::Get(const std::string& key, absl::Duration timeout) {
  const std::string path = PathOf(key);
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    std::ifstream in(path, std::ios::binary);
    if (in) {
      std::stringstream ss;
      ss << in.rdbuf();
      return ss.str();
    }
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat("key '", key, "' not set in '", dir_,
                                                      "' within ", absl::FormatDuration(timeout)));
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
}

}  // namespace shardopt
