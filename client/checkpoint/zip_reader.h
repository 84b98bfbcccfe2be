// The zip container of a torch.save file (PyTorch >= 1.6): its central
// directory checked before miniz acts on it, then its records read through
// LibTorch's PyTorchStreamReader. Used by torch_pickle.cc, which interprets
// the records (data.pkl and the storages).
#ifndef SHARDOPT_CLIENT_CHECKPOINT_ZIP_READER_H_
#define SHARDOPT_CLIENT_CHECKPOINT_ZIP_READER_H_

#include <c10/core/Allocator.h>
#include <caffe2/serialize/read_adapter_interface.h>

#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace caffe2 {
namespace serialize {
class PyTorchStreamReader;
}  // namespace serialize
}  // namespace caffe2

namespace shardopt {

// Reads from memory or a file; never past the end (what is missing reads as
// zeros and the short count tells miniz).
class BoundedReadAdapter final : public caffe2::serialize::ReadAdapterInterface {
 public:
  // `data` must outlive the adapter; `fd` is closed by it.
  BoundedReadAdapter(const char* data, uint64_t size) : data_(data), size_(size) {}
  BoundedReadAdapter(int fd, uint64_t size) : fd_(fd), size_(size) {}
  ~BoundedReadAdapter() override;
  BoundedReadAdapter(const BoundedReadAdapter&) = delete;
  BoundedReadAdapter& operator=(const BoundedReadAdapter&) = delete;

  size_t size() const override { return size_; }
  size_t read(uint64_t pos, void* buf, size_t n, const char* what = "") const override;

 private:
  const char* data_ = nullptr;
  int fd_ = -1;
  uint64_t size_;
};

// A torch.save zip archive, opened once its central directory has been
// checked: every record stored (torch.save never compresses), not encrypted,
// not a directory, inside the file, names unique regardless of case; the
// records in one folder; a version record this LibTorch reads. miniz
// allocates a record's declared size before reading it; the checks keep that
// within the file, and RecordSize lets a caller check a record's size before
// it is read.
class TorchZipReader {
 public:
  // Checks `in`'s central directory, then opens it with PyTorchStreamReader.
  // Errors start with `name`: DataLoss (truncated or corrupt), InvalidArgument
  // (compressed records, records not in a folder, an unsupported format
  // version); what PyTorchStreamReader throws is a DataLoss "<name>: not a
  // readable torch.save archive: ...". Throws only std::bad_alloc (checking).
  static absl::StatusOr<std::unique_ptr<TorchZipReader>> Open(
      std::shared_ptr<BoundedReadAdapter> in, const std::string& name);
  ~TorchZipReader();
  TorchZipReader(const TorchZipReader&) = delete;
  TorchZipReader& operator=(const TorchZipReader&) = delete;

  // The archive's bytes.
  uint64_t file_size() const { return file_size_; }

  // The size of `record` (as PyTorchStreamReader names it: inside the
  // archive's folder, regardless of case) in the checked central directory;
  // nullopt if there is no such record. Reads nothing.
  std::optional<uint64_t> RecordSize(const std::string& record) const;

  // PyTorchStreamReader's hasRecord and getRecord (the record's bytes, in a
  // buffer of its own). They throw what it throws (c10::Error, std::bad_alloc).
  bool HasRecord(const std::string& record);
  std::tuple<at::DataPtr, size_t> GetRecord(const std::string& record);

 private:
  TorchZipReader() = default;

  uint64_t file_size_ = 0;
  std::string prefix_;                               // the folder, lowercased, with its '/'
  std::unordered_map<std::string, uint64_t> sizes_;  // lowercased full name -> bytes
  std::unique_ptr<caffe2::serialize::PyTorchStreamReader> reader_;
};

// For error messages about torch.save files (shared with torch_pickle.cc):
// a string from the file, escaped and cut short, in quotes; an exception's
// message on one line, without LibTorch's backtrace.
std::string QuoteForError(absl::string_view s);
// The unsigned little-endian integer in p[0, n) (n <= 8): zip records and
// pickle opcodes alike.
uint64_t LoadLE(const char* p, int n);
std::string ExceptionOneLine(const std::exception& e);

}  // namespace shardopt

#endif  // SHARDOPT_CLIENT_CHECKPOINT_ZIP_READER_H_
