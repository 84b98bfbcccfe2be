#include "tools/cli/top_view.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace shardopt {
namespace {

constexpr char kReverse[] = "\x1b[7m";
constexpr char kPlain[] = "\x1b[0m";

bool Known(double v) { return std::isfinite(v) && v > 0; }

// Text from the network reaches the terminal only as printable ASCII: a job id
// or a slow reason cannot move the cursor or change the terminal's mode.
std::string Printable(const std::string& s) {
  std::string out = s;
  for (char& c : out) {
    const unsigned char u = static_cast<unsigned char>(c);
    if (u < 0x20 || u >= 0x7f) c = '?';
  }
  return out;
}

std::string Cut(const std::string& s, int width) {
  if (width > 0 && s.size() > static_cast<size_t>(width)) return s.substr(0, width);
  return s;
}

bool Joined(const v1::RankStatus& r) { return !r.address().empty(); }

bool Dead(const v1::GetJobResponse& job, const v1::RankStatus& r) {
  // After a job ends its ranks stop beating: that is not death.
  return Joined(r) && !r.alive() && (job.state() == "running" || job.state() == "starting");
}

int64_t MemoryBytes(const v1::RankMetrics& m) {
  if (m.rss_bytes() > 0) return m.rss_bytes();
  const int64_t roles =
      std::max<int64_t>(0, m.master_bytes()) + std::max<int64_t>(0, m.state_bytes()) +
      std::max<int64_t>(0, m.grad_bytes()) + std::max<int64_t>(0, m.param_bytes());
  return roles;
}

// "%c%5s %8s %7s %7s %9s %7s %7s %9s %7s  %s": marker, rank, step, step time
// p50 and max, samples/s, exposed communication, optimizer update, memory,
// heartbeat age, note.
std::string Row(char marker, const std::string& rank, const std::string& step,
                const std::string& p50, const std::string& max, const std::string& sps,
                const std::string& comm, const std::string& optim, const std::string& mem,
                const std::string& hb, const std::string& note) {
  std::string line = absl::StrFormat("%c%4s %7s %6s %6s %7s %6s %6s %9s %6s", marker, rank, step,
                                     p50, max, sps, comm, optim, mem, hb);
  if (!note.empty()) absl::StrAppend(&line, "  ", note);
  return line;
}

std::string Header(const v1::GetJobResponse& job) {
  std::string lr = Known(job.learning_rate()) ? absl::StrFormat("%g", job.learning_rate()) : "-";
  if (Known(job.requested_learning_rate()) && static_cast<float>(job.requested_learning_rate()) !=
                                                  static_cast<float>(job.learning_rate())) {
    lr += absl::StrFormat(" (%g requested)", job.requested_learning_rate());
  }
  std::set<int> slow(job.slow_ranks().begin(), job.slow_ranks().end());
  for (const auto& r : job.ranks()) {
    if (r.slow()) slow.insert(r.rank());
  }
  const std::string job_id = job.job_id().empty() ? "-" : Printable(job.job_id());
  const std::string state = job.state().empty() ? "-" : Printable(job.state());
  return absl::StrCat("job ", job_id, "  ", state, "  ", job.world_size(),
                      job.world_size() == 1 ? " rank" : " ranks", "  step ", job.step(), "  lr ",
                      lr, "  up ", TopDuration(job.duration_seconds()),
                      "  slow ranks: ", slow.empty() ? "none" : absl::StrJoin(slow, ","));
}

}  // namespace

std::string TopSeconds(double s) {
  if (!Known(s)) return "-";
  if (s < 1e-3) return absl::StrFormat("%.0fus", s * 1e6);
  if (s < 0.01) return absl::StrFormat("%.2fms", s * 1e3);
  if (s < 0.1) return absl::StrFormat("%.1fms", s * 1e3);
  if (s < 1) return absl::StrFormat("%.0fms", s * 1e3);
  if (s < 100) return absl::StrFormat("%.2fs", s);
  return absl::StrFormat("%.0fs", s);
}

