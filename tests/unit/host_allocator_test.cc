// LargeBlockCachingAllocator: large blocks in their own mappings, reused by
// size; small ones from malloc; what it keeps bounded; raw_allocate() /
// raw_deallocate() (oneDNN's way in) for both.
#include "client/host_allocator.h"

#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <thread>
#include <vector>

namespace shardopt {
namespace {

constexpr size_t kMiB = 1 << 20;

TEST(HostAllocatorTest, LargeBlocksAreReusedBySizeAndSmallOnesPassThrough) {
  LargeBlockCachingAllocator a(64 * kMiB);
  void* first = nullptr;
  {
    c10::DataPtr p = a.allocate(8 * kMiB);
    ASSERT_NE(p.get(), nullptr);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p.get()) % 64, 0u) << "LibTorch wants 64-byte alignment";
    std::memset(p.get(), 1, 8 * kMiB);  // all of it is usable
    first = p.get();
    EXPECT_EQ(a.stats().maps, 1);
    EXPECT_EQ(a.stats().kept_bytes, 0);
  }
  EXPECT_GE(a.stats().kept_bytes, static_cast<int64_t>(8 * kMiB)) << "kept, not unmapped";
  {
    c10::DataPtr p = a.allocate(8 * kMiB);
    EXPECT_EQ(p.get(), first) << "the same size gets the kept block back";
    EXPECT_EQ(a.stats().reuses, 1);
    EXPECT_EQ(a.stats().kept_bytes, 0);
    c10::DataPtr q = a.allocate(8 * kMiB);  // none kept now: a new mapping
    EXPECT_NE(q.get(), p.get());
    c10::DataPtr other = a.allocate(3 * kMiB);  // nothing kept: mapped
    EXPECT_EQ(a.stats().maps, 3);
  }
  const HostAllocatorStats s = a.stats();
  EXPECT_EQ(s.kept_bytes, s.mapped_bytes) << "all freed: everything mapped is kept";
  EXPECT_GE(s.peak_mapped_bytes, static_cast<int64_t>(19 * kMiB));
  {
    c10::DataPtr small = a.allocate(4096);  // malloc
    ASSERT_NE(small.get(), nullptr);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(small.get()) % 64, 0u);
    EXPECT_EQ(small.get(), small.get_context());
    EXPECT_EQ(a.stats().maps, 3);
    c10::DataPtr none = a.allocate(0);
    EXPECT_EQ(none.get(), nullptr);
  }
  // oneDNN allocates through raw_allocate() and frees through raw_deleter(),
  // which gets the data pointer only: small and large.
  for (size_t n : {size_t{100}, 20 * kMiB}) {  // 20 MiB: no kept block fits
    void* p = a.raw_allocate(n);
    ASSERT_NE(p, nullptr);
    std::memset(p, 7, n);
    a.raw_deallocate(p);
  }
  EXPECT_EQ(a.stats().maps, 4);
  void* again = a.raw_allocate(20 * kMiB);
  EXPECT_EQ(a.stats().maps, 4) << "the raw-freed block was kept and is reused";
  a.raw_deallocate(again);
  a.ReleaseKept();
  EXPECT_EQ(a.stats().kept_bytes, 0);
  EXPECT_EQ(a.stats().mapped_bytes, 0);
}

// A request no kept block of its size serves takes the smallest kept block
// of at least its size and at most twice it (resident already, so no new
// memory), never a block more than twice its size; a block freed goes back
// under its own size.
TEST(HostAllocatorTest, ARequestTakesTheSmallestKeptBlockThatFitsUpToTwiceItsSize) {
  LargeBlockCachingAllocator a(256 * kMiB);
  void* b5 = nullptr;
  void* b8 = nullptr;
  {
    c10::DataPtr p8 = a.allocate(8 * kMiB), p5 = a.allocate(5 * kMiB), p3 = a.allocate(3 * kMiB);
    b5 = p5.get();
    b8 = p8.get();
  }
  const int64_t mapped = a.stats().mapped_bytes;
  EXPECT_EQ(a.stats().kept_bytes, mapped);
  EXPECT_EQ(a.stats().maps, 3);
  {
    c10::DataPtr x = a.allocate(4 * kMiB);
    EXPECT_EQ(x.get(), b5) << "the smallest that fits: 5 MiB, not 8";
    std::memset(x.get(), 1, 4 * kMiB);
    c10::DataPtr y = a.allocate(4 * kMiB);
    EXPECT_EQ(y.get(), b8) << "8 MiB is at most twice 4 MiB";
    c10::DataPtr z = a.allocate(1 * kMiB);  // 3 MiB is more than twice: a new mapping
    EXPECT_NE(z.get(), nullptr);
    const HostAllocatorStats s = a.stats();
    EXPECT_EQ(s.maps, 4);
    EXPECT_EQ(s.reuses, 2);
    EXPECT_EQ(s.reuses_larger, 2);
    EXPECT_GT(s.kept_bytes, static_cast<int64_t>(3 * kMiB));  // the 3 MiB block only
    EXPECT_LT(s.kept_bytes, static_cast<int64_t>(4 * kMiB));
  }
  {
    // Freed under their own sizes: an 8 MiB request gets the 8 MiB block back.
    c10::DataPtr p = a.allocate(8 * kMiB);
    EXPECT_EQ(p.get(), b8);
    EXPECT_EQ(a.stats().reuses_larger, 2);
  }
  const HostAllocatorStats s = a.stats();
  EXPECT_EQ(s.kept_bytes, s.mapped_bytes);
  a.ReleaseKept();
  EXPECT_EQ(a.stats().mapped_bytes, 0);
  EXPECT_EQ(a.stats().kept_bytes, 0);
}

