#include "server/flight_records.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "server/coordinator.h"

namespace shardopt {

v1::FlightRecord ToFlightRecord(int rank, const std::vector<FlightEntry>& entries,
                                absl::Time captured, const std::string& reason) {
  v1::FlightRecord r;
  r.set_rank(rank);
  r.set_captured_unix(absl::ToDoubleSeconds(captured - absl::UnixEpoch()));
  r.set_reason(reason);
  r.mutable_records()->Reserve(static_cast<int>(entries.size()));
  for (const FlightEntry& e : entries) {
    v1::CollectiveRecord* c = r.add_records();
    c->set_seq(e.seq);
    c->set_op(CollectiveKindName(e.op));
    c->set_bucket(e.bucket);
    c->set_bytes(e.bytes);
    c->set_start_unix(e.start_unix_ns * 1e-9);
    c->set_end_unix(e.end_unix_ns * 1e-9);
    c->set_state(FlightStateName(e.state));
    c->set_step(e.step);
  }
  return r;
}

absl::Status ValidateFlightRecord(const v1::FlightRecord& record, int world_size) {
  if (record.rank() < 0 || record.rank() >= world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("flight record of rank ", record.rank(), ": not in [0, ", world_size, ")"));
  }
  const std::string who = absl::StrCat("flight record of rank ", record.rank());
  if (record.records_size() > kMaxFlightRecords) {
    return absl::InvalidArgumentError(absl::StrCat(who, ": ", record.records_size(),
                                                   " records (at most ", kMaxFlightRecords, ")"));
  }
  if (record.reason().size() > kMaxFlightReasonBytes || record.error().size() > kMaxFlightReasonBytes) {
    return absl::InvalidArgumentError(absl::StrCat(who, ": reason or error too long"));
  }
  if (!std::isfinite(record.captured_unix()) || record.captured_unix() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(who, ": bad captured_unix"));
  }
  for (const v1::CollectiveRecord& c : record.records()) {
    const std::string& op = c.op();
    const bool op_ok = !op.empty() && op.size() <= 32 &&
                       std::all_of(op.begin(), op.end(), [](char ch) {
                         return (ch >= 'a' && ch <= 'z') || (ch >= '0' && ch <= '9') || ch == '_';
                       });
    if (!op_ok) return absl::InvalidArgumentError(absl::StrCat(who, ": bad op at seq ", c.seq()));
    if (c.state() != "running" && c.state() != "done" && c.state() != "failed") {
      return absl::InvalidArgumentError(absl::StrCat(who, ": bad state at seq ", c.seq()));
    }
    if (c.seq() < 0 || c.bucket() < -1 || c.bytes() < 0 || c.step() < 0) {
      return absl::InvalidArgumentError(absl::StrCat(who, ": negative field at seq ", c.seq()));
    }
    if (!std::isfinite(c.start_unix()) || !std::isfinite(c.end_unix())) {
      return absl::InvalidArgumentError(absl::StrCat(who, ": time not finite at seq ", c.seq()));
    }
  }
  return absl::OkStatus();
}

namespace {

// "3" -> "rank 3"; {0, 2, 3} -> "ranks 0, 2, 3"; runs of 3 or more as "4-9".
std::string Ranks(std::vector<int> ranks) {
  std::sort(ranks.begin(), ranks.end());
  ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
  std::vector<std::string> parts;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (j - i >= 2) {
      parts.push_back(absl::StrCat(ranks[i], "-", ranks[j]));
    } else {
      for (size_t k = i; k <= j; ++k) parts.push_back(absl::StrCat(ranks[k]));
    }
    i = j + 1;
  }
  return absl::StrCat(ranks.size() == 1 ? "rank " : "ranks ", absl::StrJoin(parts, ", "));
}

// Verb forms for one rank or several.
const char* Verb(const std::vector<int>& ranks, const char* one, const char* many) {
  return ranks.size() == 1 ? one : many;
}

// "both ranks", "all 4 ranks".
std::string All(size_t n) { return n == 2 ? "both ranks" : absl::StrCat("all ", n, " ranks"); }

