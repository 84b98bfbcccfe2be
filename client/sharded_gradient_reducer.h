// ShardedGradientReducer (ZeRO-2): each rank keeps only the reduced gradient
// of the ranges it owns (1/N of the model). Parameters have no .grad between
// steps: backward hands each gradient over, the part in this rank's chunk of
// its bucket goes into the owned gradients and the rest into staging, and
// autograd's tensor is dropped.
//
// A bucket's reduce-scatter works on world chunks of capacity_per_rank
// elements. With a communicator that takes separate chunks (Gloo, shared
// memory, in-process) and gradients travelling in the model's type, this
// rank's chunk is its slice of the owned gradients itself, so only the other
// ranks' chunks are staged ((N-1)/N of a bucket) and nothing is copied after
// the reduction. Otherwise (NCCL, bf16 travel) the whole bucket is staged and
// the owned chunk copied out afterwards ("reclaim").
//
// Staging is one arena (StagingArena) in the type gradients travel in,
// allocated at first use: room for staging_buffers buckets of the cap, and at
// least for the largest bucket that is staged whole (a bucket of one tensor
// larger than that is reduced in pieces through the arena while backward
// waits: LaunchPiecesLocked). Buckets take regions first-fit as backward
// reaches them and give them back once reduced (in launch order); when no
// region is free, backward waits for the oldest reduction in flight. While
// micro-batches accumulate (no_sync) they are summed in a full-size buffer
// that is then reduced in place. Autograd's gradient tensor itself is not
// reduced in place: while its hook runs, autograd still holds references to
// it that cannot be told apart from a user's, so overwriting it could not be
// proven safe.
#ifndef SHARDOPT_CLIENT_SHARDED_GRADIENT_REDUCER_H_
#define SHARDOPT_CLIENT_SHARDED_GRADIENT_REDUCER_H_

#include <atomic>
#include <deque>
#include <utility>
#include <vector>

#include "client/gradient_reducer.h"
#include "client/staging_arena.h"

namespace shardopt {

class ShardedGradientReducer : public GradientReducer {
 public:
  explicit ShardedGradientReducer(const ReducerSetup& setup);

  torch::Tensor owner_grads() override;
  void Attach(std::vector<torch::Tensor> params) override;
  void OnGradReadyLocked(int param) override ABSL_EXCLUSIVE_LOCKS_REQUIRED(hooks_->mu);
  void ZeroGrad(bool set_to_none) override;
  absl::Status FinishBucket(int b, WaitFn wait, CollectiveWaiter* waiter) override;
  // After the second step (the first in the agreed order): if buckets still
  // needed buffers of their own (backward fills a bucket while a larger one
  // arrives, as when biases and weights are in different groups), the arena
  // grows by what the largest of them lacked at the arena's end, so later
  // steps need none and the memory is one arena again. Every rank decides
  // alone: the arena is local memory, not part of any collective.
  void OnStepInAgreedOrder() override;
  // The owned gradients, the arena once allocated, the most held at once in
  // buffers of their own (since the first step, whose buckets are reduced in
  // bucket order, not yet backward's), and the accumulation buffer while
  // no_sync micro-batches are being summed.
  int64_t grad_bytes() const override { return grad_bytes_.load(); }

 private:
  using Region = StagingArena::Region;
  // A piece of a bucket reduced in pieces, launched and not yet waited for.
  struct StagedPiece {
    int bucket = -1;
    Region region;      // in the arena, or
    torch::Tensor own;  // a buffer of its own (counted)
    CommHandlePtr handle;
  };

