#include "common/malloc_tuning.h"

#include <dlfcn.h>

#include <malloc.h>

#include "absl/strings/str_cat.h"

namespace shardopt {

namespace {
// Free memory kept at the heap top before it is trimmed (1 GiB, i.e. never for
// per-step temporaries).
constexpr int kTrimThreshold = 1 << 30;
}  // namespace

absl::Status ApplyMallocMode(MallocMode mode) {
  if (mode == MallocMode::kDefault) return absl::OkStatus();
  // M_MMAP_MAX = 0: large blocks come from the heap and are reused, not
  // unmapped. One arena: big blocks freed by one thread are reused by another,
  // and secondary arenas (whose heaps are capped at 64 MiB) never need mmap.
  if (mallopt(M_MMAP_MAX, 0) != 1) return absl::InternalError("mallopt(M_MMAP_MAX, 0) failed");
  if (mallopt(M_TRIM_THRESHOLD, kTrimThreshold) != 1) {
    return absl::InternalError("mallopt(M_TRIM_THRESHOLD) failed");
  }
  if (mallopt(M_ARENA_MAX, 1) != 1) return absl::InternalError("mallopt(M_ARENA_MAX, 1) failed");
  return absl::OkStatus();
}

std::string DescribeMallocMode(MallocMode mode) {
  if (mode == MallocMode::kDefault) {
    return "malloc: glibc defaults (large blocks mmapped and unmapped on free, heap trimmed)";
  }
  return absl::StrCat("malloc: tuned (mallopt M_MMAP_MAX=0, M_TRIM_THRESHOLD=", kTrimThreshold,
                      ", M_ARENA_MAX=1: freed memory stays in the process)");
}

absl::Status ParseMallocMode(const std::string& text, MallocMode* mode) {
  if (text == "tuned") {
    *mode = MallocMode::kTuned;
  } else if (text == "default") {
    *mode = MallocMode::kDefault;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown malloc mode '", text, "' (expected 'tuned' or 'default')"));
  }
  return absl::OkStatus();
}

bool LimitBlasThreads(int threads) {
  using SetThreads = void (*)(int);
  auto set = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  if (set == nullptr) return false;
  set(threads);
  return true;
}

}  // namespace shardopt
