#include "common/planner.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <numeric>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"

namespace shardopt {

// Fills a Layout's private state; only the planner builds layouts.
class LayoutBuilder {
 public:
  static absl::StatusOr<Layout> Build(const std::vector<ParamSpec>& params, int world_size,
                                      const PlanOptions& options);

 private:
  static absl::Status Validate(const std::vector<ParamSpec>& params, int world_size,
                               const PlanOptions& options, std::vector<int64_t>* numel);
  // Places the parameters of one bucket; fills capacity and placements.
  static void PlaceBucket(Layout* layout, Bucket* bucket, const std::vector<int64_t>& numel);
  // PlaceBucket's second phase: places rank r's `whole` tensors and streams
  // `deferred` through the free space, in rank order.
  static void StreamDeferred(Layout* layout, const Bucket& bucket,
                             const std::vector<int64_t>& numel, std::vector<int64_t>* free,
                             std::vector<std::vector<int>>* whole,
                             const std::vector<int>& deferred);
  static void PlaceWhole(Layout* layout, Bucket* bucket, const std::vector<int64_t>& numel);
};

namespace {

int64_t RoundUp(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

// PlaceBucket's first phase. Greedy: largest first (ties: bucket order),
// whole, onto the rank with the most free capacity (ties: lowest rank).
// Rank r's tensors go to (*whole)[r], their sizes off (*free)[r]; returns the
// tensors that did not fit, in bucket order.
std::vector<int> PlaceLargestFirst(const std::vector<int>& params,
                                   const std::vector<int64_t>& numel, std::vector<int64_t>* free,
                                   std::vector<std::vector<int>>* whole) {
  std::vector<int> order(params.begin(), params.end());
  std::vector<int> position(numel.size(), 0);
  for (size_t k = 0; k < params.size(); ++k) position[params[k]] = static_cast<int>(k);
  std::stable_sort(order.begin(), order.end(), [&](int x, int y) { return numel[x] > numel[y]; });
  std::vector<int> deferred;
  for (int p : order) {
    const int r = static_cast<int>(std::max_element(free->begin(), free->end()) - free->begin());
    if ((*free)[r] >= numel[p]) {
      (*whole)[r].push_back(p);
      (*free)[r] -= numel[p];
    } else {
      deferred.push_back(p);
    }
  }
  std::sort(deferred.begin(), deferred.end(),
            [&](int x, int y) { return position[x] < position[y]; });
  return deferred;
}

}  // namespace

absl::Status LayoutBuilder::Validate(const std::vector<ParamSpec>& params, int world_size,
                                     const PlanOptions& options, std::vector<int64_t>* numel) {
  if (world_size < 1 || world_size > kMaxWorldSize) {
    return absl::InvalidArgumentError(
        absl::StrCat("world size must be in [1, ", kMaxWorldSize, "], got ", world_size));
  }
  if (params.empty()) return absl::InvalidArgumentError("the parameter list is empty");
  if (options.bucket_cap_elements < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("bucket cap must be at least 1 element, got ", options.bucket_cap_elements));
  }
  const int64_t a = options.alignment_elements;
  if (a < 1 || a > kMaxAlignment || (a & (a - 1)) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("alignment must be a power of two in [1, ",
                                                   kMaxAlignment, "] elements, got ", a));
  }
  absl::flat_hash_set<std::string> names;
  int64_t total = 0;
  numel->assign(params.size(), 0);
  for (size_t i = 0; i < params.size(); ++i) {
    const ParamSpec& s = params[i];
    if (s.name.empty() || s.name.size() > kMaxNameLength) {
      return absl::InvalidArgumentError(absl::StrCat("parameter #", i, " has a name of length ",
                                                     s.name.size(), " (must be 1..", kMaxNameLength,
                                                     ")"));
    }
    if (!names.insert(s.name).second) {
      return absl::InvalidArgumentError(absl::StrCat("duplicate parameter name '", s.name, "'"));
    }
    auto n = NumElements(s.shape, kMaxParamElements);
    if (!n.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameter '", s.name, "': ", n.status().message()));
    }
    if (!s.trainable) continue;
    if (*n == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "parameter '", s.name,
          "' has zero elements; a zero-size tensor cannot be optimized (mark it frozen)"));
    }
    (*numel)[i] = *n;
    total += *n;
    if (total > kMaxTotalElements) {
      return absl::InvalidArgumentError(
          absl::StrCat("more than ", kMaxTotalElements, " trainable elements (absurd size)"));
    }
  }
  if (total == 0) return absl::InvalidArgumentError("no trainable parameters");
  return absl::OkStatus();
}

