#include "client/checkpoint/checkpoint.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/crc32c.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

namespace shardopt {

namespace {

constexpr int64_t kBlockBytes = 4 << 20;  // CRC granularity inside a piece

std::string ShardName(int rank, int world) {
  return absl::StrCat("shard-", rank, "-of-", world, ".safetensors");
}

std::vector<uint32_t> BlockCrcs(const char* data, int64_t bytes, int64_t block_bytes) {
  std::vector<uint32_t> out;
  for (int64_t b = 0; b < bytes; b += block_bytes) {
    out.push_back(Crc32c(data + b, static_cast<size_t>(std::min(block_bytes, bytes - b))));
  }
  return out;
}

std::string Parent(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
}

// "step-<digits>" -> the step; false for anything else ("step-0-notes").
bool ParseStepName(const std::string& name, int64_t* step) {
  if (name.size() <= 5 || name.size() > 5 + 19 || name.rfind("step-", 0) != 0) return false;
  for (size_t i = 5; i < name.size(); ++i) {
    if (!absl::ascii_isdigit(static_cast<unsigned char>(name[i]))) return false;
  }
  return absl::SimpleAtoi(name.substr(5), step);
}

// Collects every rank's string on rank 0 (others get an empty vector).
absl::StatusOr<std::vector<std::string>> GatherStrings(Communicator* comm, const std::string& mine,
                                                       absl::Duration timeout) {
  const int n = comm->world_size(), r = comm->rank();
  auto lens = std::make_shared<std::vector<int64_t>>(n, 0);
  (*lens)[r] = static_cast<int64_t>(mine.size());
  SHARDOPT_RETURN_IF_ERROR(WaitSafely(
      comm, comm->AllGather(lens->data(), sizeof(int64_t), DType::kByte), timeout, lens));
  int64_t mx = 0;
  for (int64_t l : *lens) mx = std::max(mx, std::max<int64_t>(l, 0));
  auto buf = std::make_shared<std::vector<char>>(static_cast<size_t>(mx * n + 1), 0);
  std::memcpy(buf->data() + r * mx, mine.data(), mine.size());
  SHARDOPT_RETURN_IF_ERROR(
      WaitSafely(comm, comm->AllGather(buf->data(), mx, DType::kByte), timeout, buf));
  std::vector<std::string> out;
  for (int q = 0; q < n; ++q)
    out.emplace_back(buf->data() + q * mx, std::max<int64_t>((*lens)[q], 0));
  return out;
}

// Every rank learns whether all succeeded.
absl::Status AgreeOnSuccess(Communicator* comm, const absl::Status& mine, const char* what,
                            absl::Duration timeout, bool* agreed_failure = nullptr) {
  auto failed = std::make_shared<float>(mine.ok() ? 0.0f : 1.0f);
  absl::Status s = WaitSafely(
      comm, comm->AllReduce(failed.get(), 1, DType::kFloat32, ReduceOp::kMax), timeout, failed);
  if (!s.ok()) return s;
  // The agreement itself worked: every rank knows the step failed.
  if (*failed > 0 && agreed_failure != nullptr) *agreed_failure = true;
  if (!mine.ok()) return mine;
  if (*failed > 0) {
    return absl::AbortedError(absl::StrCat(what, " failed on another rank (see its error)"));
  }
  return absl::OkStatus();
}

void AppendLe64(uint64_t v, std::string* out) {
  for (int i = 0; i < 8; ++i) out->push_back(static_cast<char>(v >> (8 * i)));
}

// 8-byte little-endian length + the header JSON padded with spaces to 8 bytes.
std::string SafetensorsPrefix(const nlohmann::json& header) {
  std::string h = header.dump();
  while (h.size() % 8 != 0) h.push_back(' ');
  std::string out;
  AppendLe64(h.size(), &out);
  return out + h;
}

// What one rank wrote: its file and its pieces (sent to rank 0).
struct ShardWritten {
  ManifestFile file;
  std::vector<ManifestPiece> pieces;
  // Owned parameters whose update count (torch.optim's per-parameter
  // state['step']) is not the checkpoint's step: they missed steps without a
  // gradient. Layout index -> count.
  std::map<int, int64_t> param_steps;
};

nlohmann::json ToJson(const ShardWritten& w) {
  nlohmann::json j;
  j["name"] = w.file.name;
  j["bytes"] = w.file.bytes;
  j["crc32c"] = w.file.crc32c;
  j["pieces"] = nlohmann::json::array();
  for (const ManifestPiece& p : w.pieces) {
    j["pieces"].push_back({{"param", p.param},
                           {"offset", p.offset},
                           {"length", p.length},
                           {"begin", p.begin},
                           {"crc32c", p.crc32c}});
  }
  if (!w.param_steps.empty()) {
    j["param_steps"] = nlohmann::json::object();
    for (const auto& [param, count] : w.param_steps)
      j["param_steps"][std::to_string(param)] = count;
  }
  return j;
}

// Fragments come from this job's own ranks over the communicator; parsed
// without exceptions all the same.
absl::StatusOr<ShardWritten> FromJson(const std::string& text, int file) {
  nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
  if (!j.is_object()) return absl::InternalError("a rank sent a malformed checkpoint fragment");
  ShardWritten w;
  try {
    w.file = {j.at("name").get<std::string>(), j.at("bytes").get<int64_t>(),
              j.at("crc32c").get<uint32_t>()};
    for (const auto& pj : j.at("pieces")) {
      ManifestPiece p;
      p.param = pj.at("param").get<int>();
      p.offset = pj.at("offset").get<int64_t>();
      p.length = pj.at("length").get<int64_t>();
      p.file = file;
      p.begin = pj.at("begin").get<std::vector<int64_t>>();
      p.crc32c = pj.at("crc32c").get<std::vector<std::vector<uint32_t>>>();
      w.pieces.push_back(std::move(p));
    }
    if (j.contains("param_steps")) {
      for (const auto& [param, count] : j.at("param_steps").items()) {
        w.param_steps[std::stoi(param)] = count.get<int64_t>();
      }
    }
  } catch (const std::exception& e) {
    return absl::InternalError(
        absl::StrCat("a rank sent a malformed checkpoint fragment: ", e.what()));
  }
  return w;
}

}  // namespace

SavedOptimizer SavedOptimizerOf(const ShardedOptimizerOptions& o) {
  SavedOptimizer s;
  s.kind = OptimizerKindName(o.kind);
  if (o.kind == OptimizerKind::kSgd) {
    s.lr = o.sgd.lr;
    s.momentum = o.sgd.momentum;
    s.dampening = o.sgd.dampening;
    s.weight_decay = o.sgd.weight_decay;
    s.nesterov = o.sgd.nesterov;
  } else {
    s.lr = o.adam.lr;
    s.beta1 = o.adam.beta1;
    s.beta2 = o.adam.beta2;
    s.eps = o.adam.eps;
    s.weight_decay = o.adam.weight_decay;
  }
  return s;
}

// GPU-resident state is read and written through host copies of the owned
// slices; this ends the staging on every return.
class Staging {
 public:
  explicit Staging(ShardedOptimizer& opt) : opt_(opt) {}
  absl::Status Begin() {
    if (!opt_.on_device()) return absl::OkStatus();
    SHARDOPT_RETURN_IF_ERROR(OptimizerStateAccess(opt_).StageToHost());
    active_ = true;
    return absl::OkStatus();
  }
  absl::Status CopyBack() {
    if (!active_) return absl::OkStatus();
    active_ = false;
    return OptimizerStateAccess(opt_).EndStaging(/*copy_back=*/true);
  }
  ~Staging() {
    if (active_) (void)OptimizerStateAccess(opt_).EndStaging(/*copy_back=*/false);
  }

