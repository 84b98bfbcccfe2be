#include "server/kv_waits.h"

#include <iterator>
#include <utility>

#include "absl/strings/str_cat.h"

namespace shardopt {

absl::Status KvWaits::Wait::TimeoutError() const {
  return absl::DeadlineExceededError(
      absl::StrCat("key '", key, "' not set within ", absl::FormatDuration(wait)));
}

absl::StatusOr<std::vector<KvWaits::Wait>> KvWaits::Set(const std::string& key,
                                                        const std::string& value) {
  auto it = values_.find(key);
  const size_t old = it == values_.end() ? 0 : it->second.size() + key.size();
  if (bytes_ - old + key.size() + value.size() > max_bytes_) {
    return absl::ResourceExhaustedError("rendezvous store is full");
  }
  bytes_ = bytes_ - old + key.size() + value.size();
  values_[key] = value;
  // Whoever waits for this key, oldest first.
  std::vector<Wait> settled;
  for (auto w = by_key_.lower_bound(key); w != by_key_.end() && w->first == key;
       w = by_key_.lower_bound(key)) {
    settled.push_back(TakeAt(waits_.find(w->second)));
  }
  return settled;
}

const std::string* KvWaits::Find(const std::string& key) const {
  auto it = values_.find(key);
  return it == values_.end() ? nullptr : &it->second;
}

absl::Status KvWaits::AddWait(WaitId id, const std::string& key, absl::Time deadline,
                              absl::Time now, Callback* done) {
  if (deadline <= now) {
    return absl::DeadlineExceededError(absl::StrCat("key '", key, "' not set within 0"));
  }
  if (static_cast<int>(waits_.size()) >= max_waiters_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        waits_.size(), " KvGet calls are already waiting (the limit); try again later"));
  }
  Pending& p = waits_[id];
  p.wait.id = id;
  p.wait.key = key;
  p.wait.deadline = deadline;
  p.wait.wait = deadline - now;
  p.wait.done = std::move(*done);
  p.index = by_key_.emplace(key, id);
  return absl::OkStatus();
}

KvWaits::Wait KvWaits::TakeAt(std::map<WaitId, Pending>::iterator it) {
  Wait w = std::move(it->second.wait);
  by_key_.erase(it->second.index);
  waits_.erase(it);
  return w;
}

std::optional<KvWaits::Wait> KvWaits::Take(WaitId id) {
  auto it = waits_.find(id);
  if (it == waits_.end()) return std::nullopt;
  return TakeAt(it);
}

std::vector<KvWaits::Wait> KvWaits::TakeExpired(absl::Time now) {
  std::vector<Wait> expired;
  for (auto it = waits_.begin(); it != waits_.end();) {
    auto next = std::next(it);
    if (it->second.wait.deadline <= now) expired.push_back(TakeAt(it));
    it = next;
  }
  return expired;
}

std::vector<KvWaits::Wait> KvWaits::TakeAll() {
  std::vector<Wait> all;
  all.reserve(waits_.size());
  while (!waits_.empty()) all.push_back(TakeAt(waits_.begin()));
  return all;
}

}  // namespace shardopt
