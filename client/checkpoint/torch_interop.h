// PyTorch interoperability for checkpoints.
//
// Export goes through LibTorch's own pickler (torch::pickle_save writes what
// Python's torch.load reads). Import reads torch.save files with shardopt's
// data-only unpickler (client/checkpoint/torch_pickle.h), because LibTorch 1.13's
// torch::pickle_load cannot read what Python's torch.save writes.
#ifndef SHARDOPT_CLIENT_CHECKPOINT_TORCH_INTEROP_H_
#define SHARDOPT_CLIENT_CHECKPOINT_TORCH_INTEROP_H_

#include <ATen/ATen.h>

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/checkpoint/checkpoint.h"
#include "client/sharded_optimizer.h"
#include "common/file_system.h"
#include "common/optimizer_config.h"

namespace shardopt {

// Writes a file that Python's torch.load reads into exactly the state_dict()
// of torch.optim.Adam / AdamW / SGD ("state", "param_groups"; parameter
// indices in registration order of the trainable parameters), plus
// "param_names" (index -> name), "params" (name -> fp32 tensor) and "step"
// alongside. Builds the whole state in memory, as torch.save does.
absl::Status ExportTorch(FileSystem* fs, const std::string& ckpt_dir, const std::string& out);

// The parameter groups a checkpoint records in its user metadata (written by
// the Python API and by ImportTorch): each group's hyper-parameters, JSON in
// torch's param_groups keys ({"lr", "betas", "eps", "weight_decay"}, or SGD's
// {"lr", "momentum", "dampening", "weight_decay", "nesterov"}), and the group
// of each trainable parameter in layout order.
inline constexpr char kMetaParamGroups[] = "shardopt.param_groups";
inline constexpr char kMetaParamGroupOf[] = "shardopt.param_group_of";

// An optimizer's state as a torch.save file holds it, by parameter name.
struct TorchCheckpoint {
  std::vector<std::string> names;            // the optimizer's parameters, in its index order
  std::map<std::string, at::Tensor> params;  // name -> fp32 values (contiguous)
  std::map<std::string, std::map<std::string, at::Tensor>> state;  // name -> {"exp_avg": ...}
  int64_t step = 0;
  // The names whose state['step'] is not `step` (parameters that missed
  // steps without a gradient; 0: no state at all), as kMetaParamSteps holds.
  std::map<std::string, int64_t> param_steps;
  SavedOptimizer optimizer;  // param_groups[0]'s
  // Every param group's hyper-parameters, and the group of each name in
  // `names` (torch numbers the parameters group after group).
  std::vector<SavedOptimizer> groups;
  std::vector<int> group_of;
};

// Reads `optimizer_file`: an optimizer state_dict written by torch.save
// (torch.optim.Adam / AdamW / SGD: PyTorch does not record which, so `kind`
// says), a {"model": model.state_dict(), "optimizer": opt.state_dict()} file
// (also "model_state_dict" / "optimizer_state_dict"), or shardopt's own
// export. The parameters come from `params_file` when given (a model
// state_dict, or a combined file), else from the optimizer file. When
// `expected_names` is given (the live model's trainable parameters, in
// order), optimizer index k is that list's k-th name; otherwise names come
// from the file ("param_names") or from the model state_dict's parameters in
// order (its buffers - running_mean, running_var, num_batches_tracked and
// non-float tensors - skipped). Errors are one line naming the file.
absl::StatusOr<TorchCheckpoint> ReadTorchCheckpoint(
    const std::string& optimizer_file, const std::string& params_file, OptimizerKind kind,
    const std::vector<std::string>* expected_names = nullptr);

// Writes a one-rank shardopt checkpoint under `out_root` from a torch.save
// file (see ReadTorchCheckpoint); any world size can resume from it.
absl::Status ImportTorch(const std::string& optimizer_file, const std::string& params_file,
                         OptimizerKind kind, const std::string& out_root);

// Collective: resumes `optimizer` from `path`, whatever it is: a checkpoint
// directory or root, a consolidated .safetensors file, or a torch.save file
// (shardctl consolidate --format=torch, or PyTorch's own; parameters must be
// in it). Every format restores the step and the hyper-parameters.
absl::StatusOr<RestoredCheckpoint> LoadAnyCheckpoint(ShardedOptimizer& optimizer,
                                                     const std::string& path,
                                                     FileSystem* fs = PosixFileSystem());

}  // namespace shardopt

#endif  // SHARDOPT_CLIENT_CHECKPOINT_TORCH_INTEROP_H_