 private:
  ShardedOptimizer& opt_;
  bool active_ = false;
};

namespace {

std::vector<std::string> StateNames(const ShardedOptimizer& opt) {
  std::vector<std::string> states = {"param"};
  for (const auto& s : opt.state_names()) states.push_back(s);
  return states;
}

// The safetensors header of a rank's shard: every piece's arrays, in
// `states` order, one after the other.
nlohmann::json ShardHeader(const Layout& layout, const std::vector<Piece>& pieces,
                           const std::vector<std::string>& states, int rank, int world,
                           int64_t step) {
  nlohmann::json header = nlohmann::json::object();
  int64_t offset = 0;
  for (const Piece& p : pieces) {
    for (const std::string& s : states) {
      const std::string name =
          absl::StrCat(layout.params()[p.param].name, "::", s, "::", p.param_offset);
      header[name] = {{"dtype", "F32"},
                      {"shape", {p.length}},
                      {"data_offsets", {offset, offset + p.length * 4}}};
      offset += p.length * 4;
    }
  }
  header["__metadata__"] = {{"format", "shardopt-shard-v1"},
                            {"rank", std::to_string(rank)},
                            {"world_size", std::to_string(world)},
                            {"step", std::to_string(step)}};
  return header;
}

// The update counts of this rank's owned parameters that are not `step`.
std::map<int, int64_t> MissedParamSteps(ShardedOptimizer& opt, int rank, int64_t step) {
  std::map<int, int64_t> param_steps;
  for (const Piece& p : opt.layout().PiecesOfRank(rank)) {
    const int64_t count = opt.shard_owner().param_step(p.param);
    if (count != step) param_steps[p.param] = count;
  }
  return param_steps;
}

// Writes this rank's shard: temporary name, fsync, rename, directory fsync.
// The temporary file is removed on failure.
absl::StatusOr<ShardWritten> WriteShard(ShardedOptimizer& opt, FileSystem* fs,
                                        const std::string& dir, int64_t step, int64_t block_bytes) {
  const Layout& layout = opt.layout();
  const int rank = opt.communicator()->rank(), world = opt.communicator()->world_size();
  const std::vector<std::string> states = StateNames(opt);
  SHARDOPT_RETURN_IF_ERROR(fs->MakeDirs(dir));
  const std::vector<Piece> pieces = layout.PiecesOfRank(rank);
  const std::string prefix =
      SafetensorsPrefix(ShardHeader(layout, pieces, states, rank, world, step));
  ShardWritten out;
  out.file.name = ShardName(rank, world);
  out.param_steps = MissedParamSteps(opt, rank, step);
  const std::string path = absl::StrCat(dir, "/", out.file.name);
  SHARDOPT_ASSIGN_OR_RETURN(auto file, fs->NewWritableFile(path + ".tmp"));
  uint32_t crc = 0;
  auto append = [&](const void* d, size_t n) -> absl::Status {
    crc = Crc32cExtend(crc, d, n);
    return file->Append(d, n);
  };
  auto write_all = [&]() -> absl::Status {
    SHARDOPT_RETURN_IF_ERROR(append(prefix.data(), prefix.size()));
    int64_t at = static_cast<int64_t>(prefix.size());
    for (const Piece& p : pieces) {
      ShardedOptimizer::OwnedSlice slice = OptimizerStateAccess(opt).owned_slice(p.bucket);
      const float* arrays[3] = {slice.master, slice.state0, slice.state1};
      ManifestPiece mp{p.param, p.param_offset, p.length, rank, {}, {}};
      for (size_t si = 0; si < states.size(); ++si) {
        const char* data = reinterpret_cast<const char*>(arrays[si] + p.rank_offset);
        SHARDOPT_RETURN_IF_ERROR(append(data, p.length * 4));
        mp.begin.push_back(at);
        mp.crc32c.push_back(BlockCrcs(data, p.length * 4, block_bytes));
        at += p.length * 4;
      }
      out.pieces.push_back(std::move(mp));
    }
    out.file.bytes = at;
    SHARDOPT_RETURN_IF_ERROR(file->Sync());
    SHARDOPT_RETURN_IF_ERROR(file->Close());
    SHARDOPT_RETURN_IF_ERROR(fs->Rename(path + ".tmp", path));
    return fs->SyncDir(dir);
  };
  if (absl::Status s = write_all(); !s.ok()) {
    file.reset();
    (void)fs->Remove(path + ".tmp");
    return s;
  }
  out.file.crc32c = crc;
  return out;
}

// Rank 0: the manifest from every rank's fragment.
absl::StatusOr<Manifest> BuildManifest(const ShardedOptimizer& opt, int64_t step,
                                       const std::vector<std::string>& fragments,
                                       const CheckpointOptions& options) {
  const Layout& layout = opt.layout();
  Manifest m;
  m.step = step;
  m.world_size = static_cast<int>(fragments.size());
  m.optimizer = SavedOptimizerOf(opt.options());
  m.plan_bucket_cap_elements = layout.options().bucket_cap_elements;
  m.plan_alignment_elements = layout.options().alignment_elements;
  m.plan_allow_cut = layout.options().allow_cut;
  m.layout_hash = absl::StrFormat("%016x", layout.hash());
  m.states = StateNames(opt);
  m.block_bytes = options.block_bytes;
  for (const ParamSpec& p : layout.params()) {
    int64_t numel = 1;
    for (int64_t d : p.shape) numel *= d;
    m.params.push_back({p.name, p.shape, p.dtype, p.trainable, numel});
  }
  nlohmann::json param_steps = nlohmann::json::object();
  for (size_t q = 0; q < fragments.size(); ++q) {
    SHARDOPT_ASSIGN_OR_RETURN(ShardWritten w, FromJson(fragments[q], static_cast<int>(q)));
    m.files.push_back(w.file);
    for (auto& p : w.pieces) m.pieces.push_back(std::move(p));
    for (const auto& [param, count] : w.param_steps) {
      if (param < 0 || param >= static_cast<int>(m.params.size())) {
        return absl::InternalError("a rank sent a malformed checkpoint fragment (param_steps)");
      }
      param_steps[m.params[param].name] = count;
    }
  }
  m.user_metadata = options.user_metadata;
  if (!param_steps.empty()) m.user_metadata[kMetaParamSteps] = param_steps.dump();
  return m;
}

// Rank 0, once every shard is durable: the manifest, then LATEST.
absl::Status CommitCheckpoint(const ShardedOptimizer& opt, FileSystem* fs, const std::string& root,
                              const std::string& dir, int64_t step,
                              const std::vector<std::string>& fragments,
                              const CheckpointOptions& options) {
  auto m = BuildManifest(opt, step, fragments, options);
  absl::Status committed = m.status();
  if (committed.ok())
    committed = WriteFileAtomically(fs, dir + "/manifest.json", SerializeManifest(*m));
  if (committed.ok())
    committed = WriteFileAtomically(fs, root + "/LATEST", absl::StrCat("step-", step, "\n"));
  return committed;
}

// The agreement on the commit failed (`agreed`: a peer died or timed out
// after rank 0 committed). If LATEST names this checkpoint, it is complete:
// say so rather than report a failure.
absl::StatusOr<std::string> ConfirmCommitted(FileSystem* fs, const std::string& root,
                                             const std::string& dir, const absl::Status& agreed) {
  auto latest = ResolveCheckpoint(fs, root);
  if (latest.ok() && *latest == dir && ReadManifest(fs, dir).ok()) return dir;
  return absl::Status(agreed.code(), absl::StrCat("could not confirm that checkpoint ", dir,
                                                  " was committed: ", agreed.message()));
}

}  // namespace

absl::StatusOr<std::string> SaveCheckpoint(ShardedOptimizer& opt, const std::string& root,
                                           const CheckpointOptions& options) {
  // Parameters still being all-gathered (overlap_param_gather) are complete first.
  SHARDOPT_RETURN_IF_ERROR(opt.WaitForParameters());
  Staging staging(opt);
  SHARDOPT_RETURN_IF_ERROR(staging.Begin());
  FileSystem* fs = options.fs;
  Communicator* comm = opt.communicator();
  const absl::Duration timeout = opt.options().timeout;
  const int rank = comm->rank();
  const int64_t step = opt.step_count();
  const std::string dir = absl::StrCat(root, "/step-", step);
  // A save that fails removes what it wrote, so failed saves (a full disk)
  // leave no empty step-N/ behind; a directory that was there before is left.
  const bool existed = fs->Kind(dir) != EntryKind::kMissing;
  auto discard = [&](absl::Status s) {
    if (!existed) {
      if (rank == 0) (void)fs->Remove(dir + "/manifest.json");  // first: never looks complete
      (void)fs->Remove(absl::StrCat(dir, "/", ShardName(rank, comm->world_size())));
      (void)fs->RemoveDir(dir);  // succeeds for the last rank to get here
    }
    return s;
  };

  // 1. Every rank writes its shard.
  if (options.block_bytes < 4 || options.block_bytes > (64 << 20) || options.block_bytes % 4 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CRC block of ", options.block_bytes, " bytes: must be a multiple of 4 in [4, 64 MiB]"));
  }
  auto written = WriteShard(opt, fs, dir, step, options.block_bytes);
  absl::Status wrote = written.status();
  if (!wrote.ok()) {
    wrote = absl::Status(
        wrote.code(), absl::StrCat("rank ", rank, ": writing its shard failed: ", wrote.message()));
  }
  // Removed only when every rank learned of the failure: after a collective
  // that failed, rank 0 might still commit with this rank's shard.
  bool agreed_failure = false;
  if (absl::Status s = AgreeOnSuccess(comm, wrote, "writing a shard", timeout, &agreed_failure);
      !s.ok()) {
    return agreed_failure ? discard(s) : s;
  }

  // 2. Rank 0 writes the manifest once every shard is durable, then LATEST.
  auto gathered = GatherStrings(comm, ToJson(*written).dump(), timeout);
  if (!gathered.ok()) return gathered.status();
  const std::vector<std::string>& fragments = *gathered;
  absl::Status committed;
  if (rank == 0) committed = CommitCheckpoint(opt, fs, root, dir, step, fragments, options);
  absl::Status agreed =
      AgreeOnSuccess(comm, committed, "committing the checkpoint", timeout, &agreed_failure);
  // Rank 0 said it could not commit: nothing names this directory.
  if (agreed_failure) return discard(agreed);
  // The agreement itself failed: the checkpoint may be complete all the same.
  if (!agreed.ok() && committed.ok()) return ConfirmCommitted(fs, root, dir, agreed);
  SHARDOPT_RETURN_IF_ERROR(agreed);
  return dir;
}

absl::StatusOr<std::string> ResolveCheckpoint(FileSystem* fs, const std::string& path) {
  const EntryKind kind = fs->Kind(path);
  if (kind == EntryKind::kMissing)
    return absl::NotFoundError(absl::StrCat("'", path, "' does not exist"));
  if (fs->Kind(path + "/manifest.json") == EntryKind::kFile) return path;
  if (fs->Kind(path + "/LATEST") != EntryKind::kMissing) {
    SHARDOPT_ASSIGN_OR_RETURN(std::string latest, ReadWholeFile(fs, path + "/LATEST", 4096));
    while (!latest.empty() && (latest.back() == '\n' || latest.back() == ' ')) latest.pop_back();
    int64_t step;
    if (!ParseStepName(latest, &step)) {
      return absl::DataLossError(
          absl::StrCat("'", path, "/LATEST' is corrupt (it should name step-<N>)"));
    }
    const std::string dir = path + "/" + latest;
    if (fs->Kind(dir) != EntryKind::kDirectory ||
        fs->Kind(dir + "/manifest.json") != EntryKind::kFile) {
      return absl::DataLossError(
          absl::StrCat("'", path, "/LATEST' names ", latest,
                       ", which is not a checkpoint directory with a manifest"));
    }
    return dir;
  }
  return absl::NotFoundError(absl::StrCat("'", path,
                                          "' is neither a checkpoint (no manifest.json) "
                                          "nor a checkpoint root (no LATEST)"));
}

namespace {

absl::Status VerifyFile(FileSystem* fs, const std::string& dir, const ManifestFile& f,
                        std::vector<char>* buf) {
  const std::string path = dir + "/" + f.name;
  uint32_t crc = 0;
  buf->resize(kBlockBytes);
  for (int64_t off = 0; off < f.bytes; off += kBlockBytes) {
    const size_t n = static_cast<size_t>(std::min<int64_t>(kBlockBytes, f.bytes - off));
    SHARDOPT_RETURN_IF_ERROR(fs->ReadAt(path, static_cast<uint64_t>(off), n, buf->data()));
    crc = Crc32cExtend(crc, buf->data(), n);
  }
  if (crc != f.crc32c) {
    return absl::DataLossError(absl::StrCat("shard '", path, "' fails its CRC32C check (corrupt)"));
  }
  return absl::OkStatus();
}

}  // namespace

namespace {

// Reads state `si` of piece `p` block by block, checking each block's CRC,
// and hands the blocks to `sink` in order.
absl::Status StreamPiece(FileSystem* fs, const std::string& dir, const Manifest& m,
                         const ManifestPiece& p, size_t si, std::vector<char>* buf,
                         const std::function<absl::Status(const char*, size_t)>& sink) {
  const std::string file = dir + "/" + m.files[p.file].name;
  const int64_t bytes = p.length * 4;
  buf->resize(static_cast<size_t>(m.block_bytes));
  for (int64_t b = 0; b * m.block_bytes < bytes; ++b) {
    const size_t n = static_cast<size_t>(std::min(m.block_bytes, bytes - b * m.block_bytes));
    SHARDOPT_RETURN_IF_ERROR(
        fs->ReadAt(file, static_cast<uint64_t>(p.begin[si] + b * m.block_bytes), n, buf->data()));
    SHARDOPT_RETURN_IF_ERROR(CheckBlockCrc(m, p, si, b, buf->data(), n, file));
    if (sink) SHARDOPT_RETURN_IF_ERROR(sink(buf->data(), n));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status VerifyCheckpoint(FileSystem* fs, const std::string& dir) {
  SHARDOPT_ASSIGN_OR_RETURN(Manifest m, ReadManifest(fs, dir));
  std::vector<char> buf;
  for (const ManifestFile& f : m.files) SHARDOPT_RETURN_IF_ERROR(VerifyFile(fs, dir, f, &buf));
  // The pieces' own CRCs too: the manifest must describe the data, not just
  // name intact files.
  for (const ManifestPiece& p : m.pieces) {
    for (size_t si = 0; si < m.states.size(); ++si) {
      SHARDOPT_RETURN_IF_ERROR(StreamPiece(fs, dir, m, p, si, &buf, nullptr));
    }
  }
  return absl::OkStatus();
}

namespace {

// The checkpoint holds this model and this optimizer's kind of state.
absl::Status CheckCompatible(const ShardedOptimizer& opt, const Manifest& m,
                             const std::string& where) {
  const Layout& layout = opt.layout();
  if (m.params.size() != layout.params().size()) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint '", where, "' is of another model: ", m.params.size(),
                     " parameters, this model has ", layout.params().size()));
  }
  for (size_t i = 0; i < m.params.size(); ++i) {
    const ParamSpec& p = layout.params()[i];
    if (m.params[i].name != p.name || m.params[i].shape != p.shape ||
        m.params[i].trainable != p.trainable) {
      return absl::FailedPreconditionError(
          absl::StrCat("checkpoint '", where, "' is of another model: parameter #", i, " is '",
                       m.params[i].name, "' ", nlohmann::json(m.params[i].shape).dump(),
                       " there, '", p.name, "' ", nlohmann::json(p.shape).dump(), " here"));
    }
  }
  if (m.optimizer.kind != OptimizerKindName(opt.options().kind)) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint '", where, "' holds ", m.optimizer.kind,
                     " state; this optimizer is ", OptimizerKindName(opt.options().kind)));
  }
  const std::vector<std::string> want = StateNames(opt);
  if (m.states != want) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint '", where, "' holds states ", nlohmann::json(m.states).dump(),
                     "; this optimizer needs ", nlohmann::json(want).dump()));
  }
  return absl::OkStatus();
}

