// PyTorch interoperability for checkpoints, through LibTorch's own pickler
// (torch::pickle_save / pickle_load write and read the format of Python's
// torch.save / torch.load), so no hand-written serializer is involved.
#ifndef SHARDOPT_CLIENT_TORCH_INTEROP_H_
#define SHARDOPT_CLIENT_TORCH_INTEROP_H_

#include <string>

#include "absl/status/status.h"
#include "common/file_system.h"
#include "server/optimizer_config.h"

namespace shardopt {

// Writes a file that Python's torch.load reads into exactly the state_dict()
// of torch.optim.Adam / AdamW / SGD ("state", "param_groups"; parameter
// indices in registration order of the trainable parameters), plus
// "param_names" (index -> name) and "params" (name -> fp32 tensor) alongside.
// Builds the whole state in memory, as torch.save does.
absl::Status ExportTorch(FileSystem* fs, const std::string& ckpt_dir, const std::string& out);

// The reverse: reads an optimizer state_dict file written by torch.save (or by
// ExportTorch) and the model's parameters (a state_dict file of name -> tensor;
// "" to use the "params" entry of the optimizer file), and writes a one-rank
// shardopt checkpoint under `out_root` that any world size can resume from.
absl::Status ImportTorch(const std::string& optimizer_file, const std::string& params_file,
                         OptimizerKind kind, const std::string& out_root);

}  // namespace shardopt

#endif  // SHARDOPT_CLIENT_TORCH_INTEROP_H_