std::string Secs(double s) {
  if (!(s >= 0)) s = 0;
  return s < 100 ? absl::StrFormat("%.1f s", s) : absl::StrFormat("%.0f s", s);
}

// "all-gather of bucket 3", "all-reduce".
std::string OpName(const v1::CollectiveRecord& c) {
  std::string op = absl::StrReplaceAll(c.op(), {{"_", "-"}});
  if (c.bucket() >= 0) absl::StrAppend(&op, " of bucket ", c.bucket());
  return op;
}

struct Ring {
  int rank = -1;
  std::vector<const v1::CollectiveRecord*> recs;  // by seq
  const v1::CollectiveRecord* Find(int64_t seq) const {
    auto it = std::lower_bound(recs.begin(), recs.end(), seq,
                               [](const v1::CollectiveRecord* c, int64_t s) { return c->seq() < s; });
    return it != recs.end() && (*it)->seq() == seq ? *it : nullptr;
  }
  int64_t lo() const { return recs.empty() ? 0 : recs.front()->seq(); }
  int64_t hi() const { return recs.empty() ? 0 : recs.back()->seq(); }
  // The first collective not finished here (hi() + 1 when all are).
  int64_t FirstOpen() const {
    for (const v1::CollectiveRecord* c : recs) {
      if (c->state() != "done") return c->seq();
    }
    return hi() + 1;
  }
};

}  // namespace