// Copies elements [lo, hi) of old piece `op` (state `si`) into `dst`,
// reading whole CRC blocks and checking them. Consecutive blocks are read
// together, up to 4 MiB at a time (small blocks, as a live resize's
// snapshots have, would otherwise cost one read each).
absl::Status ReadPieceRange(FileSystem* fs, const std::string& file, const Manifest& m,
                            const ManifestPiece& op, size_t si, int64_t lo, int64_t hi, char* dst,
                            std::vector<char>* buf) {
  const int64_t block = m.block_bytes, ob = op.offset, bytes = op.length * 4;
  const int64_t first = (lo - ob) * 4 / block, last = ((hi - ob) * 4 - 1) / block;
  const int64_t span = std::max<int64_t>(1, (4 << 20) / block);  // blocks per read
  for (int64_t b0 = first; b0 <= last; b0 += span) {
    const int64_t b1 = std::min(last, b0 + span - 1);
    const int64_t sb = b0 * block, se = std::min(bytes, (b1 + 1) * block);
    const int64_t cb = std::max(sb, (lo - ob) * 4), ce = std::min(se, (hi - ob) * 4);
    char* into = dst + (cb - (lo - ob) * 4);
    // Whole blocks go straight into place; a span with a partial block
    // through a buffer (a block's CRC covers all of it).
    const bool whole = cb == sb && ce == se;
    if (!whole) {
      buf->resize(static_cast<size_t>(se - sb));
      into = buf->data();
    }
    SHARDOPT_RETURN_IF_ERROR(fs->ReadAt(file, static_cast<uint64_t>(op.begin[si] + sb),
                                        static_cast<size_t>(se - sb), into));
    for (int64_t b = b0; b <= b1; ++b) {
      const int64_t bb = b * block, be = std::min(bytes, bb + block);
      SHARDOPT_RETURN_IF_ERROR(
          CheckBlockCrc(m, op, si, b, into + (bb - sb), static_cast<size_t>(be - bb), file));
    }
    if (!whole)
      std::memcpy(dst + (cb - (lo - ob) * 4), buf->data() + (cb - sb),
                  static_cast<size_t>(ce - cb));
  }
  return absl::OkStatus();
}

