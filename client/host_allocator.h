// A LibTorch CPU allocator that keeps large blocks out of the malloc heap.
//
// Training allocates the same large tensors every step (gradients as
// autograd computes them, activations, optimizer temporaries) and frees them
// within the step. With the tuned malloc mode (common/malloc_tuning.h: no
// mmap, no trimming, so freed memory is reused instead of page-faulted in
// again each step) they come from glibc's heap, where they share free space
// with every small allocation of every thread: a free 64 MiB block waiting
// for the next gradient of that size gets split by a few small requests, the
// next gradient no longer fits, and the heap grows by another 64 MiB. Which
// step that happens in, and how often, depends on thread timing: bench_oss
// measured the same row at 876 MiB peak RSS in one round and 1132 MiB in the
// next, and any change to when collectives run moved it (docs/performance.md, "Allocator").
//
// This allocator gives each block of at least kLargeBlockBytes its own
// anonymous mapping and, when the tensor is freed, keeps the mapping for the
// next request that fits it (the smallest kept block of at least the size
// and at most twice it), up to a cap on what it keeps unused.
// Smaller blocks come from malloc (with a 64-byte header, as every block has
// one: oneDNN frees through raw_deleter(), which gets the data pointer
// only). A training loop asks for the same sizes every step, so after the
// first steps nothing is mapped, and no small allocation can split a large
// block. This is PyTorch's CUDA caching allocator idea (best fit without
// splitting blocks) for host memory; LibTorch ships none for the CPU (c10's
// mobile CPUCachingAllocator is not in Debian's build), hence ours.
#ifndef SHARDOPT_CLIENT_HOST_ALLOCATOR_H_
#define SHARDOPT_CLIENT_HOST_ALLOCATOR_H_

#include <c10/core/Allocator.h>

#include <cstddef>
#include <cstdint>

namespace shardopt {

struct HostAllocatorStats {
  int64_t mapped_bytes = 0;  // large blocks mapped now (in use or kept)
  int64_t kept_bytes = 0;    // of those, kept unused for reuse
  int64_t peak_mapped_bytes = 0;
  int64_t maps = 0;           // mmap calls (cache misses)
  int64_t reuses = 0;         // large requests served from kept blocks
  int64_t reuses_larger = 0;  // of those, from a larger block (best fit, <= 2x)
};

class LargeBlockCachingAllocator final : public c10::Allocator {
 public:
  // Blocks at least this large get their own mapping.
  static constexpr size_t kLargeBlockBytes = 1 << 20;
  // keep_limit_bytes: the most kept unused at once; a freed block beyond it
  // is unmapped.
  explicit LargeBlockCachingAllocator(size_t keep_limit_bytes = size_t{2} << 30);
  ~LargeBlockCachingAllocator() override;

  c10::DataPtr allocate(size_t n) const override;
  c10::DeleterFnPtr raw_deleter() const override;

  HostAllocatorStats stats() const;
  // Unmaps every kept block (blocks in use are unaffected).
  void ReleaseKept();

  struct Impl;  // what a block's header points to; outlives the allocator

 private:
  Impl* impl_;  // never freed: blocks freed after the allocator reach it
};

// Makes `LargeBlockCachingAllocator` LibTorch's CPU allocator for this
// process (tensors allocated before keep their own). Call early in main(),
// before the model is built. Idempotent; the allocator lives until exit.
LargeBlockCachingAllocator* InstallHostAllocator();

// The allocator InstallHostAllocator() installed, or nullptr before that.
LargeBlockCachingAllocator* InstalledHostAllocator();

// One line for start-up logs and benchmark setups.
const char* DescribeHostAllocator();

}  // namespace shardopt

#endif  // SHARDOPT_CLIENT_HOST_ALLOCATOR_H_