std::string FirstDivergence(const std::vector<v1::FlightRecord>& records, int world_size,
                            const std::map<int, std::string>& notes) {
  std::map<int, Ring> rings;
  std::map<int, std::string> errors;
  double ref = 0;
  for (const v1::FlightRecord& r : records) {
    if (r.rank() < 0 || r.rank() >= world_size) continue;
    if (!r.error().empty()) {
      errors[r.rank()] = r.error();
      continue;
    }
    Ring& ring = rings[r.rank()];
    ring.rank = r.rank();
    ring.recs.clear();
    for (const v1::CollectiveRecord& c : r.records()) {
      ring.recs.push_back(&c);
      ref = std::max({ref, c.start_unix(), c.end_unix()});
    }
    std::sort(ring.recs.begin(), ring.recs.end(),
              [](const v1::CollectiveRecord* a, const v1::CollectiveRecord* b) { return a->seq() < b->seq(); });
    ref = std::max(ref, r.captured_unix());
  }
  std::vector<int> missing;
  for (int r = 0; r < world_size; ++r) {
    if (!rings.count(r)) missing.push_back(r);
  }
  // "rank 1 sent no record (dead?)", one phrase per rank with a note or an
  // error, the others together.
  auto missing_part = [&]() {
    std::vector<std::string> parts;
    std::vector<int> plain;
    for (int r : missing) {
      auto n = notes.find(r);
      auto e = errors.find(r);
      std::string detail;
      if (n != notes.end() && !n->second.empty()) detail = n->second;
      if (e != errors.end() && e->second != detail) {
        std::string err = e->second.substr(0, 160);
        detail = detail.empty() ? err : absl::StrCat(detail, "; ", err);
      }
      if (detail.empty() || missing.size() > 8) {
        plain.push_back(r);
      } else {
        parts.push_back(absl::StrCat(Ranks({r}), " sent no record (dead? ", detail, ")"));
      }
    }
    if (!plain.empty()) {
      parts.insert(parts.begin(),
                   absl::StrCat(Ranks(plain), " sent no record", plain.size() == 1 ? " (dead?)" : "s (dead?)"));
    }
    return absl::StrJoin(parts, "; ");
  };
  if (rings.empty()) {
    return missing.empty() ? "no flight records" : missing_part();
  }

  int64_t seq = INT64_MAX;
  for (const auto& [r, ring] : rings) seq = std::min(seq, ring.FirstOpen());

  // What each rank did with `seq`.
  using Key = std::pair<std::string, int>;  // op, bucket
  std::map<Key, std::vector<int>> waiting, failed, done;
  std::map<Key, double> wait_for, failed_after;
  std::map<int64_t, std::vector<int>> never;  // by the last seq the rank has
  std::vector<int> out_of_ring;
  const v1::CollectiveRecord* example = nullptr;
  std::set<Key> ops;
  for (const auto& [r, ring] : rings) {
    const v1::CollectiveRecord* c = ring.Find(seq);
    if (c == nullptr) {
      if (seq > ring.hi()) {
        never[ring.hi()].push_back(r);
      } else {
        out_of_ring.push_back(r);
      }
      continue;
    }
    if (example == nullptr) example = c;
    const Key key{c->op(), c->bucket()};
    ops.insert(key);
    if (c->state() == "running") {
      waiting[key].push_back(r);
      wait_for[key] = std::max(wait_for[key], ref - c->start_unix());
    } else if (c->state() == "failed") {
      failed[key].push_back(r);
      failed_after[key] = std::max(failed_after[key], c->end_unix() - c->start_unix());
    } else {
      done[key].push_back(r);
    }
  }
  // The last collective a rank finished, from its own ring.
  auto last_of = [&](int64_t last, int rank) -> std::string {
    if (last == 0) return "no collective recorded";
    const v1::CollectiveRecord* c = rings[rank].Find(last);
    if (c == nullptr) return absl::StrCat("seq ", last);
    std::string s = absl::StrCat(OpName(*c), ", seq ", last);
    if (c->state() == "done") {
      absl::StrAppend(&s, ", finished ", Secs(ref - c->end_unix()), " ago");
    } else {
      absl::StrAppend(&s, ", ", c->state());
    }
    return s;
  };
  auto step_prefix = [](const v1::CollectiveRecord* c) -> std::string {
    if (c == nullptr) return "";
    return c->step() > 0 ? absl::StrCat("step ", c->step(), ": ") : "at start-up: ";
  };

  // Every rank at the same place: no divergence.
  if (example == nullptr && never.size() == 1 && out_of_ring.empty()) {
    const auto& [last, ranks] = *never.begin();
    const v1::CollectiveRecord* c = rings[ranks.front()].Find(last);
    if (missing.empty()) {
      return absl::StrCat("no divergence: ", All(ranks.size()), " finished seq ", last,
                          c != nullptr ? absl::StrCat(" (", OpName(*c), ", step ", c->step(), ")") : "",
                          " and are in no collective");
    }
    return absl::StrCat(step_prefix(c), missing_part(), "; ", Ranks(ranks), " ",
                        Verb(ranks, "is", "are"), " in no collective (last: ", last_of(last, ranks.front()),
                        ")");
  }
  if (missing.empty() && failed.empty() && done.empty() && never.empty() && out_of_ring.empty() &&
      waiting.size() == 1) {
    const auto& [key, ranks] = *waiting.begin();
    return absl::StrCat("no divergence: ", All(ranks.size()), " are in ", OpName(*example),
                        " (seq ", seq, ", step ", example->step(), ", for ", Secs(wait_for[key]), ")");
  }
  if (missing.empty() && waiting.empty() && done.empty() && never.empty() && out_of_ring.empty() &&
      failed.size() == 1) {
    const auto& [key, ranks] = *failed.begin();
    return absl::StrCat("no divergence: ", All(ranks.size()), " were in ", OpName(*example),
                        " (seq ", seq, ", step ", example->step(), ") when it failed (after ",
                        Secs(failed_after[key]), ")");
  }
  // A live job's rings are taken a few milliseconds apart: ranks that are at
  // most a collective or two apart, none waiting for a second yet, are simply
  // making progress.
  if (missing.empty() && failed.empty() && out_of_ring.empty() && ops.size() == 1) {
    double longest = 0;
    for (const auto& [key, t] : wait_for) longest = std::max(longest, t);
    for (const auto& [last, ranks] : never) {
      for (int r : ranks) {
        const v1::CollectiveRecord* c = rings[r].Find(last);
        longest = std::max(longest, c != nullptr ? ref - c->end_unix() : 1e9);
      }
    }
    if (longest < absl::ToDoubleSeconds(kFlightSettleTime)) {
      int64_t ahead = seq;
      for (const auto& [r, ring] : rings) ahead = std::max(ahead, ring.hi());
      return absl::StrCat("no divergence: the ranks are making progress (seq ", seq,
                          ahead > seq ? absl::StrCat("-", ahead) : "", ", step ",
                          example->step(), "; no rank has waited ", Secs(absl::ToDoubleSeconds(kFlightSettleTime)),
                          ")");
    }
  }

  auto key_name = [](const Key& k) {
    v1::CollectiveRecord c;
    c.set_op(k.first);
    c.set_bucket(k.second);
    return OpName(c);
  };
  std::vector<std::string> parts;
  for (const auto& [key, ranks] : waiting) {
    parts.push_back(absl::StrCat(Ranks(ranks), " ", Verb(ranks, "waits", "wait"), " in ", key_name(key),
                                 " (seq ", seq, ", for ", Secs(wait_for[key]), ")"));
  }
  for (const auto& [key, ranks] : failed) {
    parts.push_back(absl::StrCat(Ranks(ranks), " waited in ", key_name(key), " (seq ", seq,
                                 ") and failed after ", Secs(failed_after[key])));
  }
  for (const auto& [key, ranks] : done) {
    // The first phrase names the collective; later ones say "it".
    parts.push_back(absl::StrCat(Ranks(ranks), " finished ",
                                 parts.empty() ? absl::StrCat(key_name(key), " (seq ", seq, ")")
                                 : ops.size() > 1 ? absl::StrCat("it (", key_name(key), ")")
                                                  : std::string("it")));
  }
  for (const auto& [last, ranks] : never) {
    parts.push_back(absl::StrCat(Ranks(ranks), " never started it (last: ", last_of(last, ranks.front()), ")"));
  }
  if (!out_of_ring.empty()) {
    parts.push_back(absl::StrCat(Ranks(out_of_ring), ": seq ", seq, " is older than ",
                                 Verb(out_of_ring, "its ring", "their rings")));
  }
  if (!missing.empty()) parts.push_back(missing_part());
  std::string out = absl::StrCat(step_prefix(example), absl::StrJoin(parts, "; "));
  if (ops.size() > 1) {
    absl::StrAppend(&out, "; the ranks issued different collectives as seq ", seq,
                    " (their collective order differs)");
  }
  return out;
}