// Reads exactly the blocks that hold what this rank now owns.
absl::Status ReadOwnedFromShards(ShardedOptimizer& opt, FileSystem* fs, const std::string& dir,
                                 const Manifest& m, bool whole_files) {
  const Layout& layout = opt.layout();
  std::vector<char> buf;
  for (const Piece& np : layout.PiecesOfRank(opt.communicator()->rank())) {
    ShardedOptimizer::OwnedSlice slice = OptimizerStateAccess(opt).owned_slice(np.bucket);
    float* arrays[3] = {slice.master, slice.state0, slice.state1};
    const int64_t want_begin = np.param_offset, want_end = np.param_offset + np.length;
    for (int k : m.pieces_of_param[np.param]) {
      const ManifestPiece& op = m.pieces[k];
      const int64_t lo = std::max(want_begin, op.offset),
                    hi = std::min(want_end, op.offset + op.length);
      if (lo >= hi) continue;
      const std::string file = dir + "/" + m.files[op.file].name;
      for (size_t si = 0; si < m.states.size(); ++si) {
        char* dst = reinterpret_cast<char*>(arrays[si] + np.rank_offset + (lo - want_begin));
        SHARDOPT_RETURN_IF_ERROR(ReadPieceRange(fs, file, m, op, si, lo, hi, dst, &buf));
      }
    }
  }
  if (!whole_files) return absl::OkStatus();
  // Whole-file CRCs (they also cover the headers): file q is checked by rank
  // q mod N, so every file is read once more in all, in parallel.
  const int n = opt.communicator()->world_size();
  for (size_t q = static_cast<size_t>(opt.communicator()->rank()); q < m.files.size();
       q += static_cast<size_t>(n)) {
    SHARDOPT_RETURN_IF_ERROR(VerifyFile(fs, dir, m.files[q], &buf));
  }
  return absl::OkStatus();
}

