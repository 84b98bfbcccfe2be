#include "server/slow_ranks.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace shardopt {
namespace {

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n == 0 ? 0 : n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// The median of `sorted` without one copy of `value` (which it holds).
double MedianWithout(const std::vector<double>& sorted, double value) {
  const size_t i = std::lower_bound(sorted.begin(), sorted.end(), value) - sorted.begin();
  const size_t m = sorted.size() - 1;
  auto other = [&](size_t j) { return j < i ? sorted[j] : sorted[j + 1]; };
  return m % 2 == 1 ? other(m / 2) : 0.5 * (other(m / 2 - 1) + other(m / 2));
}

}  // namespace

void SlowRankDetector::Reset(int world_size) {
  ranks_.assign(static_cast<size_t>(world_size), Rank());
}

void SlowRankDetector::AddBusy(int rank, double step_seconds, double comm_wait_seconds) {
  std::vector<double>& busy = ranks_[rank].busy;
  busy.push_back(std::max(0.0, step_seconds - comm_wait_seconds));
  if (busy.size() > 4096) busy.erase(busy.begin(), busy.begin() + 2048);
}

std::vector<SlowRankDetector::Verdict> SlowRankDetector::EndWindow(
    const std::vector<bool>& eligible) {
  const int n = static_cast<int>(ranks_.size());
  std::vector<double> p50(n, -1);
  std::vector<double> all;
  for (int r = 0; r < n; ++r) {
    if (r < static_cast<int>(eligible.size()) && eligible[r] && !ranks_[r].busy.empty()) {
      p50[r] = Median(std::move(ranks_[r].busy));
      all.push_back(p50[r]);
    }
    ranks_[r].busy.clear();
  }
  std::vector<Verdict> verdicts;
  if (all.size() < 2) return verdicts;
  std::sort(all.begin(), all.end());
  const double window_s = absl::ToDoubleSeconds(options_.window);
  const double min_excess = absl::ToDoubleSeconds(options_.min_excess);
  for (int r = 0; r < n; ++r) {
    if (p50[r] < 0) continue;  // no step in this window: no verdict
    const double median = MedianWithout(all, p50[r]);
    Rank& rk = ranks_[r];
    Verdict v;
    v.rank = r;
    v.busy_p50 = p50[r];
    v.ratio = median > 0 ? p50[r] / median : (p50[r] > 0 ? HUGE_VAL : 1);
    const bool over = p50[r] > options_.factor * median && p50[r] - median >= min_excess;
    rk.streak = over != rk.slow ? rk.streak + 1 : 0;
    if (rk.streak >= options_.windows) {
      rk.streak = 0;
      rk.slow = over;
      v.changed = true;
      const std::string ratio = median > 0 ? absl::StrFormat("%.1fx", p50[r] / median) : "above";
      const std::string what = absl::StrFormat(
          "busy time per step (step time minus waiting on collectives) p50 %.3g s, %s the median "
          "of the others (%.3g s), %d windows of %.3g s in a row",
          p50[r], ratio, median, options_.windows, window_s);
      v.reason = over ? what : "";
      v.event = absl::StrCat("rank ", r, over ? " is slow: " : " is no longer slow: ", what);
    }
    v.slow = rk.slow;
    verdicts.push_back(std::move(v));
  }
  return verdicts;
}

}  // namespace shardopt
