// Sharded, crash-safe checkpoints that any world size can resume from.
//
// Layout (docs/design.md, "Checkpoints"):
//   ROOT/step-<N>/shard-<r>-of-<W>.safetensors  written by every rank in parallel:
//       its owned pieces of the fp32 parameters ("param") and of every optimizer
//       state ("exp_avg", ...), one tensor "<param>::<state>::<offset>" each;
//   ROOT/step-<N>/manifest.json  written by rank 0 only after every shard is
//       durable: step, world size, optimizer, parameters, every piece with its
//       byte ranges and CRC32C per 4 MiB block, CRC32C and size of every file,
//       user metadata, and the manifest's own CRC32C (client/checkpoint/manifest.h);
//   ROOT/LATEST  names the newest complete checkpoint.
// Every file: temporary name, fsync, rename, directory fsync. A failure or a
// crash at any moment leaves LATEST naming a complete checkpoint.
#ifndef SHARDOPT_CLIENT_CHECKPOINT_CHECKPOINT_H_
#define SHARDOPT_CLIENT_CHECKPOINT_CHECKPOINT_H_

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/checkpoint/manifest.h"
#include "client/sharded_optimizer.h"
#include "common/file_system.h"

namespace shardopt {

struct CheckpointOptions {
  FileSystem* fs = PosixFileSystem();
  // Travels in the manifest (e.g. data position, RNG seed).
  std::map<std::string, std::string> user_metadata;
  // Granularity of the per-block CRC32C: a load reads whole blocks around
  // what it needs. Smaller for a live resize's snapshots (client/resize.h),
  // whose readers take small ranges over the network.
  int64_t block_bytes = 4 << 20;
};

// Collective: every rank calls it at the same step. Returns the checkpoint's
// directory. On error (disk full, I/O error, a failed rank) nothing is
// committed, LATEST is unchanged, no temporary file is left behind, and
// training can continue.
absl::StatusOr<std::string> SaveCheckpoint(ShardedOptimizer& optimizer, const std::string& root,
                                           const CheckpointOptions& options = CheckpointOptions());

// What a load restored.
struct RestoredCheckpoint {
  std::string path;    // the checkpoint directory or file actually read
  std::string format;  // "sharded", "safetensors" (consolidated) or "torch"
  int64_t step = 0;
  int world_size = 0;        // ranks that saved it (0: not known, a consolidated file)
  SavedOptimizer optimizer;  // the hyper-parameters now in force
  // Per parameter group, when the checkpoint has them (a torch.save file with
  // several param_groups): group g gets groups[g]; else every group `optimizer`.
  std::vector<SavedOptimizer> groups;
  std::map<std::string, std::string> user_metadata;
  bool fully_verified = true;  // every byte read was covered by a CRC
};

// Collective. `path` is a checkpoint directory, a root with LATEST, or a
// consolidated safetensors file written by Consolidate. Each rank reads
// exactly the byte ranges it owns under the current layout (any world size),
// verifying their CRCs; the whole-file CRCs are checked too, each file by one
// rank. Restores parameters, optimizer state, the step and the saved
// hyper-parameters (lr, betas, ...). Errors name the file or parameter:
// corrupt, edited or truncated files, missing shards, another model, another
// optimizer kind. On error the optimizer is unchanged on GPU and may hold
// partly loaded values on CPU: do not train on after a failed load.
absl::StatusOr<RestoredCheckpoint> LoadCheckpoint(ShardedOptimizer& optimizer,
                                                  const std::string& path,
                                                  FileSystem* fs = PosixFileSystem());

// As above; whole_files = false skips the whole-file CRC pass (every block
// read is still checked against its CRC32C): a live resize reads other
// ranks' snapshots this way, where that pass would move all the state.
absl::StatusOr<RestoredCheckpoint> LoadCheckpoint(ShardedOptimizer& optimizer,
                                                  const std::string& path, FileSystem* fs,
                                                  bool whole_files);

// The common end of every load (sharded, consolidated, torch files): runs
// `fill`, which writes this rank's owned slices (owned_slice(), staged on the
// host for GPU state) and sets `info`; agrees with every rank that all
// succeeded; then restores info.optimizer's hyper-parameters and info.step.
// Collective.
absl::Status RestoreOwnedSlices(ShardedOptimizer& optimizer,
                                const std::function<absl::Status()>& fill,
                                const RestoredCheckpoint& info);

// User metadata of a checkpoint: {parameter name: update count} of the
// parameters whose count (torch.optim's per-parameter state['step']) is not
// the checkpoint's step, because some steps had no gradient for them.
inline constexpr char kMetaParamSteps[] = "shardopt.param_steps";
// Sets those counts after a restore (RestoreOwnedSlices does). Errors: the
// entry is corrupt or names a parameter the model lacks.
absl::Status ApplyParamSteps(ShardedOptimizer& optimizer,
                             const std::map<std::string, std::string>& user_metadata,
                             const std::string& where);

// Resolves a root (via LATEST) or checkpoint directory to a checkpoint directory.
absl::StatusOr<std::string> ResolveCheckpoint(FileSystem* fs, const std::string& path);
// Reads every file in full and checks sizes and CRCs.
absl::Status VerifyCheckpoint(FileSystem* fs, const std::string& ckpt_dir);

// Deletes all but the newest `keep` complete checkpoints under `root` (and
// unfinished step directories older than LATEST, left by crashes). Never
// touches the checkpoint LATEST names, and only ever removes what it can prove
// is a checkpoint it wrote: a real directory (not a symlink) named
// step-<digits> holding nothing but manifest.json and shard-*-of-*.safetensors
// files (and their .tmp). Anything else is left alone and listed in
// `skipped` (if given). keep >= 1.
absl::Status PruneCheckpoints(FileSystem* fs, const std::string& root, int keep,
                              std::vector<std::string>* skipped = nullptr);

// Streams the shards into one safetensors file of whole tensors ("<param>" for
// the fp32 parameters, "<param>.<state>" for optimizer state), in constant
// memory, with the step, the optimizer and a CRC32C per tensor in its
// metadata. `progress(done_bytes, total_bytes)` is called as it goes. On
// failure no output (and no temporary file) is left.
absl::Status Consolidate(FileSystem* fs, const std::string& ckpt_dir, const std::string& out,
                         const std::function<void(int64_t, int64_t)>& progress = nullptr);

// The hyper-parameters of `options` as a checkpoint saves them.
SavedOptimizer SavedOptimizerOf(const ShardedOptimizerOptions& options);

}  // namespace shardopt

#endif  // SHARDOPT_CLIENT_CHECKPOINT_CHECKPOINT_H_