// A consolidated safetensors file: whole tensors, "<param>" and
// "<param>.<state>", with the step and the optimizer in the metadata.
struct Consolidated {
  SafetensorsHeader header;
  Manifest m;                            // step, optimizer, states (params/pieces unused)
  std::map<std::string, uint32_t> crcs;  // per tensor, if recorded
};

std::string TensorName(const std::string& param, const std::string& state) {
  return state == "param" ? param : absl::StrCat(param, ".", state);
}

absl::StatusOr<Consolidated> ReadConsolidated(FileSystem* fs, const std::string& path) {
  Consolidated c;
  SHARDOPT_ASSIGN_OR_RETURN(c.header, ReadSafetensorsHeader(fs, path));
  auto meta = [&](const std::string& key) -> absl::StatusOr<std::string> {
    auto it = c.header.metadata.find(key);
    if (it == c.header.metadata.end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "'", path, "' is not a shardopt consolidated checkpoint (no ", key, " in its metadata)"));
    }
    return it->second;
  };
  SHARDOPT_ASSIGN_OR_RETURN(std::string format, meta("format"));
  if (format != kConsolidatedFormat) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", path, "' has format '", format, "', not ", kConsolidatedFormat));
  }
  SHARDOPT_ASSIGN_OR_RETURN(std::string step, meta("step"));
  if (!absl::SimpleAtoi(step, &c.m.step) || c.m.step < 0) {
    return absl::DataLossError(
        absl::StrCat("'", path, "': metadata step '", step, "' is not a step"));
  }
  SHARDOPT_ASSIGN_OR_RETURN(std::string opt, meta("optimizer"));
  SHARDOPT_ASSIGN_OR_RETURN(c.m.optimizer, ParseSavedOptimizer(opt, path));
  auto crcs = c.header.metadata.find("tensor_crc32c");
  if (crcs != c.header.metadata.end()) {
    nlohmann::json j = nlohmann::json::parse(crcs->second, nullptr, false);
    if (!j.is_object())
      return absl::DataLossError(absl::StrCat("'", path, "': metadata tensor_crc32c is corrupt"));
    for (auto it = j.begin(); it != j.end(); ++it) {
      if (!it.value().is_number_unsigned() || it.value().get<uint64_t>() > UINT32_MAX) {
        return absl::DataLossError(absl::StrCat("'", path, "': metadata tensor_crc32c is corrupt"));
      }
      c.crcs[it.key()] = static_cast<uint32_t>(it.value().get<uint64_t>());
    }
  }
  return c;
}

