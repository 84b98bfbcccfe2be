// A data-only reader of files written by Python's torch.save (the zip format,
// PyTorch >= 1.6) and by LibTorch's torch::pickle_save.
//
// LibTorch 1.13's torch::pickle_load cannot read what Python's torch.save
// writes (APPEND is unsupported, collections.OrderedDict becomes None), so
// checkpoints are imported through this reader instead. It is a pickle
// interpreter that never executes or imports anything: the only GLOBALs it
// accepts come from a fixed whitelist (OrderedDict, the tensor and parameter
// rebuilders, the typed storages, the TorchScript list/type-tag helpers,
// torch.device, the dtypes and _codecs.encode for protocol-2 bytes); anything
// else is an error that names it. Every read is bounds-checked, and the input
// can bound neither the recursion depth nor (beyond TorchReadLimits) memory.
#ifndef SHARDOPT_CLIENT_TORCH_PICKLE_H_
#define SHARDOPT_CLIENT_TORCH_PICKLE_H_

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace shardopt {

struct PyValue;
using PyValuePtr = std::shared_ptr<PyValue>;

// One unpickled Python value. Objects the pickle shares (a tensor stored under
// two keys, a memoized list) are shared PyValues here too. A returned value is
// acyclic and at most TorchReadLimits::max_depth deep.
struct PyValue {
  // kObject: an instance of a class, or the result of a call, that this
  // reader does not rebuild (a scheduler's state, a bound method, an epoch
  // counter class): `s` holds the global's name; nothing of it is executed
  // or kept. Readers skip such values and name the key when they needed it.
  enum class Kind { kNone, kBool, kInt, kFloat, kString, kBytes, kList, kTuple, kDict, kTensor, kObject };
  Kind kind = Kind::kNone;
  bool b = false;     // kBool
  int64_t i = 0;      // kInt
  double f = 0;       // kFloat
  std::string s;      // kString (UTF-8), kBytes; kObject: the class or function name
  std::vector<PyValuePtr> items;                           // kList, kTuple
  std::vector<std::pair<PyValuePtr, PyValuePtr>> entries;  // kDict, insertion order kept
  // kTensor: a contiguous CPU tensor (requires_grad false) that owns its
  // memory. A tensor that spans its whole storage shares that storage with the
  // other tensors that do (as torch.load's would); a view of part of a storage
  // (a slice, a transpose, an expand) is copied out into its own memory.
  // A bare storage in the pickle reads as a 1-D tensor.
  at::Tensor tensor;

  // Dict lookup by a str or an int key: nullptr if absent or not a dict.
  const PyValue* Find(const std::string& key) const;
  const PyValue* Find(int64_t key) const;
  // An int, float or bool, or a 1-element tensor (torch 1.13 stores Adam's
  // "step" as a tensor). AsDouble() is NaN for anything else.
  bool IsNumber() const;
  double AsDouble() const;
  // "None", "bool", "int", "float", "str", "bytes", "list", "tuple", "dict",
  // "tensor float32 [3, 4]", "object of datetime.date (not read)": for error messages.
  std::string Describe() const;
};

struct TorchReadLimits {
  int64_t max_file_bytes = 64LL << 30;   // the whole file
  int64_t max_depth = 1000;              // nesting of containers (and of pickle MARKs)
  int64_t max_items = 100000000;         // values created + container insertions
  // Bytes of tensor data copied out of storages (views of part of a storage,
  // expanded tensors); tensors that span a whole storage cost nothing here.
  int64_t max_tensor_bytes = 64LL << 30;
};

// Reads a file written by torch.save (the zip format, PyTorch >= 1.6) or by
// LibTorch's torch::pickle_save. Errors are InvalidArgument (not such a file,
// unsupported content, a limit exceeded) or DataLoss (truncated or corrupt)
// Statuses, NotFound for a missing file, with one line naming the file and
// what is wrong; never an exception, a crash, or unbounded memory.
absl::StatusOr<PyValuePtr> ReadTorchFile(const std::string& path, const TorchReadLimits& limits = {});
absl::StatusOr<PyValuePtr> ReadTorchBytes(const std::string& bytes, const std::string& name_for_errors,
                                          const TorchReadLimits& limits = {});

// The layer below ReadTorchBytes, exposed for tests: interprets the pickle
// `data.pkl`. A storage the pickle references (persistent id ('storage', type,
// key, location, numel)) comes from `load_storage(key, dtype, numel)`, which
// returns `numel` elements of `dtype` as a 1-D contiguous CPU tensor (record
// "data/<key>" of the archive) or an error; it is called once per key.
using StorageLoader =
    std::function<absl::StatusOr<at::Tensor>(const std::string& key, at::ScalarType dtype, int64_t numel)>;
absl::StatusOr<PyValuePtr> ParsePickle(absl::string_view pickle, const StorageLoader& load_storage,
                                       const std::string& name_for_errors = "<pickle>",
                                       const TorchReadLimits& limits = {});

}  // namespace shardopt

#endif  // SHARDOPT_CLIENT_TORCH_PICKLE_H_
