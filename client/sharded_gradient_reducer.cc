#include "client/sharded_gradient_reducer.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <optional>

#include "absl/strings/str_cat.h"

namespace shardopt {
namespace {

// The model's element type (of the setup's tensor options).
DType ModelDType(const torch::TensorOptions& o) {
  return DTypeOf(c10::typeMetaToScalarType(o.dtype()));
}

}  // namespace

ShardedGradientReducer::ShardedGradientReducer(const ReducerSetup& setup)
    : GradientReducer(setup), model_travels_as_is_(setup.comm_type == ModelDType(setup.options)) {
  int64_t owned = 0;
  for (const Bucket& b : layout_.buckets()) owned += b.capacity_per_rank;
  absl::MutexLock lock(&hooks_->mu);  // (no hook yet: for the analysis)
  owned_grad_flat_ = torch::zeros({owned}, setup_.options);
}

torch::Tensor ShardedGradientReducer::owner_grads() {
  absl::MutexLock lock(&hooks_->mu);
  return owned_grad_flat_;
}

torch::TensorOptions ShardedGradientReducer::staging_options() const {
  return setup_.options.dtype(ScalarTypeOf(setup_.comm_type));
}

void ShardedGradientReducer::Attach(std::vector<torch::Tensor> params) {
  for (torch::Tensor& p : params) p.mutable_grad() = torch::Tensor();  // handed over
  GradientReducer::Attach(std::move(params));
  Prepare();
}

void ShardedGradientReducer::OnGradReadyLocked(int param) {
  torch::Tensor& grad = params_[param].mutable_grad();
  torch::Tensor taken = std::move(grad);
  grad = torch::Tensor();
  OnGradLocked(param, std::move(taken));
}

void ShardedGradientReducer::ZeroGrad(bool set_to_none) {
  if (set_to_none) ClearHasGrad();
  absl::MutexLock lock(&hooks_->mu);
  // Reductions launched by a backward whose step never came end before
  // their buffers are reused.
  while (!in_flight_.empty()) (void)ReclaimLocked(in_flight_.front());
  ReleaseShardedBuffersLocked();
  ResetBackwardStateLocked(/*needs_zero_grad=*/false);
  hook_error_ = absl::OkStatus();
}

absl::Status ShardedGradientReducer::FinishBucket(int b, WaitFn /*wait*/,
                                                  CollectiveWaiter* waiter) {
  absl::MutexLock lock(&hooks_->mu);
  if (reclaimed_[b]) return absl::OkStatus();
  const int64_t t0 = NowNs();
  absl::Status s = ReclaimLocked(b);
  waiter->Add(NowNs() - t0);
  return s;
}

void ShardedGradientReducer::ReleaseAfterStepLocked() { ReleaseShardedBuffersLocked(); }

// Buffers of their own that buckets took while waiting for earlier ones in
// bucket order were the first step's; the report is the steady state.
void ShardedGradientReducer::OnOrderAgreedLocked() {
  overflow_peak_bytes_ = overflow_bytes_;
  overflow_shortfall_ = 0;
  UpdateGradBytesLocked();
}

void ShardedGradientReducer::OnStepInAgreedOrder() {
  absl::MutexLock lock(&hooks_->mu);
  if (arena_sized_) return;
  arena_sized_ = true;
  // Called between steps: nothing is placed or in flight.
  if (overflow_shortfall_ == 0 || !arena_.held().empty() || overflow_bytes_ > 0) return;
  arena_.set_size(arena_.size() + overflow_shortfall_);
  staging_ = torch::empty({arena_.size()}, staging_options());
  overflow_peak_bytes_ = 0;
  UpdateGradBytesLocked();
}

void ShardedGradientReducer::Prepare() {
  absl::MutexLock lock(&hooks_->mu);
  const int nb = static_cast<int>(layout_.buckets().size());
  gaps_.assign(nb, {});
  chunks_.assign(nb, {});
  arena_.Reset(nb);
  pieces_.clear();
  overflow_buf_.assign(nb, torch::Tensor());
  in_accum_.assign(nb, false);
  reclaimed_.assign(nb, false);
  split_own_ = comm_->SupportsSeparateChunks() && model_travels_as_is_;
  // A bucket of the cap holds at most the cap plus each rank's alignment.
  const int64_t cap_bucket =
      layout_.options().bucket_cap_elements + world_ * layout_.options().alignment_elements;
  std::vector<int64_t> stages;
  for (const Bucket& bk : layout_.buckets()) {
    const int64_t size = bk.capacity_per_rank * world_;
    int64_t at = 0;
    for (int p : bk.params) {
      const ParamPlacement& pl = layout_.placement(p);
      if (pl.bucket_offset > at) gaps_[bk.index].push_back({at, pl.bucket_offset - at});
      at = pl.bucket_offset + pl.numel;
    }
    if (size > at) gaps_[bk.index].push_back({at, size - at});
  }
  // A tensor whose reduce-scatter would stage more than a bucket of the cap
  // is reduced in pieces of that size (LaunchPiecesLocked).
  const int64_t align = std::max<int64_t>(1, layout_.options().alignment_elements);
  piece_elements_ = split_own_ && world_ > 1 && setup_.reduce_in_pieces
                        ? ((cap_bucket + world_ - 1) / world_ + align - 1) / align * align
                        : 0;
  for (const Bucket& bk : layout_.buckets()) {
    stages.push_back(PiecewiseLocked(bk.index) ? (world_ - 1) * piece_elements_
                                               : StageLength(bk.index));
  }
  // Room for grad_staging_buffers buckets of the cap (no more than the
  // largest buckets there are need), and at least for the largest bucket.
  std::sort(stages.rbegin(), stages.rend());
  const int staged_chunks = split_own_ ? world_ - 1 : world_;
  const int64_t cap_stage =
      std::max((cap_bucket + world_ - 1) / world_ * staged_chunks, (world_ - 1) * piece_elements_);
  int64_t largest_k = 0;
  for (int i = 0; i < setup_.staging_buffers && i < static_cast<int>(stages.size()); ++i) {
    largest_k += stages[i];
  }
  arena_.set_size(stages.empty() ? 0
                                 : std::max(stages[0], std::min(largest_k, setup_.staging_buffers *
                                                                               cap_stage)));
  UpdateGradBytesLocked();
}

int64_t ShardedGradientReducer::StageLength(int b) const {
  const int64_t cap = layout_.buckets()[b].capacity_per_rank;
  return (split_own_ ? world_ - 1 : world_) * cap;
}

torch::Tensor ShardedGradientReducer::AccumView(int param) {
  const ParamPlacement& pl = layout_.placement(param);
  return accum_flat_.narrow(0, layout_.buckets()[pl.bucket].flat_offset + pl.bucket_offset,
                            pl.numel);
}

void ShardedGradientReducer::UpdateGradBytesLocked() {
  auto bytes = [](const torch::Tensor& t) {
    return t.defined() ? t.numel() * t.element_size() : 0;
  };
  grad_bytes_ =
      bytes(owned_grad_flat_) + bytes(accum_flat_) + bytes(staging_) + overflow_peak_bytes_;
}

template <typename Fn>
void ShardedGradientReducer::ForChunks(int b, int64_t offset, int64_t length, Fn fn) {
  const int64_t cap = layout_.buckets()[b].capacity_per_rank;
  const int64_t end = offset + length;
  for (int64_t at = offset; at < end;) {
    const int r = static_cast<int>(at / cap);
    const int64_t stop = std::min(end, (r + 1) * cap);
    fn(chunks_[b][r].narrow(0, at - r * cap, stop - at), at - offset, stop - at);
    at = stop;
  }
}

void ShardedGradientReducer::WriteGradLocked(int b, int64_t offset, const torch::Tensor& flat) {
  ForChunks(b, offset, flat.numel(), [&](torch::Tensor dst, int64_t from, int64_t n) {
    dst.copy_(flat.narrow(0, from, n));
  });
}

void ShardedGradientReducer::ZeroGradRangeLocked(int b, int64_t offset, int64_t length) {
  ForChunks(b, offset, length, [](torch::Tensor dst, int64_t, int64_t) { dst.zero_(); });
}

void ShardedGradientReducer::OnGradLocked(int param, torch::Tensor g) {
  const ParamPlacement& pl = layout_.placement(param);
  const int b = pl.bucket;
  tracer_->Add(TraceEvent::kGradReady, b, param);
  ++grads_seen_;
  if (needs_zero_grad_) {
    grad_after_step_ = true;
    return;
  }
  if (!g.defined()) return;
  has_grad_[param] = 1;
  at::NoGradGuard no_grad;
  if (!sync_) {  // accumulate locally; reduced with the last micro-batch
    if (!accum_flat_.defined()) {
      accum_flat_ = torch::zeros({layout_.flat_size()}, setup_.options);
      UpdateGradBytesLocked();
    }
    AccumView(param).add_(g.reshape({-1}));
    return;
  }
  if (ready_[param]) {
    accumulated_while_syncing_ = true;
    return;
  }
  ready_[param] = true;
  ReclaimFinishedLocked();
  if (!accum_flat_.defined() && PiecewiseLocked(b) && chunks_[b].empty() &&
      next_launch_ < static_cast<int>(launch_order_.size()) && launch_order_[next_launch_] == b) {
    // Its turn: reduced in pieces now, from autograd's gradient.
    ++bucket_ready_count_[b];  // its only parameter
    if (!order_agreed_) ready_order_.push_back(b);
    ++next_launch_;
    LaunchPiecesLocked(b, g.reshape({-1}));
    LaunchReadyBucketsLocked();
    return;
  }
  if (accum_flat_.defined()) {
    torch::Tensor acc = AccumView(param);
    acc.add_(g.reshape({-1}));
    g = torch::Tensor();
    AcquireStagingLocked(b);
    if (!in_accum_[b]) WriteGradLocked(b, pl.bucket_offset, acc);
  } else {
    AcquireStagingLocked(b);
    WriteGradLocked(b, pl.bucket_offset, g.reshape({-1}));
  }
  if (++bucket_ready_count_[b] == bucket_size_[b]) BucketCompleteLocked(b);
}

// Takes back buckets whose reduction has finished (oldest first, without
// waiting), so their staging is reused during backward.
void ShardedGradientReducer::ReclaimFinishedLocked() {
  while (!pieces_.empty() && pieces_.front().handle->done()) {
    absl::Status s = WaitPieceLocked(0);
    if (!s.ok()) {
      if (hook_error_.ok()) hook_error_ = s;
      return;
    }
  }
  while (!in_flight_.empty() && rs_handles_[in_flight_.front()]->done()) {
    absl::Status s = ReclaimLocked(in_flight_.front());
    if (!s.ok()) {
      if (hook_error_.ok()) hook_error_ = s;
      return;
    }
  }
}

// Waits for the oldest reduction in flight (backward blocked: exposed).
void ShardedGradientReducer::ReclaimOldestLocked() {
  const int64_t t0 = NowNs();
  absl::Status s = ReclaimLocked(in_flight_.front());
  hook_wait_ns_ += NowNs() - t0;
  if (!s.ok() && hook_error_.ok()) hook_error_ = s;
}

std::vector<ShardedGradientReducer::Region> ShardedGradientReducer::PieceRegionsLocked() const {
  std::vector<Region> regions;
  for (const StagedPiece& p : pieces_) regions.push_back(p.region);
  return regions;
}

bool ShardedGradientReducer::PlaceLocked(int64_t length, int64_t* begin) const {
  const std::optional<int64_t> at = arena_.Place(length, PieceRegionsLocked());
  if (at) *begin = *at;
  return at.has_value();
}

// Gives bucket `b` the chunks its reduce-scatter will use (this rank's is
// its owned gradients where the communicator allows) and zeroes its padding.
void ShardedGradientReducer::AcquireStagingLocked(int b) {
  if (!chunks_[b].empty()) return;
  const Bucket& bk = layout_.buckets()[b];
  const int64_t cap = bk.capacity_per_rank;
  std::vector<torch::Tensor> chunks(world_);
  if (accum_flat_.defined() && model_travels_as_is_) {
    // Micro-batches were accumulated: reduce that buffer in place.
    for (int r = 0; r < world_; ++r)
      chunks[r] = accum_flat_.narrow(0, bk.flat_offset + r * cap, cap);
    in_accum_[b] = true;
  } else {
    const int64_t length = StageLength(b);
    torch::Tensor buf;
    if (length > 0) {
      Region region;
      // A bucket reduced in pieces reached out of its turn is staged whole in
      // a buffer of its own (counted): waiting for the arena, or growing it
      // to fit, would undo what pieces save.
      buf = StageLocked(length, &region, &overflow_buf_[b], /*in_arena=*/!PiecewiseLocked(b));
      arena_.Hold(b, region);  // (nothing when it got a buffer of its own)
    }
    in_accum_[b] = false;
    chunks = StagedChunks(b, buf);
  }
  chunks_[b] = std::move(chunks);
  for (const auto& [begin, length] : gaps_[b]) ZeroGradRangeLocked(b, begin, length);
}

torch::Tensor ShardedGradientReducer::StageLocked(int64_t length, Region* region,
                                                  torch::Tensor* own_buffer, bool in_arena) {
  const auto opts = staging_options();
  int64_t begin = 0;
  bool placed = in_arena && PlaceLocked(length, &begin);
  while (in_arena && !placed && !(in_flight_.empty() && pieces_.empty())) {
    if (!in_flight_.empty()) {
      ReclaimOldestLocked();  // may fail, and then drop the arena: allocated below
    } else {                  // the pieces of the bucket being launched
      const int64_t t0 = NowNs();
      absl::Status s = WaitPieceLocked(0);
      hook_wait_ns_ += NowNs() - t0;
      if (!s.ok() && hook_error_.ok()) hook_error_ = s;
    }
    placed = PlaceLocked(length, &begin);
  }
  if (in_arena && !placed && staging_.defined() && !arena_.held().empty() && hook_error_.ok()) {
    CompactStagingLocked();
    placed = PlaceLocked(length, &begin);
  }
  if (placed) {
    if (!staging_.defined()) {
      staging_ = torch::empty({arena_.size()}, opts);
      UpdateGradBytesLocked();
    }
    *region = Region{begin, length};
    return staging_.narrow(0, begin, length);
  }
  // Buckets backward reached early but cannot reduce yet (they go in launch
  // order) hold the arena: a buffer of its own, counted.
  if (in_arena) {
    const int64_t end = arena_.End(PieceRegionsLocked());
    overflow_shortfall_ = std::max(overflow_shortfall_, length - (arena_.size() - end));
  }
  *own_buffer = torch::empty({length}, opts);
  overflow_bytes_ += length * DTypeSize(setup_.comm_type);
  if (overflow_bytes_ > overflow_peak_bytes_) {
    overflow_peak_bytes_ = overflow_bytes_;
    UpdateGradBytesLocked();
  }
  return *own_buffer;
}

void ShardedGradientReducer::ReleaseOwnBufferLocked(torch::Tensor* own_buffer) {
  if (!own_buffer->defined()) return;
  overflow_bytes_ -= own_buffer->numel() * own_buffer->element_size();
  *own_buffer = torch::Tensor();
}

std::vector<torch::Tensor> ShardedGradientReducer::StagedChunks(int b, const torch::Tensor& buf) {
  const int64_t cap = layout_.buckets()[b].capacity_per_rank;
  std::vector<torch::Tensor> chunks(world_);
  int at = 0;
  for (int r = 0; r < world_; ++r) {
    if (split_own_ && r == rank_) {
      chunks[r] = owner_->owned_grad(b);
    } else {
      chunks[r] = buf.narrow(0, (at++) * cap, cap);
    }
  }
  return chunks;
}

// With nothing in flight, every placed bucket is one backward is still
// filling: moves them to the arena's start, so the free room is one region.
void ShardedGradientReducer::CompactStagingLocked() {
  at::NoGradGuard no_grad;
  for (const StagingArena::Move& m : arena_.Compact()) {
    torch::Tensor moved = staging_.narrow(0, m.from, m.length).clone();
    staging_.narrow(0, m.to, m.length).copy_(moved);
    chunks_[m.bucket] = StagedChunks(m.bucket, staging_.narrow(0, m.to, m.length));
  }
}

void ShardedGradientReducer::LaunchLocked(int b) {
  at::NoGradGuard no_grad;
  const Bucket& bk = layout_.buckets()[b];
  if (PiecewiseLocked(b) && chunks_[b].empty() && !accum_flat_.defined()) {
    // No gradient reached it (ready_ would have launched it in pieces).
    return LaunchPiecesLocked(b, torch::Tensor());
  }
  // (A bucket reduced in pieces with its chunks in place, staged whole or
  // accumulated, is launched in the same pieces below: every rank must issue
  // the same collectives, whichever way its gradient came.)
  tracer_->Add(TraceEvent::kReduceScatterStart, b, -1);
  AcquireStagingLocked(b);
  // Parameters this backward gave no gradient: what earlier micro-batches
  // accumulated, or zeros (DDP's find_unused_parameters).
  if (!in_accum_[b]) {
    for (int p : bk.params) {
      if (ready_[p]) continue;
      const ParamPlacement& pl = layout_.placement(p);
      if (accum_flat_.defined()) {
        WriteGradLocked(b, pl.bucket_offset, AccumView(p));
      } else {
        ZeroGradRangeLocked(b, pl.bucket_offset, pl.numel);
      }
    }
  }
  std::vector<void*> ptrs(world_);
  CollectiveBucketScope tag(b);  // for the flight recorder
  if (PiecewiseLocked(b)) {
    const int64_t elem = DTypeSize(setup_.comm_type);
    for (int64_t at = 0; at < bk.capacity_per_rank; at += piece_elements_) {
      const int64_t n = std::min(piece_elements_, bk.capacity_per_rank - at);
      for (int r = 0; r < world_; ++r) {
        ptrs[r] = static_cast<char*>(chunks_[b][r].data_ptr()) + at * elem;
      }
      StagedPiece piece;  // its memory is the bucket's (freed when it is reclaimed)
      piece.bucket = b;
      LaunchPieceLocked(ptrs, n, std::move(piece));
    }
    in_flight_.push_back(b);
    return;
  }
  for (int r = 0; r < world_; ++r) ptrs[r] = chunks_[b][r].data_ptr();
  rs_handles_[b] =
      comm_->ReduceScatterChunks(ptrs, bk.capacity_per_rank, setup_.comm_type, ReduceOp::kAverage);
  in_flight_.push_back(b);
}

bool ShardedGradientReducer::PiecewiseLocked(int b) const {
  const Bucket& bk = layout_.buckets()[b];
  return piece_elements_ > 0 && bk.params.size() == 1 && bk.capacity_per_rank > piece_elements_;
}

// A bucket of one tensor larger than a piece (PiecewiseLocked), launched as
// its gradient arrives: its reduce-scatter runs as one collective per
// piece_elements_ of every rank's chunk, this rank's part written straight
// into the owned gradients and the other ranks' parts staged in the arena;
// when the arena is full, backward waits for the oldest piece. So staging
// never exceeds the arena however large the tensor (one collective would
// stage (N-1)/N of it), at the price of backward waiting while most of the
// tensor is reduced. Sums are those of one collective bit for bit: each
// element is reduced at the same ring positions. `flat_grad`: the gradient,
// flat; undefined: zeros (no gradient reached the parameter).
void ShardedGradientReducer::LaunchPiecesLocked(int b, const torch::Tensor& flat_grad) {
  if (!hook_error_.ok()) return;  // a reduction failed: Step() reports it
  at::NoGradGuard no_grad;
  const Bucket& bk = layout_.buckets()[b];
  const ParamPlacement& pl = layout_.placement(bk.params[0]);
  const int64_t cap = bk.capacity_per_rank;
  tracer_->Add(TraceEvent::kReduceScatterStart, b, -1);
  // dst <- bucket elements [from, from + dst.numel()): the gradient's, zeros outside it.
  auto fill = [&](torch::Tensor dst, int64_t from) {
    const int64_t n = dst.numel();
    const int64_t lo = std::max(from, pl.bucket_offset);
    const int64_t hi = std::min(from + n, pl.bucket_offset + pl.numel);
    if (!flat_grad.defined() || lo >= hi) {
      dst.zero_();
      return;
    }
    if (lo > from) dst.narrow(0, 0, lo - from).zero_();
    dst.narrow(0, lo - from, hi - lo).copy_(flat_grad.narrow(0, lo - pl.bucket_offset, hi - lo));
    if (hi < from + n) dst.narrow(0, hi - from, from + n - hi).zero_();
  };
  torch::Tensor own = owner_->owned_grad(b);
  in_accum_[b] = false;  // reduced into the owned gradients, not from accum_flat_
  for (int64_t at = 0; at < cap; at += piece_elements_) {
    const int64_t n = std::min(piece_elements_, cap - at);
    StagedPiece piece;
    piece.bucket = b;
    torch::Tensor buf = StageLocked((world_ - 1) * n, &piece.region, &piece.own, /*in_arena=*/true);
    if (!hook_error_.ok()) {  // waiting for room found a failed reduction
      ReleaseOwnBufferLocked(&piece.own);
      return;
    }
    std::vector<void*> ptrs(world_);
    int slot = 0;
    for (int r = 0; r < world_; ++r) {
      torch::Tensor dst = r == rank_ ? own.narrow(0, at, n) : buf.narrow(0, (slot++) * n, n);
      fill(dst, r * cap + at);
      ptrs[r] = dst.data_ptr();
    }
    CollectiveBucketScope tag(b);  // for the flight recorder
    LaunchPieceLocked(ptrs, n, std::move(piece));
  }
  in_flight_.push_back(b);
}

// One piece's reduce-scatter; the bucket's handle is its last piece's.
void ShardedGradientReducer::LaunchPieceLocked(const std::vector<void*>& chunks, int64_t count,
                                               StagedPiece piece) {
  piece.handle = comm_->ReduceScatterChunks(chunks, count, setup_.comm_type, ReduceOp::kAverage);
  rs_handles_[piece.bucket] = piece.handle;
  pieces_.push_back(std::move(piece));
}

void ShardedGradientReducer::FreeStagingLocked(int b) {
  arena_.Free(b);
  ReleaseOwnBufferLocked(&overflow_buf_[b]);
  chunks_[b].clear();
}

// A reduction failed: the communicator is aborted, and the collectives
// launched may still write into their staging, so the arena (with every
// region and piece in it) and the pieces' own buffers are abandoned; a later
// placement allocates a new arena. (The owned chunks are views of the owned
// gradients, which stay; an aborted communicator never runs another
// collective into them.)
absl::Status ShardedGradientReducer::FailStagingLocked(const absl::Status& s) {
  comm_->Abort(s);
  if (staging_.defined()) abandoned_.push_back(staging_);
  staging_ = torch::Tensor();
  arena_.Clear();
  for (StagedPiece& p : pieces_) {
    if (p.own.defined()) abandoned_.push_back(p.own);
    ReleaseOwnBufferLocked(&p.own);
  }
  pieces_.clear();
  UpdateGradBytesLocked();
  return s;
}

// Bucket `b`'s reduction failed: collectives may still write into its
// chunks (a buffer of its own, the arena, accum_flat_), so they stay alive.
void ShardedGradientReducer::AbandonChunksLocked(int b) {
  for (const torch::Tensor& c : chunks_[b]) abandoned_.push_back(c);
  ReleaseOwnBufferLocked(&overflow_buf_[b]);  // a chunk's memory, so kept in abandoned_
  FreeStagingLocked(b);
  UpdateGradBytesLocked();
}

// Waits for pieces_[index] and gives its staging back.
absl::Status ShardedGradientReducer::WaitPieceLocked(size_t index) {
  StagedPiece& p = pieces_[index];
  const int b = p.bucket;
  absl::Status s = p.handle->Wait(setup_.timeout);
  if (!s.ok()) {
    return FailStagingLocked(
        absl::Status(s.code(), absl::StrCat("rank ", rank_, ": reduce-scatter of bucket ", b,
                                            " (a piece) failed: ", s.message())));
  }
  ReleaseOwnBufferLocked(&p.own);
  pieces_.erase(pieces_.begin() + index);
  return absl::OkStatus();
}

absl::Status ShardedGradientReducer::ReclaimLocked(int b) {
  auto it = std::find(in_flight_.begin(), in_flight_.end(), b);
  if (it == in_flight_.end()) return absl::OkStatus();
  in_flight_.erase(it);
  // A bucket reduced in pieces: its pieces still staged (the last one's
  // handle is rs_handles_[b]).
  for (size_t i = 0; i < pieces_.size();) {
    if (pieces_[i].bucket != b) {
      ++i;
      continue;
    }
    absl::Status s = WaitPieceLocked(i);  // on failure: arena and pieces abandoned
    if (!s.ok()) {
      AbandonChunksLocked(b);
      return s;
    }
  }
  absl::Status s = rs_handles_[b]->Wait(setup_.timeout);
  if (!s.ok()) {
    AbandonChunksLocked(b);
    (void)FailStagingLocked(s);
    return absl::Status(s.code(), absl::StrCat("rank ", rank_, ": reduce-scatter of bucket ", b,
                                               " failed: ", s.message()));
  }
  if (in_accum_[b] || !split_own_) {  // this rank's chunk is not the owned gradient
    at::NoGradGuard no_grad;
    owner_->owned_grad(b).copy_(chunks_[b][rank_]);
  }
  FreeStagingLocked(b);
  reclaimed_[b] = true;
  tracer_->Add(TraceEvent::kReduceScatterDone, b, -1);
  return absl::OkStatus();
}

void ShardedGradientReducer::ReleaseShardedBuffersLocked() {
  while (!pieces_.empty()) (void)WaitPieceLocked(0);  // none unless a launch stopped early
  for (size_t b = 0; b < chunks_.size(); ++b) {
    FreeStagingLocked(static_cast<int>(b));
    reclaimed_[b] = false;
  }
  accum_flat_ = torch::Tensor();
  UpdateGradBytesLocked();
}

}  // namespace shardopt