// The consolidated file holds exactly this model's trainable tensors, for the
// states this optimizer keeps.
absl::Status CheckConsolidated(const ShardedOptimizer& opt, const Consolidated& c,
                               const std::string& path) {
  const Layout& layout = opt.layout();
  if (c.m.optimizer.kind != OptimizerKindName(opt.options().kind)) {
    return absl::FailedPreconditionError(absl::StrCat("'", path, "' holds ", c.m.optimizer.kind,
                                                      " state; this optimizer is ",
                                                      OptimizerKindName(opt.options().kind)));
  }
  size_t expected = 0;
  for (const ParamSpec& p : layout.params()) {
    if (!p.trainable) continue;
    for (const std::string& s : StateNames(opt)) {
      ++expected;
      const SafetensorsEntry* e = c.header.Find(TensorName(p.name, s));
      if (e == nullptr) {
        return absl::FailedPreconditionError(absl::StrCat("'", path, "' has no tensor '",
                                                          TensorName(p.name, s),
                                                          "' (another model or optimizer?)"));
      }
      if (e->dtype != "F32" || e->shape != p.shape) {
        return absl::FailedPreconditionError(
            absl::StrCat("'", path, "': tensor '", e->name, "' is ", e->dtype, " ",
                         nlohmann::json(e->shape).dump(), ", this model needs F32 ",
                         nlohmann::json(p.shape).dump()));
      }
    }
  }
  if (c.header.tensors.size() != expected) {
    return absl::FailedPreconditionError(absl::StrCat(
        "'", path, "' holds ", c.header.tensors.size(), " tensors, this model and optimizer ",
        expected, " (another model or optimizer?)"));
  }
  return absl::OkStatus();
}

absl::Status VerifyTensorCrc(FileSystem* fs, const std::string& path, const SafetensorsEntry& e,
                             uint32_t want, std::vector<char>* buf) {
  buf->resize(kBlockBytes);
  uint32_t crc = 0;
  for (int64_t off = e.begin; off < e.end; off += kBlockBytes) {
    const size_t n = static_cast<size_t>(std::min<int64_t>(kBlockBytes, e.end - off));
    SHARDOPT_RETURN_IF_ERROR(fs->ReadAt(path, static_cast<uint64_t>(off), n, buf->data()));
    crc = Crc32cExtend(crc, buf->data(), n);
  }
  if (crc != want) {
    return absl::DataLossError(
        absl::StrCat("'", path, "' is corrupt: CRC32C mismatch in tensor '", e.name, "'"));
  }
  return absl::OkStatus();
}

absl::Status ReadOwnedFromConsolidated(ShardedOptimizer& opt, FileSystem* fs,
                                       const std::string& path, const Consolidated& c) {
  const Layout& layout = opt.layout();
  const std::vector<std::string> states = StateNames(opt);
  for (const Piece& np : layout.PiecesOfRank(opt.communicator()->rank())) {
    ShardedOptimizer::OwnedSlice slice = OptimizerStateAccess(opt).owned_slice(np.bucket);
    float* arrays[3] = {slice.master, slice.state0, slice.state1};
    for (size_t si = 0; si < states.size(); ++si) {
      const SafetensorsEntry* e =
          c.header.Find(TensorName(layout.params()[np.param].name, states[si]));
      SHARDOPT_RETURN_IF_ERROR(
          fs->ReadAt(path, static_cast<uint64_t>(e->begin + np.param_offset * 4),
                     static_cast<size_t>(np.length * 4), arrays[si] + np.rank_offset));
    }
  }
  // Tensor CRCs: tensor k is checked by rank k mod N.
  std::vector<char> buf;
  const size_t n = static_cast<size_t>(opt.communicator()->world_size());
  for (size_t k = static_cast<size_t>(opt.communicator()->rank()); k < c.header.tensors.size();
       k += n) {
    const SafetensorsEntry& e = c.header.tensors[k];
    auto it = c.crcs.find(e.name);
    if (it != c.crcs.end())
      SHARDOPT_RETURN_IF_ERROR(VerifyTensorCrc(fs, path, e, it->second, &buf));
  }
  return absl::OkStatus();
}

HyperParameters HyperOf(const ShardedOptimizer& opt, const SavedOptimizer& s) {
  AdamConfig adam = opt.options().adam;
  SgdConfig sgd = opt.options().sgd;
  adam.lr = s.lr;
  adam.beta1 = s.beta1;
  adam.beta2 = s.beta2;
  adam.eps = s.eps;
  adam.weight_decay = s.weight_decay;
  sgd.lr = s.lr;
  sgd.momentum = s.momentum;
  sgd.dampening = s.dampening;
  sgd.weight_decay = s.weight_decay;
  sgd.nesterov = s.nesterov;
  return HyperParameters{adam, sgd};
}

