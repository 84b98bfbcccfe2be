// The checkpoint manifest as a typed value, and the one parser that turns
// bytes from disk into it.
//
// Everything that reads a checkpoint (resume, inspect, verify, consolidate,
// torch export, the checkpoints listing) goes through ParseManifest /
// ReadManifest, which validate the whole document once: JSON types, ranges,
// indices, file names confined to the step directory, pieces that tile every
// trainable tensor exactly, CRC lists of the right length, byte ranges inside
// their files, and the manifest's own CRC32C (so an edited manifest is
// detected). Code past that point may index without checks.
//
// The same file holds the reader of safetensors headers (the shards and the
// consolidated file), validated the same way.
#ifndef SHARDOPT_CLIENT_CHECKPOINT_MANIFEST_H_
#define SHARDOPT_CLIENT_CHECKPOINT_MANIFEST_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/file_system.h"
#include "common/param_spec.h"

namespace shardopt {

inline constexpr char kManifestFormat[] = "shardopt-checkpoint-v2";
// Written by shardopt before the manifest carried its own CRC; still read.
inline constexpr char kManifestFormatV1[] = "shardopt-checkpoint-v1";
inline constexpr char kConsolidatedFormat[] = "shardopt-consolidated-v1";

// Limits on what a reader accepts (a manifest is small: about 200 bytes per
// piece; GPT-2 small at 64 ranks is ~2 MB).
inline constexpr int64_t kMaxManifestBytes = 256LL << 20;
inline constexpr int64_t kMaxSafetensorsHeaderBytes = 100LL << 20;
inline constexpr int kMaxWorldSize = 1 << 20;
inline constexpr int64_t kMaxTensorElements = 1LL << 40;

// Hyper-parameters as saved (torch.optim's names).
struct SavedOptimizer {
  std::string kind;  // "adam" | "adamw" | "sgd"
  double lr = 0;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;  // adam, adamw
  double momentum = 0, dampening = 0;             // sgd
  bool nesterov = false;                          // sgd
  double weight_decay = 0;
};

struct ManifestParam {
  std::string name;
  std::vector<int64_t> shape;
  DType dtype = DType::kFloat32;
  bool trainable = true;
  int64_t numel = 0;  // product of shape (checked against overflow)
};

struct ManifestFile {
  std::string name;  // a plain file name inside the step directory
  int64_t bytes = 0;
  uint32_t crc32c = 0;
};

// A contiguous run [offset, offset + length) of one parameter's elements,
// stored in `file`, one fp32 array per state at byte offsets `begin[s]`,
// checksummed per `block_bytes` block in `crc32c[s]`.
struct ManifestPiece {
  int param = 0;
  int64_t offset = 0;
  int64_t length = 0;
  int file = 0;
  std::vector<int64_t> begin;
  std::vector<std::vector<uint32_t>> crc32c;
};

struct Manifest {
  std::string format = kManifestFormat;
  int64_t step = 0;
  int world_size = 1;
  SavedOptimizer optimizer;
  int64_t plan_bucket_cap_elements = 0;
  int64_t plan_alignment_elements = 0;
  bool plan_allow_cut = true;
  std::string layout_hash;
  std::vector<std::string> states;  // "param" first, then optimizer states
  int64_t block_bytes = 4 << 20;
  std::vector<ManifestParam> params;
  std::vector<ManifestFile> files;
  std::vector<ManifestPiece> pieces;
  std::map<std::string, std::string> user_metadata;
  // False for v1 manifests, which carry no CRC of their own.
  bool self_checked = true;

  // Derived by the parser: for each parameter, its pieces in offset order
  // (indices into `pieces`); they tile [0, numel) exactly.
  std::vector<std::vector<int>> pieces_of_param;
  int64_t total_file_bytes() const;
};

// Parses and validates a manifest document. `where` names the file in errors.
// Does not look at the shard files (see ReadManifest).
absl::StatusOr<Manifest> ParseManifest(const std::string& text, const std::string& where);

// The document for `m` (v2, with its CRC32C). ParseManifest(SerializeManifest(m))
// gives back `m`.
std::string SerializeManifest(const Manifest& m);
// For fuzz tests: recomputes the CRC of an edited v2 document, so that the
// edit reaches the validation behind the CRC check.
std::string ResealManifestForTesting(const std::string& text);

// The optimizer hyper-parameters as a JSON object text, and back (validated:
// a known kind, finite numbers in torch.optim's ranges).
std::string SavedOptimizerJson(const SavedOptimizer& o);
absl::StatusOr<SavedOptimizer> ParseSavedOptimizer(const std::string& json_text,
                                                   const std::string& where);

// Checks block `block` of state `state` of piece `p` (its `n` bytes at
// `data`) against the manifest's CRC; DataLoss naming `file` and the
// parameter otherwise.
absl::Status CheckBlockCrc(const Manifest& m, const ManifestPiece& p, size_t state, int64_t block,
                           const char* data, size_t n, const std::string& file);
// The same for a whole piece's state held in memory (p.length * 4 bytes).
absl::Status CheckPieceCrcs(const Manifest& m, const ManifestPiece& p, size_t state,
                            const char* data, const std::string& file);

// Reads `dir`/manifest.json (a regular file, not a symlink, at most
// kMaxManifestBytes), parses it, and checks every shard file it names exists
// as a regular file of the recorded size. Errors name the file.
absl::StatusOr<Manifest> ReadManifest(FileSystem* fs, const std::string& dir);

// One tensor of a safetensors header.
struct SafetensorsEntry {
  std::string name;
  std::string dtype;  // "F32", "BF16", ...
  std::vector<int64_t> shape;
  int64_t begin = 0;  // absolute byte offsets in the file
  int64_t end = 0;
};

struct SafetensorsHeader {
  int64_t data_start = 0;                 // 8 + header length
  std::vector<SafetensorsEntry> tensors;  // in data order
  std::map<std::string, std::string> metadata;
  const SafetensorsEntry* Find(const std::string& name) const;
};

// Validates a safetensors header for a file of `file_bytes` bytes whose first
// bytes are `prefix` (at least the 8-byte length and the header): JSON types,
// known dtypes, shape x dtype size == byte range, ranges inside the file and
// not overlapping, names unique.
absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(const std::string& prefix,
                                                         int64_t file_bytes,
                                                         const std::string& where);
// Reads and validates the header of the safetensors file at `path`.
absl::StatusOr<SafetensorsHeader> ReadSafetensorsHeader(FileSystem* fs, const std::string& path);

// Bytes per element of a safetensors dtype name, 0 if unknown.
int SafetensorsDTypeSize(const std::string& dtype);

}  // namespace shardopt

#endif  // SHARDOPT_CLIENT_CHECKPOINT_MANIFEST_H_