  void Prepare();
  void LaunchLocked(int b) override ABSL_EXCLUSIVE_LOCKS_REQUIRED(hooks_->mu);
  void ReleaseAfterStepLocked() override ABSL_EXCLUSIVE_LOCKS_REQUIRED(hooks_->mu);
  void OnOrderAgreedLocked() override ABSL_EXCLUSIVE_LOCKS_REQUIRED(hooks_->mu);
  void OnGradLocked(int param, torch::Tensor grad) ABSL_EXCLUSIVE_LOCKS_REQUIRED(hooks_->mu);
  void AcquireStagingLocked(int bucket) ABSL_EXCLUSIVE_LOCKS_REQUIRED(hooks_->mu);
  std::vector<torch::Tensor> StagedChunks(int bucket, const torch::Tensor& buf);
  void CompactStagingLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(hooks_->mu);
  int64_t StageLength(int bucket) const;
  bool PlaceLocked(int64_t length, int64_t* begin) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(hooks_->mu);
  std::vector<Region> PieceRegionsLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(hooks_->mu);
  void FreeStagingLocked(int bucket) ABSL_EXCLUSIVE_LOCKS_REQUIRED(hooks_->mu);
  // Calls fn(chunk slice, offset into the range, length) for each chunk that
  // elements [offset, offset + length) of bucket `b` span.
  template <typename Fn>
  void ForChunks(int bucket, int64_t offset, int64_t length, Fn fn)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(hooks_->mu);
  void WriteGradLocked(int bucket, int64_t offset, const torch::Tensor& flat)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(hooks_->mu);
  void ZeroGradRangeLocked(int bucket, int64_t offset, int64_t length)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(hooks_->mu);
  bool PiecewiseLocked(int bucket) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(hooks_->mu);
  void LaunchPiecesLocked(int bucket, const torch::Tensor& flat_grad)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(hooks_->mu);
  void LaunchPieceLocked(const std::vector<void*>& chunks, int64_t count, StagedPiece piece)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(hooks_->mu);
  // Gives a staged collective `length` elements: a region of the arena
  // (waiting for reductions in flight while there is no room, compacting
  // filling buckets when nothing is in flight), else a buffer of its own
  // (counted). Returns the buffer; *region is set when it is in the arena.
  // in_arena false: a buffer of its own at once.
  torch::Tensor StageLocked(int64_t length, Region* region, torch::Tensor* own_buffer,
                            bool in_arena) ABSL_EXCLUSIVE_LOCKS_REQUIRED(hooks_->mu);
  void ReleaseOwnBufferLocked(torch::Tensor* own_buffer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(hooks_->mu);
  absl::Status WaitPieceLocked(size_t index) ABSL_EXCLUSIVE_LOCKS_REQUIRED(hooks_->mu);
  absl::Status FailStagingLocked(const absl::Status& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(hooks_->mu);
  void AbandonChunksLocked(int bucket) ABSL_EXCLUSIVE_LOCKS_REQUIRED(hooks_->mu);
  absl::Status ReclaimLocked(int bucket) ABSL_EXCLUSIVE_LOCKS_REQUIRED(hooks_->mu);
  void ReclaimFinishedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(hooks_->mu);
  void ReclaimOldestLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(hooks_->mu);
  void ReleaseShardedBuffersLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(hooks_->mu);
  void UpdateGradBytesLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(hooks_->mu);
  torch::Tensor AccumView(int param) ABSL_EXCLUSIVE_LOCKS_REQUIRED(hooks_->mu);
  torch::TensorOptions staging_options() const;

  const bool model_travels_as_is_;  // gradients travel in the model's dtype
  torch::Tensor owned_grad_flat_
      ABSL_GUARDED_BY(hooks_->mu);  // this rank's ranges, bucket after bucket
  torch::Tensor accum_flat_
      ABSL_GUARDED_BY(hooks_->mu);  // full size, only while accumulating (no_sync)
  std::vector<std::vector<std::pair<int64_t, int64_t>>> gaps_;  // per bucket: padding runs
  bool split_own_ = false;  // this rank's chunk reduced in place in owned_grad_flat_
  torch::Tensor staging_
      ABSL_GUARDED_BY(hooks_->mu);  // the arena, in comm_type (allocated at first use)
  StagingArena arena_ ABSL_GUARDED_BY(hooks_->mu);        // the regions of staging_
  bool arena_sized_ ABSL_GUARDED_BY(hooks_->mu) = false;  // grown after the second step
  // A bucket of one tensor whose reduce-scatter does not fit a staging piece
  // is reduced in pieces of piece_elements_ of every rank's chunk, staged in
  // the arena while backward waits (PiecewiseLocked); pieces_ are those
  // launched and not yet waited for, oldest first.
  std::deque<StagedPiece> pieces_ ABSL_GUARDED_BY(hooks_->mu);
  int64_t piece_elements_ = 0;  // per rank; 0: no bucket is reduced in pieces
  std::vector<torch::Tensor> overflow_buf_
      ABSL_GUARDED_BY(hooks_->mu);                               // per bucket: a buffer of its own
  int64_t overflow_bytes_ ABSL_GUARDED_BY(hooks_->mu) = 0;       // held by overflow_buf_ now
  int64_t overflow_peak_bytes_ ABSL_GUARDED_BY(hooks_->mu) = 0;  // the most ever held at once
  int64_t overflow_shortfall_ ABSL_GUARDED_BY(hooks_->mu) =
      0;  // elements the arena's end lacked for one
  std::vector<std::vector<torch::Tensor>> chunks_
      ABSL_GUARDED_BY(hooks_->mu);  // per bucket: its reduce-scatter's chunks
  std::vector<bool> in_accum_
      ABSL_GUARDED_BY(hooks_->mu);  // chunks_[b] are accum_flat_'s (else chunks_[b][rank_] is
                                    // the owned gradient when split_own_)
  std::vector<bool> reclaimed_
      ABSL_GUARDED_BY(hooks_->mu);  // reduced; owned range holds the result
  std::vector<int> in_flight_
      ABSL_GUARDED_BY(hooks_->mu);  // launched, not reclaimed, in launch order
  std::vector<torch::Tensor> abandoned_
      ABSL_GUARDED_BY(hooks_->mu);  // buffers of collectives that failed
  std::atomic<int64_t> grad_bytes_{0};
};

}  // namespace shardopt

#endif  // SHARDOPT_CLIENT_SHARDED_GRADIENT_REDUCER_H_