absl::Status FlightRecords::Report(const v1::FlightRecord& record, int world_size) {
  if (absl::Status s = ValidateFlightRecord(record, world_size); !s.ok()) return s;
  absl::MutexLock l(&mu_);
  by_rank_[record.rank()] = record;
  return absl::OkStatus();
}

std::vector<v1::FlightRecord> FlightRecords::Reported() const {
  absl::MutexLock l(&mu_);
  std::vector<v1::FlightRecord> out;
  out.reserve(by_rank_.size());
  for (const auto& [r, rec] : by_rank_) out.push_back(rec);
  return out;
}

bool FlightRecords::Has(int rank) const {
  absl::MutexLock l(&mu_);
  return by_rank_.count(rank) > 0;
}

bool FlightRecords::empty() const {
  absl::MutexLock l(&mu_);
  return by_rank_.empty();
}

std::map<int, std::string> HeartbeatNotes(Coordinator& coordinator) {
  std::map<int, std::string> notes;
  const JobStatus j = coordinator.GetJob();
  for (const RankState& r : j.ranks) {
    if (!r.joined) {
      notes[r.rank] = "never joined";
      continue;
    }
    notes[r.rank] = absl::StrCat("last heartbeat ", Secs(absl::ToDoubleSeconds(j.now - r.last_heartbeat)),
                                 " ago, at step ", r.step);
  }
  return notes;
}

std::string ReportedDivergence(const FlightRecords& records, Coordinator& coordinator) {
  if (records.empty()) return "";
  return FirstDivergence(records.Reported(), coordinator.options().world_size, HeartbeatNotes(coordinator));
}

}  // namespace shardopt