std::string TopBytes(int64_t b) {
  if (b <= 0) return "-";
  if (b >= (int64_t{1} << 30)) return absl::StrFormat("%.2f GiB", b / 1073741824.0);
  if (b >= (1 << 20)) return absl::StrFormat("%.1f MiB", b / 1048576.0);
  if (b >= (1 << 10)) return absl::StrFormat("%.1f KiB", b / 1024.0);
  return absl::StrCat(b, " B");
}

std::string TopDuration(double s) {
  if (!Known(s)) return "-";
  const int64_t t = static_cast<int64_t>(std::min(s, 1e15));
  const int64_t d = t / 86400, h = t / 3600 % 24, m = t / 60 % 60, sec = t % 60;
  if (d > 0) return absl::StrFormat("%dd%02dh", d, h);
  if (h > 0) return absl::StrFormat("%dh%02dm%02ds", h, m, sec);
  if (m > 0) return absl::StrFormat("%dm%02ds", m, sec);
  return absl::StrFormat("%ds", sec);
}

std::string MembershipLine(const v1::GetJobResponse& job) {
  if (job.epoch() <= 0 && job.resize_pending_world() <= 0) return "";
  std::string line = absl::StrCat("membership: epoch ", job.epoch());
  if (!job.membership().empty()) {
    const auto& m = job.membership(job.membership_size() - 1);
    absl::StrAppend(&line, "; last change at step ", m.step(), ": ", m.from_world(), " -> ",
                    m.to_world(), " ranks");
    if (!m.left().empty()) {
      absl::StrAppend(&line, m.lost() ? ", lost (recovered from replicas): " : ", left: ",
                      absl::StrJoin(m.left(), ", "));
    }
    if (!m.joined().empty()) absl::StrAppend(&line, ", joined: ", absl::StrJoin(m.joined(), ", "));
    absl::StrAppend(&line, absl::StrFormat(", %.2fs", m.seconds()));
  }
  if (job.resize_pending_world() > 0) {
    absl::StrAppend(&line, "; resize to ", job.resize_pending_world(), " ranks pending");
  }
  return line;
}

int SlowestRank(const v1::GetJobResponse& job) {
  // By step time over the window: the highest p50 (then max) is the slowest.
  int best = -1, known = 0;
  double lo = 0;
  for (int i = 0; i < job.ranks_size(); ++i) {
    const v1::RankStatus& r = job.ranks(i);
    if (!Known(r.step_seconds_p50())) continue;
    lo = ++known == 1 ? r.step_seconds_p50() : std::min(lo, r.step_seconds_p50());
    if (best < 0 || r.step_seconds_p50() > job.ranks(best).step_seconds_p50() ||
        (r.step_seconds_p50() == job.ranks(best).step_seconds_p50() &&
         r.step_seconds_max() > job.ranks(best).step_seconds_max())) {
      best = i;
    }
  }
  // All equal: nobody is slower than the rest.
  if (known >= 2) return job.ranks(best).step_seconds_p50() > lo ? job.ranks(best).rank() : -1;
  // No window times yet: the lowest throughput.
  best = -1;
  known = 0;
  double hi = 0;
  for (int i = 0; i < job.ranks_size(); ++i) {
    const v1::RankStatus& r = job.ranks(i);
    if (!Known(r.samples_per_s())) continue;
    hi = ++known == 1 ? r.samples_per_s() : std::max(hi, r.samples_per_s());
    if (best < 0 || r.samples_per_s() < job.ranks(best).samples_per_s()) best = i;
  }
  return known >= 2 && job.ranks(best).samples_per_s() < hi ? job.ranks(best).rank() : -1;
}