TEST(HostAllocatorTest, WhatItKeepsIsBounded) {
  LargeBlockCachingAllocator a(10 * kMiB);
  {
    std::vector<c10::DataPtr> blocks;
    for (int i = 0; i < 5; ++i) blocks.push_back(a.allocate(4 * kMiB));
    EXPECT_GE(a.stats().mapped_bytes, static_cast<int64_t>(20 * kMiB));
  }
  // Two 4 MiB blocks (plus headers, page-rounded) fit under 10 MiB; the rest
  // were unmapped as they were freed.
  const HostAllocatorStats s = a.stats();
  EXPECT_LE(s.kept_bytes, static_cast<int64_t>(10 * kMiB));
  EXPECT_GE(s.kept_bytes, static_cast<int64_t>(8 * kMiB));
  EXPECT_EQ(s.mapped_bytes, s.kept_bytes);
  a.ReleaseKept();
}

TEST(HostAllocatorTest, ThreadsAllocateAndFreeConcurrently) {
  LargeBlockCachingAllocator a(256 * kMiB);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&a, t] {
      for (int i = 0; i < 200; ++i) {
        const size_t n = (1 + (i + t) % 3) * kMiB;
        c10::DataPtr p = a.allocate(n);
        static_cast<char*>(p.get())[n - 1] = static_cast<char>(i);
        // Freed by another owner sometimes: handed through a vector.
        std::vector<c10::DataPtr> v;
        v.push_back(std::move(p));
      }
    });
  }
  for (auto& th : threads) th.join();
  const HostAllocatorStats s = a.stats();
  EXPECT_EQ(s.mapped_bytes, s.kept_bytes);
  EXPECT_EQ(s.maps + s.reuses, 800);
  EXPECT_LE(s.maps, 4 * 3) << "each thread holds one block at a time: at most one per size each";
  a.ReleaseKept();
}

// Blocks may outlive the allocator that made them (tensors freed late): they
// are unmapped or freed then, not kept for an allocator that is gone. A
// block of LibTorch's default allocator freed through this one's
// raw_deleter() (oneDNN frees through whichever allocator is current) goes
// back to free().
TEST(HostAllocatorTest, BlocksOutliveTheAllocatorAndForeignBlocksGoBackToFree) {
  c10::DataPtr big, small;
  {
    LargeBlockCachingAllocator a(64 * kMiB);
    big = a.allocate(2 * kMiB);
    small = a.allocate(100);
  }
  std::memset(big.get(), 1, 2 * kMiB);  // still mapped
  std::memset(small.get(), 1, 100);
  big.clear();
  small.clear();
  LargeBlockCachingAllocator b(64 * kMiB);
  void* foreign = c10::GetDefaultCPUAllocator()->raw_allocate(4096);
  std::memset(foreign, 0, 4096);
  b.raw_deleter()(foreign);
  EXPECT_EQ(b.stats().mapped_bytes, 0);
}

// Installed, it is LibTorch's CPU allocator: a training-like loop that
// allocates the same large tensors every step maps them once.
TEST(HostAllocatorTest, InstalledItServesLibTorchTensors) {
  LargeBlockCachingAllocator* before = InstalledHostAllocator();
  LargeBlockCachingAllocator* a = InstallHostAllocator();
  ASSERT_EQ(a, InstallHostAllocator()) << "idempotent";
  EXPECT_TRUE(before == nullptr || before == a);  // nullptr unless a test before installed it
  EXPECT_EQ(InstalledHostAllocator(), a);
  const int64_t maps0 = a->stats().maps;
  torch::Tensor w = torch::randn({512, 512}, torch::requires_grad());  // 1 MiB
  for (int step = 0; step < 5; ++step) {
    torch::Tensor x = torch::randn({256, 512});
    torch::Tensor loss = torch::matmul(x, w).pow(2).mean();
    loss.backward();
    EXPECT_TRUE(torch::isfinite(w.grad()).all().item<bool>());
    w.mutable_grad() = torch::Tensor();
  }
  const HostAllocatorStats s = a->stats();
  EXPECT_GT(s.maps, maps0) << "large LibTorch tensors come from it";
  EXPECT_GT(s.reuses, 0) << "and are reused step after step";
  EXPECT_LT(s.maps - maps0, 12) << "a handful of sizes, mapped once each";
  torch::Tensor small = torch::ones({16});
  EXPECT_EQ(small.sum().item<float>(), 16.0f);
  // Convolutions go through oneDNN, which allocates with raw_allocate().
  torch::nn::Conv2d conv(torch::nn::Conv2dOptions(64, 64, 3).padding(1));
  for (int step = 0; step < 3; ++step) {
    torch::Tensor y = conv->forward(torch::randn({8, 64, 32, 32}));  // 2 MiB activations
    y.pow(2).mean().backward();
  }
  EXPECT_TRUE(torch::isfinite(conv->weight.grad()).all().item<bool>());
}

}  // namespace
}  // namespace shardopt
