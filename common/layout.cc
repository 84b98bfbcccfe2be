#include "common/layout.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace shardopt {

absl::StatusOr<int64_t> NumElements(const std::vector<int64_t>& shape, int64_t max_elements) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) return absl::InvalidArgumentError(absl::StrCat("negative dimension ", d));
    if (d != 0 && n > max_elements / d) {
      return absl::InvalidArgumentError(
          absl::StrCat("more than ", max_elements, " elements (absurd size)"));
    }
    n *= d;
  }
  return n;
}

absl::StatusOr<std::vector<Piece>> Layout::Locate(int param, int64_t begin, int64_t end) const {
  if (param < 0 || param >= static_cast<int>(params_.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("parameter index ", param, " out of range [0, ", params_.size(), ")"));
  }
  const ParamPlacement& pl = placements_[param];
  if (pl.bucket < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("parameter '", params_[param].name, "' is frozen and has no shard"));
  }
  if (begin < 0 || end < begin || end > pl.numel) {
    return absl::OutOfRangeError(absl::StrCat("element range [", begin, ", ", end,
                                              ") is outside parameter '", params_[param].name,
                                              "' of ", pl.numel, " elements"));
  }
  const Bucket& b = buckets_[pl.bucket];
  const int64_t cap = b.capacity_per_rank;
  std::vector<Piece> out;
  int64_t pos = begin;
  while (pos < end) {
    const int64_t off = pl.bucket_offset + pos;
    const int rank = static_cast<int>(off / cap);
    const int64_t rank_end = (static_cast<int64_t>(rank) + 1) * cap;
    const int64_t len = std::min(end - pos, rank_end - off);
    out.push_back(Piece{param, pos, len, pl.bucket, rank, off - static_cast<int64_t>(rank) * cap});
    pos += len;
  }
  return out;
}

absl::StatusOr<int> Layout::FindParam(absl::string_view name) const {
  for (size_t i = 0; i < params_.size(); ++i) {
    if (params_[i].name == name) return static_cast<int>(i);
  }
  return absl::NotFoundError(absl::StrCat("no parameter named '", name, "'"));
}

std::vector<Piece> Layout::AllPieces() const {
  std::vector<Piece> out;
  for (const Bucket& b : buckets_) {
    for (int p : b.params) {
      auto pieces = Locate(p, 0, placements_[p].numel);
      out.insert(out.end(), pieces->begin(), pieces->end());
    }
  }
  return out;
}

std::vector<Piece> Layout::PiecesOfRank(int rank) const {
  std::vector<Piece> out;
  for (const Piece& piece : AllPieces()) {
    if (piece.rank == rank) out.push_back(piece);
  }
  // AllPieces is in (bucket, offset) order; within a bucket a rank's pieces
  // are already increasing in rank_offset because params are offset-sorted.
  return out;
}

int64_t Layout::padding_elements(int bucket) const {
  const Bucket& b = buckets_[bucket];
  return b.capacity_per_rank * world_size_ - b.num_elements;
}

double Layout::imbalance() const {
  if (owned_.empty() || num_elements_ == 0) return 1.0;
  const int64_t mx = *std::max_element(owned_.begin(), owned_.end());
  const double mean = static_cast<double>(num_elements_) / world_size_;
  return static_cast<double>(mx) / mean;
}

int Layout::num_cut_tensors() const {
  int n = 0;
  for (const Bucket& b : buckets_) n += b.num_cut;
  return n;
}

namespace {

// FNV-1a, 64 bit: simple, stable across platforms and library versions.
class Fnv1a {
 public:
  void Bytes(const void* data, size_t n) {
    const auto* p = static_cast<const unsigned char*>(data);
    for (size_t i = 0; i < n; ++i) {
      h_ ^= p[i];
      h_ *= 1099511628211ull;
    }
  }
  void Int(int64_t v) {
    unsigned char buf[8];
    for (int i = 0; i < 8; ++i)
      buf[i] = static_cast<unsigned char>((static_cast<uint64_t>(v) >> (8 * i)) & 0xff);
    Bytes(buf, 8);
  }
  void Str(const std::string& s) {
    Int(static_cast<int64_t>(s.size()));
    Bytes(s.data(), s.size());
  }
  uint64_t value() const { return h_; }

 private:
  uint64_t h_ = 14695981039346656037ull;
};

}  // namespace

void Layout::Finalize() {
  owned_.assign(world_size_, 0);
  flat_size_ = 0;
  num_elements_ = 0;
  for (Bucket& b : buckets_) {
    b.flat_offset = flat_size_;
    flat_size_ += b.capacity_per_rank * world_size_;
    num_elements_ += b.num_elements;
    b.num_cut = 0;
    for (int p : b.params) {
      const ParamPlacement& pl = placements_[p];
      const int first = static_cast<int>(pl.bucket_offset / b.capacity_per_rank);
      const int last = static_cast<int>((pl.bucket_offset + pl.numel - 1) / b.capacity_per_rank);
      if (first != last) ++b.num_cut;
    }
  }
  for (const Piece& piece : AllPieces()) owned_[piece.rank] += piece.length;

  Fnv1a h;
  h.Str("shardopt-layout-v1");
  h.Int(world_size_);
  h.Int(options_.bucket_cap_elements);
  h.Int(options_.alignment_elements);
  h.Int(options_.allow_cut ? 1 : 0);
  h.Int(static_cast<int64_t>(params_.size()));
  for (size_t i = 0; i < params_.size(); ++i) {
    const ParamSpec& s = params_[i];
    h.Str(s.name);
    h.Int(static_cast<int64_t>(s.shape.size()));
    for (int64_t d : s.shape) h.Int(d);
    h.Int(static_cast<int64_t>(s.dtype));
    h.Int(s.trainable ? 1 : 0);
    h.Int(placements_[i].bucket);
    h.Int(placements_[i].bucket_offset);
  }
  for (const Bucket& b : buckets_) h.Int(b.capacity_per_rank);
  hash_ = h.value();
}

std::string Layout::Summary() const {
  std::string out = absl::StrFormat(
      "layout %016x: %d ranks, %d buckets, %d params (%d elements), padding %d, imbalance %.5f, "
      "%d cut tensors",
      hash_, world_size_, buckets_.size(), params_.size(), num_elements_, padding_elements(),
      imbalance(), num_cut_tensors());
  return out;
}

}  // namespace shardopt
