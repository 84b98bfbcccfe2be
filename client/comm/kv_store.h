// Key-value stores for rendezvous (Gloo's address exchange, later NCCL's
// unique id). The coordinator serves one over gRPC; tests use these.
#ifndef SHARDOPT_CLIENT_COMM_KV_STORE_H_
#define SHARDOPT_CLIENT_COMM_KV_STORE_H_

#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace shardopt {

// A write-once-per-key store shared by all ranks of a job. Implementations
// are thread-safe.
class KeyValueStore {
 public:
  virtual ~KeyValueStore() = default;
  // Sets `key` (overwriting any previous value).
  virtual absl::Status Set(const std::string& key, const std::string& value) = 0;
  // Returns the value of `key`, waiting up to `timeout` for it to be set;
  // DeadlineExceeded naming the key otherwise.
  virtual absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) = 0;
};

// Every rank of `world_size` publishes `value` under "key/<rank>" and reads
// everyone's: element p is rank p's value (this rank's own included). Each
// read waits up to `timeout`; an error keeps its code and names the rank
// waited for.
absl::StatusOr<std::vector<std::string>> ExchangeRecords(KeyValueStore* store,
                                                         const std::string& key, int rank,
                                                         int world_size, const std::string& value,
                                                         absl::Duration timeout);

// In one process (ranks as threads).
class InMemoryKeyValueStore : public KeyValueStore {
 public:
  absl::Status Set(const std::string& key, const std::string& value) override;
  absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) override;

 private:
  absl::Mutex mu_;
  std::map<std::string, std::string> values_ ABSL_GUARDED_BY(mu_);
};

// Files in a directory shared by the ranks' processes (one file per key,
// written to a temporary name and renamed, so readers never see a partial
// value). Waiting polls every few milliseconds.
class FileKeyValueStore : public KeyValueStore {
 public:
  explicit FileKeyValueStore(std::string dir) : dir_(std::move(dir)) {}
  absl::Status Set(const std::string& key, const std::string& value) override;
  absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) override;

 private:
  std::string PathOf(const std::string& key) const;
  const std::string dir_;
};

// Namespaces every key with `prefix` + "/" (e.g. one prefix per communicator).
class PrefixKeyValueStore : public KeyValueStore {
 public:
  PrefixKeyValueStore(KeyValueStore* base, std::string prefix)
      : base_(base), prefix_(std::move(prefix)) {}
  absl::Status Set(const std::string& key, const std::string& value) override {
    return base_->Set(prefix_ + "/" + key, value);
  }
  absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) override {
    return base_->Get(prefix_ + "/" + key, timeout);
  }

 private:
  KeyValueStore* base_;
  const std::string prefix_;
};

}  // namespace shardopt

#endif  // SHARDOPT_CLIENT_COMM_KV_STORE_H_
