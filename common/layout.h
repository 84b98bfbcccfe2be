// The partition of a model's trainable parameters over the ranks of a job.
//
// A Layout is produced by Plan() (planner.h) and is immutable afterwards, so it
// is safe to share between threads. It is deterministic: the same parameters,
// world size and options give the same Layout, and the same hash(), on every
// rank and machine.
#ifndef SHARDOPT_COMMON_LAYOUT_H_
#define SHARDOPT_COMMON_LAYOUT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/param_spec.h"

namespace shardopt {

// Planner options. Defaults are what ShardedOptimizer uses.
struct PlanOptions {
  // Upper bound on the parameter elements of one bucket. A single tensor larger
  // than the cap gets a bucket of its own (tensors never span buckets).
  // Default: 25 MiB of fp32, PyTorch DDP's bucket (smaller buckets start the
  // last reduce-scatter and the first all-gather sooner: less exposed).
  int64_t bucket_cap_elements = 25 * 1024 * 1024 / 4;
  // Every rank's range in a bucket holds a multiple of this many elements, so
  // each rank's range starts aligned (64 fp32 elements = 256 bytes). Power of 2.
  int64_t alignment_elements = 64;
  // When true, a tensor that fits whole on no rank is cut at rank boundaries
  // (every parameter stays one contiguous span). When false, every tensor is
  // owned whole by one rank and ranks are padded to the largest share.
  bool allow_cut = true;
};

// A contiguous run of one parameter's elements owned by one rank.
struct Piece {
  int param = -1;            // index into Layout::params()
  int64_t param_offset = 0;  // first element of the run within the parameter
  int64_t length = 0;        // number of elements
  int bucket = -1;
  int rank = -1;
  int64_t rank_offset = 0;  // offset of the run within the rank's range of the bucket

  bool operator==(const Piece& o) const {
    return param == o.param && param_offset == o.param_offset && length == o.length &&
           bucket == o.bucket && rank == o.rank && rank_offset == o.rank_offset;
  }
};

struct Bucket {
  int index = 0;
  // Offset of this bucket in the flat, bucket-ordered buffer (elements).
  int64_t flat_offset = 0;
  // Elements of every rank's range; the bucket's buffer is the ranks' ranges in
  // rank order, so it holds capacity_per_rank * world_size elements.
  int64_t capacity_per_rank = 0;
  // Parameter elements in the bucket (the rest is padding).
  int64_t num_elements = 0;
  // Parameters in the bucket, in increasing order of their bucket offset.
  std::vector<int> params;
  // Parameters of this bucket whose elements span more than one rank.
  int num_cut = 0;
};

// Where a parameter lives: one contiguous span of its bucket's buffer.
struct ParamPlacement {
  int bucket = -1;            // -1 for frozen parameters
  int64_t bucket_offset = 0;  // element offset of the parameter's first element
  int64_t numel = 0;
};

class Layout {
 public:
  Layout() = default;

  int world_size() const { return world_size_; }
  const PlanOptions& options() const { return options_; }
  const std::vector<ParamSpec>& params() const { return params_; }
  const std::vector<Bucket>& buckets() const { return buckets_; }
  const ParamPlacement& placement(int param) const { return placements_[param]; }

  // Elements of the flat, bucket-ordered buffer (all buckets, padding included).
  int64_t flat_size() const { return flat_size_; }
  // Parameter elements planned (trainable parameters only).
  int64_t num_elements() const { return num_elements_; }

  // Which (bucket, rank, offset) hold elements [begin, end) of `param`, in
  // increasing element order. Errors: unknown or frozen parameter, bad range.
  absl::StatusOr<std::vector<Piece>> Locate(int param, int64_t begin, int64_t end) const;
  // Index of the parameter named `name`; NotFound otherwise.
  absl::StatusOr<int> FindParam(absl::string_view name) const;

  // Every piece owned by `rank`, in flat-buffer order.
  std::vector<Piece> PiecesOfRank(int rank) const;
  // Every piece of every trainable parameter, in flat-buffer order.
  std::vector<Piece> AllPieces() const;

  // Per-rank owned parameter elements (padding excluded).
  const std::vector<int64_t>& owned_elements() const { return owned_; }
  int64_t padding_elements() const { return flat_size_ - num_elements_; }
  int64_t padding_elements(int bucket) const;
  // max / mean of owned elements over ranks (1.0 is perfect balance).
  double imbalance() const;
  // Parameters whose elements span more than one rank.
  int num_cut_tensors() const;

  // Stable 64-bit hash of everything above (FNV-1a over a canonical encoding);
  // equal on every machine for equal layouts. Ranks compare it at start-up.
  uint64_t hash() const { return hash_; }

  // A short human-readable summary (buckets, imbalance, padding, cuts).
  std::string Summary() const;

 private:
  friend class LayoutBuilder;
  void Finalize();  // computes owned_, flat offsets, cuts and hash

  int world_size_ = 0;
  PlanOptions options_;
  std::vector<ParamSpec> params_;
  std::vector<ParamPlacement> placements_;
  std::vector<Bucket> buckets_;
  std::vector<int64_t> owned_;
  int64_t flat_size_ = 0;
  int64_t num_elements_ = 0;
  uint64_t hash_ = 0;
};

// Number of elements of a tensor of `shape`; error on negative dimensions or
// overflow beyond `max_elements`.
absl::StatusOr<int64_t> NumElements(const std::vector<int64_t>& shape, int64_t max_elements);

}  // namespace shardopt

#endif  // SHARDOPT_COMMON_LAYOUT_H_
