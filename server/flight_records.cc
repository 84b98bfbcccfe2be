#include "server/flight_records.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "server/coordinator.h"

namespace shardopt {

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
  if (record.reason().size() > kMaxFlightReasonBytes ||
      record.error().size() > kMaxFlightReasonBytes) {
    return absl::InvalidArgumentError(absl::StrCat(who, ": reason or error too long"));
  }
  if (!std::isfinite(record.captured_unix()) || record.captured_unix() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(who, ": bad captured_unix"));
  }
  for (const v1::CollectiveRecord& c : record.records()) {
    const std::string& op = c.op();
    const bool op_ok =
        !op.empty() && op.size() <= 32 && std::all_of(op.begin(), op.end(), [](char ch) {
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
    auto it =
        std::lower_bound(recs.begin(), recs.end(), seq,
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

// The records FirstDivergence reads, by rank.
struct Rings {
  std::map<int, Ring> by_rank;        // the ranks that sent a ring
  std::map<int, std::string> errors;  // the ranks that sent an error instead
  std::vector<int> missing;           // the ranks without a ring
  double ref = 0;                     // the latest time any record mentions
};

Rings LoadRings(const std::vector<v1::FlightRecord>& records, int world_size) {
  Rings rings;
  for (const v1::FlightRecord& r : records) {
    if (r.rank() < 0 || r.rank() >= world_size) continue;
    if (!r.error().empty()) {
      rings.errors[r.rank()] = r.error();
      continue;
    }
    Ring& ring = rings.by_rank[r.rank()];
    ring.rank = r.rank();
    ring.recs.clear();
    for (const v1::CollectiveRecord& c : r.records()) {
      ring.recs.push_back(&c);
      rings.ref = std::max({rings.ref, c.start_unix(), c.end_unix()});
    }
    std::sort(ring.recs.begin(), ring.recs.end(),
              [](const v1::CollectiveRecord* a, const v1::CollectiveRecord* b) {
                return a->seq() < b->seq();
              });
    rings.ref = std::max(rings.ref, r.captured_unix());
  }
  for (int r = 0; r < world_size; ++r) {
    if (!rings.by_rank.count(r)) rings.missing.push_back(r);
  }
  return rings;
}

// "rank 1 sent no record (dead?)", one phrase per rank with a note or an
// error, the others together.
std::string MissingPart(const Rings& rings, const std::map<int, std::string>& notes) {
  const std::vector<int>& missing = rings.missing;
  std::vector<std::string> parts;
  std::vector<int> plain;
  for (int r : missing) {
    auto n = notes.find(r);
    auto e = rings.errors.find(r);
    std::string detail;
    if (n != notes.end() && !n->second.empty()) detail = n->second;
    if (e != rings.errors.end() && e->second != detail) {
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
    parts.insert(parts.begin(), absl::StrCat(Ranks(plain), " sent no record",
                                             plain.size() == 1 ? " (dead?)" : "s (dead?)"));
  }
  return absl::StrJoin(parts, "; ");
}

// What each rank did with `seq`, the first collective some rank has not
// finished.
struct Census {
  using Key = std::pair<std::string, int>;  // op, bucket
  int64_t seq = INT64_MAX;
  std::map<Key, std::vector<int>> waiting, failed, done;
  std::map<Key, double> wait_for, failed_after;
  std::map<int64_t, std::vector<int>> never;  // by the last seq the rank has
  std::vector<int> out_of_ring;
  const v1::CollectiveRecord* example = nullptr;
  std::set<Key> ops;
};

Census TakeCensus(const Rings& rings) {
  Census s;
  for (const auto& [r, ring] : rings.by_rank) s.seq = std::min(s.seq, ring.FirstOpen());
  for (const auto& [r, ring] : rings.by_rank) {
    const v1::CollectiveRecord* c = ring.Find(s.seq);
    if (c == nullptr) {
      if (s.seq > ring.hi()) {
        s.never[ring.hi()].push_back(r);
      } else {
        s.out_of_ring.push_back(r);
      }
      continue;
    }
    if (s.example == nullptr) s.example = c;
    const Census::Key key{c->op(), c->bucket()};
    s.ops.insert(key);
    if (c->state() == "running") {
      s.waiting[key].push_back(r);
      s.wait_for[key] = std::max(s.wait_for[key], rings.ref - c->start_unix());
    } else if (c->state() == "failed") {
      s.failed[key].push_back(r);
      s.failed_after[key] = std::max(s.failed_after[key], c->end_unix() - c->start_unix());
    } else {
      s.done[key].push_back(r);
    }
  }
  return s;
}

// The last collective a rank finished, from its own ring.
std::string LastOf(const Rings& rings, int64_t last, int rank) {
  if (last == 0) return "no collective recorded";
  const v1::CollectiveRecord* c = rings.by_rank.at(rank).Find(last);
  if (c == nullptr) return absl::StrCat("seq ", last);
  std::string s = absl::StrCat(OpName(*c), ", seq ", last);
  if (c->state() == "done") {
    absl::StrAppend(&s, ", finished ", Secs(rings.ref - c->end_unix()), " ago");
  } else {
    absl::StrAppend(&s, ", ", c->state());
  }
  return s;
}

std::string StepPrefix(const v1::CollectiveRecord* c) {
  if (c == nullptr) return "";
  return c->step() > 0 ? absl::StrCat("step ", c->step(), ": ") : "at start-up: ";
}

// Every rank at the same place: in no collective, all waiting in the same
// one, or all in the same one when it failed. Nothing when they are not.
std::optional<std::string> SamePlace(const Rings& rings, const Census& s,
                                     const std::map<int, std::string>& notes) {
  const bool missing = !rings.missing.empty();
  if (s.example == nullptr && s.never.size() == 1 && s.out_of_ring.empty()) {
    const auto& [last, ranks] = *s.never.begin();
    const v1::CollectiveRecord* c = rings.by_rank.at(ranks.front()).Find(last);
    if (!missing) {
      return absl::StrCat(
          "no divergence: ", All(ranks.size()), " finished seq ", last,
          c != nullptr ? absl::StrCat(" (", OpName(*c), ", step ", c->step(), ")") : "",
          " and are in no collective");
    }
    return absl::StrCat(StepPrefix(c), MissingPart(rings, notes), "; ", Ranks(ranks), " ",
                        Verb(ranks, "is", "are"),
                        " in no collective (last: ", LastOf(rings, last, ranks.front()), ")");
  }
  if (!missing && s.failed.empty() && s.done.empty() && s.never.empty() && s.out_of_ring.empty() &&
      s.waiting.size() == 1) {
    const auto& [key, ranks] = *s.waiting.begin();
    return absl::StrCat("no divergence: ", All(ranks.size()), " are in ", OpName(*s.example),
                        " (seq ", s.seq, ", step ", s.example->step(), ", for ",
                        Secs(s.wait_for.at(key)), ")");
  }
  if (!missing && s.waiting.empty() && s.done.empty() && s.never.empty() && s.out_of_ring.empty() &&
      s.failed.size() == 1) {
    const auto& [key, ranks] = *s.failed.begin();
    return absl::StrCat("no divergence: ", All(ranks.size()), " were in ", OpName(*s.example),
                        " (seq ", s.seq, ", step ", s.example->step(), ") when it failed (after ",
                        Secs(s.failed_after.at(key)), ")");
  }
  return std::nullopt;
}

// A live job's rings are taken a few milliseconds apart: ranks that are at
// most a collective or two apart, none waiting for a second yet, are simply
// making progress. Nothing when they are not.
std::optional<std::string> MakingProgress(const Rings& rings, const Census& s) {
  if (!rings.missing.empty() || !s.failed.empty() || !s.out_of_ring.empty() || s.ops.size() != 1) {
    return std::nullopt;
  }
  double longest = 0;
  for (const auto& [key, t] : s.wait_for) longest = std::max(longest, t);
  for (const auto& [last, ranks] : s.never) {
    for (int r : ranks) {
      const v1::CollectiveRecord* c = rings.by_rank.at(r).Find(last);
      longest = std::max(longest, c != nullptr ? rings.ref - c->end_unix() : 1e9);
    }
  }
  if (!(longest < absl::ToDoubleSeconds(kFlightSettleTime))) return std::nullopt;
  int64_t ahead = s.seq;
  for (const auto& [r, ring] : rings.by_rank) ahead = std::max(ahead, ring.hi());
  return absl::StrCat("no divergence: the ranks are making progress (seq ", s.seq,
                      ahead > s.seq ? absl::StrCat("-", ahead) : "", ", step ", s.example->step(),
                      "; no rank has waited ", Secs(absl::ToDoubleSeconds(kFlightSettleTime)), ")");
}

std::string KeyName(const Census::Key& k) {
  v1::CollectiveRecord c;
  c.set_op(k.first);
  c.set_bucket(k.second);
  return OpName(c);
}

// One phrase per group of ranks that did the same with `seq`.
std::string Divergence(const Rings& rings, const Census& s,
                       const std::map<int, std::string>& notes) {
  std::vector<std::string> parts;
  for (const auto& [key, ranks] : s.waiting) {
    parts.push_back(absl::StrCat(Ranks(ranks), " ", Verb(ranks, "waits", "wait"), " in ",
                                 KeyName(key), " (seq ", s.seq, ", for ", Secs(s.wait_for.at(key)),
                                 ")"));
  }
  for (const auto& [key, ranks] : s.failed) {
    parts.push_back(absl::StrCat(Ranks(ranks), " waited in ", KeyName(key), " (seq ", s.seq,
                                 ") and failed after ", Secs(s.failed_after.at(key))));
  }
  for (const auto& [key, ranks] : s.done) {
    // The first phrase names the collective; later ones say "it".
    parts.push_back(absl::StrCat(Ranks(ranks), " finished ",
                                 parts.empty() ? absl::StrCat(KeyName(key), " (seq ", s.seq, ")")
                                 : s.ops.size() > 1 ? absl::StrCat("it (", KeyName(key), ")")
                                                    : std::string("it")));
  }
  for (const auto& [last, ranks] : s.never) {
    parts.push_back(absl::StrCat(
        Ranks(ranks), " never started it (last: ", LastOf(rings, last, ranks.front()), ")"));
  }
  if (!s.out_of_ring.empty()) {
    parts.push_back(absl::StrCat(Ranks(s.out_of_ring), ": seq ", s.seq, " is older than ",
                                 Verb(s.out_of_ring, "its ring", "their rings")));
  }
  if (!rings.missing.empty()) parts.push_back(MissingPart(rings, notes));
  std::string out = absl::StrCat(StepPrefix(s.example), absl::StrJoin(parts, "; "));
  if (s.ops.size() > 1) {
    absl::StrAppend(&out, "; the ranks issued different collectives as seq ", s.seq,
                    " (their collective order differs)");
  }
  return out;
}

}  // namespace

std::string FirstDivergence(const std::vector<v1::FlightRecord>& records, int world_size,
                            const std::map<int, std::string>& notes) {
  const Rings rings = LoadRings(records, world_size);
  if (rings.by_rank.empty()) {
    return rings.missing.empty() ? "no flight records" : MissingPart(rings, notes);
  }
  const Census census = TakeCensus(rings);
  if (std::optional<std::string> same = SamePlace(rings, census, notes)) return *same;
  if (std::optional<std::string> moving = MakingProgress(rings, census)) return *moving;
  return Divergence(rings, census, notes);
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
    notes[r.rank] =
        absl::StrCat("last heartbeat ", Secs(absl::ToDoubleSeconds(j.now - r.last_heartbeat)),
                     " ago, at step ", r.step);
  }
  return notes;
}

std::string ReportedDivergence(const FlightRecords& records, Coordinator& coordinator) {
  if (records.empty()) return "";
  return FirstDivergence(records.Reported(),
                         const_cast<Coordinator&>(coordinator).GetJob().world_size,
                         HeartbeatNotes(coordinator));
}

}  // namespace shardopt