absl::Status ApplyHyperParameters(ShardedOptimizer& opt, const RestoredCheckpoint& info) {
  if (!info.groups.empty() && static_cast<int>(info.groups.size()) == opt.num_groups()) {
    for (int g = 0; g < opt.num_groups(); ++g) {
      SHARDOPT_RETURN_IF_ERROR(opt.SetGroup(g, HyperOf(opt, info.groups[g])));
    }
    return absl::OkStatus();
  }
  const HyperParameters h = HyperOf(opt, info.optimizer);
  return opt.SetHyperParameters(h.adam, h.sgd);
}

}  // namespace

absl::Status RestoreOwnedSlices(ShardedOptimizer& opt, const std::function<absl::Status()>& fill,
                                const RestoredCheckpoint& info) {
  SHARDOPT_RETURN_IF_ERROR(opt.WaitForParameters());  // gathers in flight end first
  Staging staging(opt);
  SHARDOPT_RETURN_IF_ERROR(staging.Begin());
  const absl::Status mine = fill();
  SHARDOPT_RETURN_IF_ERROR(
      AgreeOnSuccess(opt.communicator(), mine, "loading the checkpoint", opt.options().timeout));
  SHARDOPT_RETURN_IF_ERROR(staging.CopyBack());
  SHARDOPT_RETURN_IF_ERROR(ApplyHyperParameters(opt, info));
  SHARDOPT_RETURN_IF_ERROR(OptimizerStateAccess(opt).FinishRestore(info.step));
  return ApplyParamSteps(opt, info.user_metadata, info.path);
}

absl::Status ApplyParamSteps(ShardedOptimizer& opt,
                             const std::map<std::string, std::string>& user_metadata,
                             const std::string& where) {
  auto it = user_metadata.find(kMetaParamSteps);
  if (it == user_metadata.end()) return absl::OkStatus();
  nlohmann::json j = nlohmann::json::parse(it->second, nullptr, false);
  auto corrupt = [&](const std::string& why) {
    return absl::DataLossError(
        absl::StrCat("'", where, "': user metadata '", kMetaParamSteps, "' ", why));
  };
  if (!j.is_object()) return corrupt("is not a JSON object");
  std::map<std::string, int> index;
  const auto& params = opt.layout().params();
  for (size_t p = 0; p < params.size(); ++p) index[params[p].name] = static_cast<int>(p);
  for (const auto& [name, count] : j.items()) {
    auto p = index.find(name);
    if (p == index.end())
      return corrupt(absl::StrCat("names parameter '", name, "' not in the model"));
    if (!count.is_number_integer() || count.get<int64_t>() < 0 ||
        count.get<int64_t>() > opt.step_count()) {
      return corrupt(absl::StrCat("has a bad count for '", name, "'"));
    }
    opt.shard_owner().SetParamStep(p->second, count.get<int64_t>());
  }
  return absl::OkStatus();
}

absl::StatusOr<RestoredCheckpoint> LoadCheckpoint(ShardedOptimizer& opt, const std::string& path,
                                                  FileSystem* fs) {
  return LoadCheckpoint(opt, path, fs, /*whole_files=*/true);
}

absl::StatusOr<RestoredCheckpoint> LoadCheckpoint(ShardedOptimizer& opt, const std::string& path,
                                                  FileSystem* fs, bool whole_files) {
  RestoredCheckpoint info;
  auto fill = [&]() -> absl::Status {
    if (fs->Kind(path) == EntryKind::kFile) {
      SHARDOPT_ASSIGN_OR_RETURN(Consolidated c, ReadConsolidated(fs, path));
      SHARDOPT_RETURN_IF_ERROR(CheckConsolidated(opt, c, path));
      info = {path, "safetensors", c.m.step, 0, c.m.optimizer, {}, {}, !c.crcs.empty()};
      return ReadOwnedFromConsolidated(opt, fs, path, c);
    }
    SHARDOPT_ASSIGN_OR_RETURN(std::string dir, ResolveCheckpoint(fs, path));
    SHARDOPT_ASSIGN_OR_RETURN(Manifest m, ReadManifest(fs, dir));
    SHARDOPT_RETURN_IF_ERROR(CheckCompatible(opt, m, dir));
    info = {dir, "sharded", m.step, m.world_size, m.optimizer, {}, m.user_metadata, m.self_checked};
    return ReadOwnedFromShards(opt, fs, dir, m, whole_files);
  };
  SHARDOPT_RETURN_IF_ERROR(RestoreOwnedSlices(opt, fill, info));
  return info;
}

namespace {

// A directory PruneCheckpoints may delete: a real directory holding only the
// files a checkpoint holds.
bool IsOurCheckpointDir(FileSystem* fs, const std::string& dir, std::vector<std::string>* files) {
  if (fs->Kind(dir) != EntryKind::kDirectory) return false;
  auto entries = fs->ListDir(dir);
  if (!entries.ok()) return false;
  for (const std::string& f : *entries) {
    std::string base = f;
    if (base.size() > 4 && base.compare(base.size() - 4, 4, ".tmp") == 0)
      base.resize(base.size() - 4);
    int r = -1, w = -1;
    const bool shard = std::sscanf(base.c_str(), "shard-%d-of-%d", &r, &w) == 2 && r >= 0 &&
                       w > 0 && base == ShardName(r, w);
    // The Python API's state of a torch.optim class without fused kernels.
    const bool optim = std::sscanf(base.c_str(), "optimizer-%d-of-%d", &r, &w) == 2 && r >= 0 &&
                       w > 0 && base == absl::StrCat("optimizer-", r, "-of-", w, ".pt");
    if ((base != "manifest.json" && !shard && !optim) ||
        fs->Kind(dir + "/" + f) != EntryKind::kFile)
      return false;
  }
  *files = *entries;
  return true;
}

}  // namespace

