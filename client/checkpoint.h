// Sharded, crash-safe checkpoints that any world size can resume from.
//
// Layout (DESIGN.md, "Checkpoints"):
//   ROOT/step-<N>/shard-<r>-of-<W>.safetensors  written by every rank in parallel:
//       its owned pieces of the fp32 parameters ("param") and of every optimizer
//       state ("exp_avg", ...), one tensor "<param>::<state>::<offset>" each;
//   ROOT/step-<N>/manifest.json  written by rank 0 only after every shard is
//       durable: step, world size, optimizer, parameters, every piece with its
//       byte ranges and CRC32C per 4 MiB block, CRC32C and size of every file,
//       user metadata;
//   ROOT/LATEST  names the newest complete checkpoint.
// Every file: temporary name, fsync, rename, directory fsync. A failure or a
// crash at any moment leaves LATEST naming a complete checkpoint.
#ifndef SHARDOPT_CLIENT_CHECKPOINT_H_
#define SHARDOPT_CLIENT_CHECKPOINT_H_

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/sharded_optimizer.h"
#include "common/file_system.h"
#include "nlohmann/json.hpp"

namespace shardopt {

struct CheckpointOptions {
  FileSystem* fs = PosixFileSystem();
  // Travels in the manifest (e.g. data position, RNG seed).
  std::map<std::string, std::string> user_metadata;
};

// Collective: every rank calls it at the same step. Returns the checkpoint's
// directory. On error (disk full, I/O error, a failed rank) nothing is
// committed, LATEST is unchanged, and training can continue.
absl::StatusOr<std::string> SaveCheckpoint(ShardedOptimizer& optimizer, const std::string& root,
                                           const CheckpointOptions& options = CheckpointOptions());

// Collective. `path` is a checkpoint directory or a root with LATEST. Each
// rank reads exactly the byte ranges it owns under the current layout (any
// world size), verifying their CRCs. Errors name the file or parameter:
// corrupt or truncated files, missing shards, another model, another
// optimizer kind. Returns the manifest.
absl::StatusOr<nlohmann::json> LoadCheckpoint(ShardedOptimizer& optimizer, const std::string& path,
                                              FileSystem* fs = PosixFileSystem());

// Resolves a root (via LATEST) or checkpoint directory to a checkpoint directory.
absl::StatusOr<std::string> ResolveCheckpoint(FileSystem* fs, const std::string& path);
absl::StatusOr<nlohmann::json> ReadManifest(FileSystem* fs, const std::string& ckpt_dir);
// Reads every file in full and checks sizes and CRCs.
absl::Status VerifyCheckpoint(FileSystem* fs, const std::string& ckpt_dir);

// Deletes all but the newest `keep` complete checkpoints under `root` (and
// unfinished step directories older than LATEST, left by crashes). Never
// touches the checkpoint LATEST names. keep >= 1.
absl::Status PruneCheckpoints(FileSystem* fs, const std::string& root, int keep);

// Streams the shards into one safetensors file of whole tensors ("<param>" for
// the fp32 parameters, "<param>.<state>" for optimizer state), in constant
// memory. `progress(done_bytes, total_bytes)` is called as it goes.
absl::Status Consolidate(FileSystem* fs, const std::string& ckpt_dir, const std::string& out,
                         const std::function<void(int64_t, int64_t)>& progress = nullptr);

}  // namespace shardopt

#endif  // SHARDOPT_CLIENT_CHECKPOINT_H_