absl::StatusOr<Layout> LayoutBuilder::Build(const std::vector<ParamSpec>& params, int world_size,
                                            const PlanOptions& options) {
  std::vector<int64_t> numel;
  if (absl::Status s = Validate(params, world_size, options, &numel); !s.ok()) return s;

  Layout layout;
  layout.world_size_ = world_size;
  layout.options_ = options;
  layout.params_ = params;
  layout.placements_.assign(params.size(), ParamPlacement{});

  // Buckets in reverse registration order, the order backward produces
  // gradients; a tensor larger than the cap gets a bucket of its own.
  Bucket current;
  for (int i = static_cast<int>(params.size()) - 1; i >= 0; --i) {
    if (numel[i] == 0) continue;  // frozen
    if (!current.params.empty() && current.num_elements + numel[i] > options.bucket_cap_elements) {
      layout.buckets_.push_back(std::move(current));
      current = Bucket{};
    }
    current.params.push_back(i);
    current.num_elements += numel[i];
  }
  if (!current.params.empty()) layout.buckets_.push_back(std::move(current));

  for (size_t b = 0; b < layout.buckets_.size(); ++b) {
    Bucket& bucket = layout.buckets_[b];
    bucket.index = static_cast<int>(b);
    if (options.allow_cut) {
      PlaceBucket(&layout, &bucket, numel);
    } else {
      PlaceWhole(&layout, &bucket, numel);
    }
    std::sort(bucket.params.begin(), bucket.params.end(), [&](int x, int y) {
      return layout.placements_[x].bucket_offset < layout.placements_[y].bucket_offset;
    });
  }
  layout.Finalize();
  return layout;
}

void LayoutBuilder::PlaceBucket(Layout* layout, Bucket* bucket, const std::vector<int64_t>& numel) {
  const int n = layout->world_size_;
  const int64_t cap =
      RoundUp((bucket->num_elements + n - 1) / n, layout->options_.alignment_elements);
  bucket->capacity_per_rank = cap;

  std::vector<int64_t> free(n, cap);
  std::vector<std::vector<int>> whole(n);
  const std::vector<int> deferred = PlaceLargestFirst(bucket->params, numel, &free, &whole);
  StreamDeferred(layout, *bucket, numel, &free, &whole, deferred);
}

void LayoutBuilder::StreamDeferred(Layout* layout, const Bucket& bucket,
                                   const std::vector<int64_t>& numel, std::vector<int64_t>* free,
                                   std::vector<std::vector<int>>* whole,
                                   const std::vector<int>& deferred) {
  const int n = layout->world_size_;
  const int64_t cap = bucket.capacity_per_rank;
  // Stream the deferred tensors through the free space in rank order. Each
  // rank's range is [head: end of a tensor carried over from the previous
  // rank][its whole tensors][tail: tensors streamed from here on]. If a carried
  // tensor is longer than a rank's free space, that rank returns its whole
  // tensors to the stream so the carried tensor stays contiguous.
  std::deque<int> stream(deferred.begin(), deferred.end());
  int carry = -1;
  int64_t carry_left = 0;
  auto place = [&](int p, int64_t offset) {
    layout->placements_[p] = ParamPlacement{bucket.index, offset, numel[p]};
  };
  for (int r = 0; r < n; ++r) {
    const int64_t base = static_cast<int64_t>(r) * cap;
    int64_t pos = base;
    if (carry >= 0) {
      if (carry_left > (*free)[r]) {
        stream.insert(stream.begin(), (*whole)[r].begin(), (*whole)[r].end());
        (*whole)[r].clear();
        (*free)[r] = cap;
      }
      const int64_t take = std::min(carry_left, cap);
      pos += take;
      carry_left -= take;
      if (carry_left > 0) continue;  // the carried tensor fills this rank entirely
      carry = -1;
    }
    for (int p : (*whole)[r]) {
      place(p, pos);
      pos += numel[p];
    }
    while (pos < base + cap && !stream.empty()) {
      const int p = stream.front();
      stream.pop_front();
      place(p, pos);
      const int64_t room = base + cap - pos;
      if (numel[p] <= room) {
        pos += numel[p];
      } else {
        carry = p;
        carry_left = numel[p] - room;
        pos = base + cap;
      }
    }
  }
  // Invariant (capacity * n >= elements): everything was placed.
  if (!stream.empty() || carry >= 0) {
    std::fprintf(stderr, "planner bug: bucket %d did not fit its capacity\n", bucket.index);
    std::abort();
  }
}

void LayoutBuilder::PlaceWhole(Layout* layout, Bucket* bucket, const std::vector<int64_t>& numel) {
  const int n = layout->world_size_;
  std::vector<int> order(bucket->params.begin(), bucket->params.end());
  std::stable_sort(order.begin(), order.end(), [&](int x, int y) { return numel[x] > numel[y]; });
  // Longest-processing-time greedy: each tensor onto the least loaded rank.
  std::vector<int64_t> load(n, 0);
  std::vector<std::vector<int>> owned(n);
  for (int p : order) {
    const int r = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    owned[r].push_back(p);
    load[r] += numel[p];
  }
  const int64_t cap =
      RoundUp(*std::max_element(load.begin(), load.end()), layout->options_.alignment_elements);
  bucket->capacity_per_rank = cap;
  for (int r = 0; r < n; ++r) {
    int64_t pos = static_cast<int64_t>(r) * cap;
    for (int p : owned[r]) {
      layout->placements_[p] = ParamPlacement{bucket->index, pos, numel[p]};
      pos += numel[p];
    }
  }
}

absl::StatusOr<Layout> Plan(const std::vector<ParamSpec>& params, int world_size,
                            const PlanOptions& options) {
  return LayoutBuilder::Build(params, world_size, options);
}

}  // namespace shardopt
