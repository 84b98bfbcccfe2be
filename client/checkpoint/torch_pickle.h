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
// can bound neither the recursion depth nor memory: TorchReadLimits bounds
// memory by a small multiple of the file's size (docs/checkpoints.md, "Limits
// for torch.save files").
#ifndef SHARDOPT_CLIENT_CHECKPOINT_TORCH_PICKLE_H_
#define SHARDOPT_CLIENT_CHECKPOINT_TORCH_PICKLE_H_

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
// two keys, a memoized list) are shared PyValues here too, and so are, as in
// Python, None, True, False, the ints 0..255, the empty tuple and each global
// (one per name). A returned value is acyclic and at most
// TorchReadLimits::max_depth deep.
struct PyValue {
  // kObject: an instance of a class, or the result of a call, that this
  // reader does not rebuild (a scheduler's state, a bound method, an epoch
  // counter class): `s` holds the global's name; nothing of it is executed
  // or kept. Readers skip such values and name the key when they needed it.
  enum class Kind {
    kNone,
    kBool,
    kInt,
    kFloat,
    kString,
    kBytes,
    kList,
    kTuple,
    kDict,
    kTensor,
    kObject
  };
  Kind kind = Kind::kNone;
  bool b = false;                 // kBool
  int64_t i = 0;                  // kInt
  double f = 0;                   // kFloat
  std::string s;                  // kString (UTF-8), kBytes; kObject: the class or function name
  std::vector<PyValuePtr> items;  // kList, kTuple
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

// What reading one file may cost. The defaults follow one rule: memory is
// bounded by a small multiple of what the file holds. Besides the storage
// records (read once each, and only after their size in the zip directory is
// checked against what the pickle declares) and data.pkl itself, the reader
// allocates at most the memory budget, an upper estimate (charged before each
// allocation) of every value (~160 bytes each; None, bools, ints 0..255 and
// the empty tuple are shared), string, container slot, memo entry, dict index
// and tensor copy. So a 100 MB file takes at most ~1 GB, whatever it holds.
// A limit exceeded is an error naming the limit and the file
// (ResourceExhausted; InvalidArgument for max_depth and max_file_bytes).
struct TorchReadLimits {
  // The whole file, checked before anything is read.
  int64_t max_file_bytes = 64LL << 30;
  // Nesting of containers in the result (and of pickle MARKs while reading).
  int64_t max_depth = 1000;
  // Items: values pushed (created or taken again from the memo or by DUP),
  // memo entries stored and container insertions. At most
  // items_per_pickle_byte per byte of data.pkl (every opcode adds at most 2,
  // so this only bounds what a future opcode could add) and at most max_items.
  int64_t items_per_pickle_byte = 2;
  int64_t max_items = 100000000;
  // The memory budget: memory_per_file_byte x the file's size (for
  // ParsePickle: the pickle's plus the storages' bytes) + base_memory_bytes,
  // and at most max_memory_bytes.
  int64_t memory_per_file_byte = 8;
  int64_t base_memory_bytes = 32LL << 20;
  int64_t max_memory_bytes = 64LL << 30;
  // Bytes of tensor data copied out of storages (views of part of a storage,
  // transposes, expanded tensors, which are larger than their storage); these
  // copies count against the memory budget too, which bounds them first for
  // any file under 8 GiB. Tensors that span a whole storage share it: free.
  int64_t max_tensor_bytes = 64LL << 30;
};

// Reads a file written by torch.save (the zip format, PyTorch >= 1.6) or by
// LibTorch's torch::pickle_save. Errors are InvalidArgument (not such a file,
// unsupported content, max_depth or max_file_bytes exceeded), ResourceExhausted
// (another limit exceeded) or DataLoss (truncated or corrupt) Statuses,
// NotFound for a missing file, with one line naming the file and what is
// wrong; never an exception, a crash, or memory beyond TorchReadLimits.
absl::StatusOr<PyValuePtr> ReadTorchFile(const std::string& path,
                                         const TorchReadLimits& limits = {});
absl::StatusOr<PyValuePtr> ReadTorchBytes(const std::string& bytes,
                                          const std::string& name_for_errors,
                                          const TorchReadLimits& limits = {});

// The layer below ReadTorchBytes, exposed for tests: interprets the pickle
// `data.pkl`. A storage the pickle references (persistent id ('storage', type,
// key, location, numel)) comes from `load_storage(key, dtype, numel)`, which
// returns `numel` elements of `dtype` as a 1-D contiguous CPU tensor (record
// "data/<key>" of the archive) or an error; it is called once per key.
using StorageLoader = std::function<absl::StatusOr<at::Tensor>(
    const std::string& key, at::ScalarType dtype, int64_t numel)>;
absl::StatusOr<PyValuePtr> ParsePickle(absl::string_view pickle, const StorageLoader& load_storage,
                                       const std::string& name_for_errors = "<pickle>",
                                       const TorchReadLimits& limits = {});

}  // namespace shardopt

#endif  // SHARDOPT_CLIENT_CHECKPOINT_TORCH_PICKLE_H_
