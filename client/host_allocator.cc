#include "client/host_allocator.h"

#include <c10/core/CPUAllocator.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <new>

#include "absl/synchronization/mutex.h"

namespace shardopt {

namespace {

constexpr size_t kPage = 4096;
// Each mapping starts with a header; the tensor's data follows it, aligned
// as LibTorch wants (64 bytes).
constexpr size_t kHeaderBytes = 64;

// Marks a header as ours: a block LibTorch's default allocator handed out
// before InstallHostAllocator() (oneDNN frees through whichever allocator is
// current) has none, and goes back to free().
constexpr uint64_t kMagic = 0x73686172646f7074;  // "shardopt"

struct BlockHeader {
  uint64_t magic;
  size_t map_bytes;  // 0: from malloc
  LargeBlockCachingAllocator::Impl* owner;
  BlockHeader* next;  // in a kept list
};
static_assert(sizeof(BlockHeader) <= kHeaderBytes, "header too large");

}  // namespace

struct LargeBlockCachingAllocator::Impl {
  explicit Impl(size_t limit) : keep_limit(limit) {}
  void Keep(BlockHeader* h);
  const size_t keep_limit;
  mutable absl::Mutex mu;
  bool destroyed ABSL_GUARDED_BY(mu) = false;  // the allocator is gone: unmap on free
  // Kept blocks by mapping size, chained through their headers (keeping one
  // allocates nothing); ordered, for the best fit.
  std::map<size_t, BlockHeader*> kept ABSL_GUARDED_BY(mu);
  HostAllocatorStats stats ABSL_GUARDED_BY(mu);
};

LargeBlockCachingAllocator::LargeBlockCachingAllocator(size_t keep_limit_bytes)
    : impl_(new Impl(keep_limit_bytes)) {}

LargeBlockCachingAllocator::~LargeBlockCachingAllocator() {
  {
    absl::MutexLock lock(&impl_->mu);
    impl_->destroyed = true;
  }
  ReleaseKept();
  // impl_ is left (a few bytes): blocks still in use reach it from their
  // headers when they are freed, and are unmapped then.
}

namespace {

void DeleteBlock(void* ctx);

}  // namespace

// Every block, small or large, carries a header just before its data: the
// data pointer is also the DataPtr's context and what raw_deleter() gets
// (oneDNN allocates through raw_allocate()/raw_deallocate(), which need both).
c10::DataPtr LargeBlockCachingAllocator::allocate(size_t n) const {
  const c10::Device cpu(c10::DeviceType::CPU);
  if (n == 0) return c10::DataPtr(nullptr, nullptr, &DeleteBlock, cpu);
  BlockHeader* h = nullptr;
  if (n < kLargeBlockBytes) {
    void* base = nullptr;
    if (posix_memalign(&base, kHeaderBytes, n + kHeaderBytes) != 0) throw std::bad_alloc();
    h = static_cast<BlockHeader*>(base);
    h->map_bytes = 0;  // from malloc
  } else {
    const size_t map_bytes = (n + kHeaderBytes + kPage - 1) / kPage * kPage;
    {
      absl::MutexLock lock(&impl_->mu);
      // The smallest kept block that fits, up to twice the size: its pages
      // are resident already, so serving a smaller tensor from it costs no
      // memory, where mapping a new block would add the request's size.
      // (Exact sizes only kept 1627 MiB peak for a torchvision resnet101
      // under DDP, whose phases free and ask for different sizes; glibc's
      // heap, 1247.) No block beyond twice the size: a small tensor must not
      // hold a large block that a request of the large size wants back.
      auto it = impl_->kept.lower_bound(map_bytes);
      if (it != impl_->kept.end() && it->first <= 2 * map_bytes) {
        h = it->second;
        it->second = h->next;
        if (it->second == nullptr) impl_->kept.erase(it);
        impl_->stats.kept_bytes -= static_cast<int64_t>(h->map_bytes);
        ++impl_->stats.reuses;
        if (h->map_bytes != map_bytes) ++impl_->stats.reuses_larger;
      }
    }
    if (h == nullptr) {
      void* p =
          mmap(nullptr, map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) throw std::bad_alloc();
      h = static_cast<BlockHeader*>(p);
      h->map_bytes = map_bytes;
      absl::MutexLock lock(&impl_->mu);
      impl_->stats.mapped_bytes += static_cast<int64_t>(map_bytes);
      impl_->stats.peak_mapped_bytes =
          std::max(impl_->stats.peak_mapped_bytes, impl_->stats.mapped_bytes);
      ++impl_->stats.maps;
    }
  }
  h->magic = kMagic;
  h->owner = impl_;
  h->next = nullptr;
  void* data = reinterpret_cast<char*>(h) + kHeaderBytes;
  return c10::DataPtr(data, data, &DeleteBlock, cpu);
}

c10::DeleterFnPtr LargeBlockCachingAllocator::raw_deleter() const { return &DeleteBlock; }

namespace {

void DeleteBlock(void* data) {
  if (data == nullptr) return;
  auto* h = reinterpret_cast<BlockHeader*>(static_cast<char*>(data) - kHeaderBytes);
  if (h->magic != kMagic) {  // not ours: LibTorch's default allocator's
    std::free(data);
    return;
  }
  if (h->map_bytes == 0) {
    h->magic = 0;
    std::free(h);
    return;
  }
  h->owner->Keep(h);
}

}  // namespace

void LargeBlockCachingAllocator::Impl::Keep(BlockHeader* h) {
  const size_t map_bytes = h->map_bytes;
  {
    absl::MutexLock lock(&mu);
    if (!destroyed &&
        stats.kept_bytes + static_cast<int64_t>(map_bytes) <= static_cast<int64_t>(keep_limit)) {
      BlockHeader*& head = kept[map_bytes];
      h->next = head;
      head = h;
      stats.kept_bytes += static_cast<int64_t>(map_bytes);
      return;
    }
    stats.mapped_bytes -= static_cast<int64_t>(map_bytes);
  }
  munmap(h, map_bytes);
}

HostAllocatorStats LargeBlockCachingAllocator::stats() const {
  absl::MutexLock lock(&impl_->mu);
  return impl_->stats;
}

void LargeBlockCachingAllocator::ReleaseKept() {
  std::map<size_t, BlockHeader*> kept;
  {
    absl::MutexLock lock(&impl_->mu);
    kept.swap(impl_->kept);
    for (const auto& [bytes, head] : kept) {
      for (BlockHeader* h = head; h != nullptr; h = h->next) {
        impl_->stats.kept_bytes -= static_cast<int64_t>(bytes);
        impl_->stats.mapped_bytes -= static_cast<int64_t>(bytes);
      }
    }
  }
  for (const auto& [bytes, head] : kept) {
    for (BlockHeader* h = head; h != nullptr;) {
      BlockHeader* next = h->next;
      munmap(h, bytes);
      h = next;
    }
  }
}

namespace {
std::atomic<LargeBlockCachingAllocator*> g_installed{nullptr};
}  // namespace

LargeBlockCachingAllocator* InstallHostAllocator() {
  // Never destroyed: tensors freed during static destruction still return
  // their blocks to it.
  static LargeBlockCachingAllocator* const allocator = [] {
    auto* a = new LargeBlockCachingAllocator();
    c10::SetCPUAllocator(a, /*priority=*/1);
    g_installed.store(a);
    return a;
  }();
  return allocator;
}

LargeBlockCachingAllocator* InstalledHostAllocator() { return g_installed.load(); }

const char* DescribeHostAllocator() {
  return "LibTorch CPU tensors of 1 MiB or more: own mappings, kept for reuse (best fit, <= 2x) "
         "(client/host_allocator.h)";
}

}  // namespace shardopt