namespace {

// Which ranks fit: all, or the ones that matter (slowest, named slow, dead)
// and then the lowest ranks, in rank order, plus one summary line.
std::vector<int> ShownRanks(const v1::GetJobResponse* job, int n, int slowest, int room) {
  std::vector<int> shown;  // indexes into job->ranks()
  if (room >= n) {
    for (int i = 0; i < n; ++i) shown.push_back(i);
  } else if (room >= 2) {
    const int take = room - 1;
    std::vector<bool> chosen(n, false);
    auto pick = [&](auto pred) {
      for (int i = 0; i < n && static_cast<int>(shown.size()) < take; ++i) {
        if (!chosen[i] && pred(job->ranks(i))) {
          chosen[i] = true;
          shown.push_back(i);
        }
      }
    };
    pick([&](const v1::RankStatus& r) { return r.rank() == slowest; });
    pick([&](const v1::RankStatus& r) { return r.slow(); });
    pick([&](const v1::RankStatus& r) { return Dead(*job, r); });
    pick([](const v1::RankStatus&) { return true; });
    std::sort(shown.begin(), shown.end());
  }
  return shown;
}

// One rank's line of the frame, cut to the width (and highlighted when asked).
std::string RankLine(const v1::GetJobResponse* job, const v1::RankStatus& r, int slowest,
                     const TopViewOptions& o) {
  std::vector<std::string> notes;
  if (r.rank() == slowest) notes.push_back("slowest");
  if (r.slow())
    notes.push_back(r.slow_reason().empty() ? "SLOW" : "SLOW: " + Printable(r.slow_reason()));
  if (!Joined(r)) notes.push_back("not joined");
  const char marker = r.rank() == slowest ? '*' : r.slow() ? '!' : ' ';
  std::string line;
  if (!Joined(r)) {
    line = Row(marker, absl::StrCat(r.rank()), "-", "-", "-", "-", "-", "-", "-", "-",
               absl::StrJoin(notes, ", "));
  } else {
    const v1::RankMetrics& m = r.metrics();
    const std::string hb = Dead(*job, r) ? "DEAD"
                           : r.seconds_since_heartbeat() < 0
                               ? "-"
                               : absl::StrFormat("%.1fs", r.seconds_since_heartbeat());
    line = Row(marker, absl::StrCat(r.rank()), absl::StrCat(r.step()),
               TopSeconds(r.step_seconds_p50()), TopSeconds(r.step_seconds_max()),
               Known(r.samples_per_s()) ? absl::StrFormat("%.1f", r.samples_per_s()) : "-",
               TopSeconds(m.comm_wait_seconds()), TopSeconds(m.update_seconds()),
               TopBytes(MemoryBytes(m)), hb, absl::StrJoin(notes, ", "));
  }
  line = Cut(line, o.width);
  if (o.highlight && r.rank() == slowest) {
    if (o.width > 0) line.resize(o.width, ' ');
    line = absl::StrCat(kReverse, line, kPlain);
  }
  return line;
}

}  // namespace

std::vector<std::string> RenderTopView(const v1::GetJobResponse* job, const TopViewOptions& o) {
  std::vector<std::string> lines;
  auto finish = [&]() {
    if (o.height > 0 && lines.size() > static_cast<size_t>(o.height)) lines.resize(o.height);
    return lines;
  };
  if (job == nullptr) {
    lines.push_back(
        Cut(Printable(o.status.empty() ? "waiting for the coordinator" : o.status), o.width));
    return finish();
  }
  lines.push_back(Cut(Header(*job), o.width));
  if (!job->failure().empty())
    lines.push_back(Cut("failure: " + Printable(job->failure()), o.width));
  if (const std::string m = MembershipLine(*job); !m.empty()) lines.push_back(Cut(m, o.width));
  if (!o.status.empty()) lines.push_back(Cut(Printable(o.status), o.width));
  lines.push_back(Cut(Row(' ', "rank", "step", "t p50", "t max", "samp/s", "comm", "optim",
                          "memory", "hb age", "note"),
                      o.width));

  const int n = job->ranks_size();
  if (n == 0) {
    lines.push_back(
        Cut(absl::StrCat("(no rank has joined yet; ", job->world_size(), " expected)"), o.width));
    return finish();
  }
  const int slowest = SlowestRank(*job);

  const int room = o.height > 0 ? o.height - static_cast<int>(lines.size()) : n;
  const std::vector<int> shown = ShownRanks(job, n, slowest, room);

  for (int i : shown) lines.push_back(RankLine(job, job->ranks(i), slowest, o));
  if (static_cast<int>(shown.size()) < n && room >= 1) {
    const int more = n - static_cast<int>(shown.size());
    lines.push_back(
        Cut(absl::StrCat("... ", more, more == 1 ? " more rank" : " more ranks"), o.width));
  }
  return finish();
}

}  // namespace shardopt