absl::Status PruneCheckpoints(FileSystem* fs, const std::string& root, int keep,
                              std::vector<std::string>* skipped) {
  if (keep < 1) return absl::InvalidArgumentError("keep at least one checkpoint");
  SHARDOPT_ASSIGN_OR_RETURN(std::string latest_dir, ResolveCheckpoint(fs, root));
  SHARDOPT_ASSIGN_OR_RETURN(std::vector<std::string> entries, fs->ListDir(root));
  const std::string latest = latest_dir.substr(latest_dir.rfind('/') + 1);
  int64_t latest_step = -1;
  if (!ParseStepName(latest, &latest_step)) return absl::OkStatus();  // root itself is a checkpoint
  std::vector<std::pair<int64_t, std::string>> complete, unfinished;
  for (const std::string& e : entries) {
    int64_t step;
    if (!ParseStepName(e, &step)) continue;
    if (fs->Kind(root + "/" + e + "/manifest.json") == EntryKind::kFile) {
      complete.push_back({step, e});
    } else if (step < latest_step) {
      unfinished.push_back({step, e});
    }
  }
  std::sort(complete.rbegin(), complete.rend());
  std::vector<std::string> doomed;
  for (size_t i = static_cast<size_t>(keep); i < complete.size(); ++i) {
    if (complete[i].second != latest) doomed.push_back(complete[i].second);
  }
  for (const auto& u : unfinished) doomed.push_back(u.second);
  for (const std::string& d : doomed) {
    const std::string dir = root + "/" + d;
    std::vector<std::string> files;
    if (!IsOurCheckpointDir(fs, dir, &files)) {
      if (skipped != nullptr) skipped->push_back(dir);
      continue;
    }
    // The manifest first: a half-deleted checkpoint never looks complete.
    std::sort(files.begin(), files.end(), [](const std::string& a, const std::string& b) {
      return (a == "manifest.json") > (b == "manifest.json");
    });
    for (const std::string& f : files) SHARDOPT_RETURN_IF_ERROR(fs->Remove(dir + "/" + f));
    SHARDOPT_RETURN_IF_ERROR(fs->RemoveDir(dir));
  }
  return fs->SyncDir(root);
}

namespace {

// The consolidated header: whole tensors in (state, parameter) order.
struct ConsolidatedPlan {
  nlohmann::json header = nlohmann::json::object();
  std::vector<std::pair<size_t, size_t>> order;  // (param, state)
  std::vector<std::string> names;
  int64_t total_bytes = 0;
};

ConsolidatedPlan PlanConsolidated(const Manifest& m) {
  ConsolidatedPlan plan;
  for (size_t si = 0; si < m.states.size(); ++si) {
    for (size_t i = 0; i < m.params.size(); ++i) {
      if (!m.params[i].trainable) continue;
      const std::string name = TensorName(m.params[i].name, m.states[si]);
      plan.header[name] = {
          {"dtype", "F32"},
          {"shape", m.params[i].shape},
          {"data_offsets", {plan.total_bytes, plan.total_bytes + m.params[i].numel * 4}}};
      plan.total_bytes += m.params[i].numel * 4;
      plan.order.push_back({i, si});
      plan.names.push_back(name);
    }
  }
  return plan;
}

}  // namespace

absl::Status Consolidate(FileSystem* fs, const std::string& dir, const std::string& out,
                         const std::function<void(int64_t, int64_t)>& progress) {
  SHARDOPT_RETURN_IF_ERROR(VerifyCheckpoint(fs, dir));
  SHARDOPT_ASSIGN_OR_RETURN(Manifest m, ReadManifest(fs, dir));
  ConsolidatedPlan plan = PlanConsolidated(m);
  // Per-tensor CRCs go in the header, which precedes the data: one pass to
  // compute them (the data is read twice; it was verified above anyway).
  nlohmann::json crcs = nlohmann::json::object();
  std::vector<char> buf;
  auto stream = [&](size_t k,
                    const std::function<absl::Status(const char*, size_t)>& sink) -> absl::Status {
    const auto [i, si] = plan.order[k];
    for (int pk : m.pieces_of_param[i])
      SHARDOPT_RETURN_IF_ERROR(StreamPiece(fs, dir, m, m.pieces[pk], si, &buf, sink));
    return absl::OkStatus();
  };
  for (size_t k = 0; k < plan.order.size(); ++k) {
    uint32_t crc = 0;
    SHARDOPT_RETURN_IF_ERROR(stream(k, [&](const char* d, size_t n) {
      crc = Crc32cExtend(crc, d, n);
      return absl::OkStatus();
    }));
    crcs[plan.names[k]] = crc;
  }
  plan.header["__metadata__"] = {{"format", kConsolidatedFormat},
                                 {"step", std::to_string(m.step)},
                                 {"optimizer", SavedOptimizerJson(m.optimizer)},
                                 {"tensor_crc32c", crcs.dump()}};
  const std::string prefix = SafetensorsPrefix(plan.header);
  SHARDOPT_ASSIGN_OR_RETURN(auto file, fs->NewWritableFile(out + ".tmp"));
  int64_t done = 0;
  auto write_all = [&]() -> absl::Status {
    SHARDOPT_RETURN_IF_ERROR(file->Append(prefix.data(), prefix.size()));
    for (size_t k = 0; k < plan.order.size(); ++k) {
      SHARDOPT_RETURN_IF_ERROR(stream(k, [&](const char* d, size_t n) {
        done += static_cast<int64_t>(n);
        if (progress) progress(done, plan.total_bytes);
        return file->Append(d, n);
      }));
    }
    SHARDOPT_RETURN_IF_ERROR(file->Sync());
    SHARDOPT_RETURN_IF_ERROR(file->Close());
    return fs->Rename(out + ".tmp", out);
  };
  if (absl::Status s = write_all(); !s.ok()) {
    file.reset();
    (void)fs->Remove(out + ".tmp");
    return s;
  }
  return fs->SyncDir(Parent(out));
}

}  // namespace shardopt
