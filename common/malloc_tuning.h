// glibc malloc settings for training processes.
//
// With glibc's defaults, buffers above the mmap threshold (at most 32 MiB) are
// mmapped and returned to the OS on free, and the heap top is trimmed: a
// training step that allocates large temporaries every step (LibTorch's Adam
// does) page-faults them in again every step, which made the same step up to
// 20x slower on our CI machines. Tuning keeps freed memory in the process.
#ifndef SHARDOPT_COMMON_MALLOC_TUNING_H_
#define SHARDOPT_COMMON_MALLOC_TUNING_H_

#include <string>

#include "absl/status/status.h"

namespace shardopt {

enum class MallocMode {
  kDefault,  // leave glibc as it is
  kTuned,    // no mmap for large blocks, no trimming, one arena
};

// Applies `mode` to this process (call early in main(), before threads start).
// Errors if glibc refuses a setting.
absl::Status ApplyMallocMode(MallocMode mode);

// Limits OpenBLAS (which LibTorch's matmuls use) to `threads` threads when it
// is loaded: at::set_num_threads() does not reach it, and its default (one
// thread per CPU) spins idle threads on the cores other ranks need. Same as
// OMP_NUM_THREADS=threads before start. Returns false when OpenBLAS is absent.
bool LimitBlasThreads(int threads);

// One line saying which settings are in force, for start-up logs and benchmarks.
std::string DescribeMallocMode(MallocMode mode);

// Parses "tuned" / "default".
absl::Status ParseMallocMode(const std::string& text, MallocMode* mode);

}  // namespace shardopt

#endif  // SHARDOPT_COMMON_MALLOC_TUNING_H_
