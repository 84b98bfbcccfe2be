#include "client/checkpoint.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/crc32c.h"
#include "common/status_macros.h"

namespace shardopt {

namespace {

constexpr int64_t kBlockBytes = 4 << 20;  // CRC granularity inside a piece
constexpr char kFormat[] = "shardopt-checkpoint-v1";

std::string ShardName(int rank, int world) {
  return absl::StrCat("shard-", rank, "-of-", world, ".safetensors");
}

std::vector<uint32_t> BlockCrcs(const char* data, int64_t bytes) {
  std::vector<uint32_t> out;
  for (int64_t b = 0; b < bytes; b += kBlockBytes) {
    out.push_back(Crc32c(data + b, static_cast<size_t>(std::min(kBlockBytes, bytes - b))));
  }
  return out;
}

nlohmann::json OptimizerJson(const ShardedOptimizerOptions& o) {
  nlohmann::json j;
  j["kind"] = OptimizerKindName(o.kind);
  if (o.kind == OptimizerKind::kSgd) {
    j["lr"] = o.sgd.lr;
    j["momentum"] = o.sgd.momentum;
    j["dampening"] = o.sgd.dampening;
    j["weight_decay"] = o.sgd.weight_decay;
    j["nesterov"] = o.sgd.nesterov;
  } else {
    j["lr"] = o.adam.lr;
    j["betas"] = {o.adam.beta1, o.adam.beta2};
    j["eps"] = o.adam.eps;
    j["weight_decay"] = o.adam.weight_decay;
  }
  return j;
}

// Collects every rank's string on rank 0 (others get an empty vector).
absl::StatusOr<std::vector<std::string>> GatherStrings(Communicator* comm, const std::string& mine,
                                                       absl::Duration timeout) {
  const int n = comm->world_size(), r = comm->rank();
  std::vector<int64_t> lens(n, 0);
  lens[r] = static_cast<int64_t>(mine.size());
  SHARDOPT_RETURN_IF_ERROR(
      comm->AllGather(lens.data(), sizeof(int64_t), ElementType::kByte)->Wait(timeout));
  int64_t mx = 0;
  for (int64_t l : lens) mx = std::max(mx, std::max<int64_t>(l, 0));
  std::vector<char> buf(static_cast<size_t>(mx * n + 1), 0);
  std::memcpy(buf.data() + r * mx, mine.data(), mine.size());
  SHARDOPT_RETURN_IF_ERROR(comm->AllGather(buf.data(), mx, ElementType::kByte)->Wait(timeout));
  std::vector<std::string> out;
  for (int q = 0; q < n; ++q) out.emplace_back(buf.data() + q * mx, std::max<int64_t>(lens[q], 0));
  return out;
}

// Every rank learns whether all succeeded.
absl::Status AgreeOnSuccess(Communicator* comm, const absl::Status& mine, const char* what) {
  float failed = mine.ok() ? 0.0f : 1.0f;
  absl::Status s = comm->AllReduce(&failed, 1, ElementType::kFloat32, ReduceOp::kMax)
                       ->Wait(absl::Seconds(300));
  if (!s.ok()) return s;
  if (!mine.ok()) return mine;
  if (failed > 0) {
    return absl::AbortedError(absl::StrCat(what, " failed on another rank (see its error)"));
  }
  return absl::OkStatus();
}

}  // namespace

// GPU-resident state is read and written through host copies of the owned
// slices; this ends the staging on every return.
class Staging {
 public:
  explicit Staging(ShardedOptimizer& opt) : opt_(opt) {}
  absl::Status Begin() {
    if (!opt_.on_device()) return absl::OkStatus();
    SHARDOPT_RETURN_IF_ERROR(opt_.StageToHost());
    active_ = true;
    return absl::OkStatus();
  }
  absl::Status CopyBack() {
    if (!active_) return absl::OkStatus();
    active_ = false;
    return opt_.EndStaging(/*copy_back=*/true);
  }
  ~Staging() {
    if (active_) (void)opt_.EndStaging(/*copy_back=*/false);
  }

 private:
  ShardedOptimizer& opt_;
  bool active_ = false;
};

absl::StatusOr<std::string> SaveCheckpoint(ShardedOptimizer& opt, const std::string& root,
                                           const CheckpointOptions& options) {
  Staging staging(opt);
  SHARDOPT_RETURN_IF_ERROR(staging.Begin());
  FileSystem* fs = options.fs;
  Communicator* comm = opt.communicator();
  const Layout& layout = opt.layout();
  const int rank = comm->rank(), world = comm->world_size();
  const int64_t step = opt.step_count();
  const std::string dir = absl::StrCat(root, "/step-", step);
  std::vector<std::string> states = {"param"};
  for (const auto& s : opt.state_names()) states.push_back(s);

  // 1. Every rank writes its shard (temporary name, fsync, rename).
  nlohmann::json fragment;
  auto write_shard = [&]() -> absl::Status {
    SHARDOPT_RETURN_IF_ERROR(fs->MakeDirs(dir));
    const std::vector<Piece> pieces = layout.PiecesOfRank(rank);
    nlohmann::json header = nlohmann::json::object();
    int64_t offset = 0;
    nlohmann::json pieces_json = nlohmann::json::array();
    for (const Piece& p : pieces) {
      nlohmann::json pj;
      pj["param"] = p.param;
      pj["offset"] = p.param_offset;
      pj["length"] = p.length;
      for (const std::string& s : states) {
        const std::string name = absl::StrCat(layout.params()[p.param].name, "::", s, "::",
                                              p.param_offset);
        header[name] = {{"dtype", "F32"},
                        {"shape", {p.length}},
                        {"data_offsets", {offset, offset + p.length * 4}}};
        pj["begin"].push_back(offset);
        offset += p.length * 4;
      }
      pieces_json.push_back(pj);
    }
    header["__metadata__"] = {{"format", "shardopt-shard-v1"},
                              {"rank", std::to_string(rank)},
                              {"world_size", std::to_string(world)},
                              {"step", std::to_string(step)}};
    std::string h = header.dump();
    while ((h.size() + 8) % 8 != 0) h.push_back(' ');  // safetensors pads with spaces
    const uint64_t hlen = h.size();
    const int64_t data_start = 8 + static_cast<int64_t>(hlen);
    const std::string path = absl::StrCat(dir, "/", ShardName(rank, world));
    SHARDOPT_ASSIGN_OR_RETURN(auto file, fs->NewWritableFile(path + ".tmp"));
    uint32_t crc = 0;
    auto append = [&](const void* d, size_t n) -> absl::Status {
      crc = Crc32cExtend(crc, d, n);
      return file->Append(d, n);
    };
    unsigned char len_le[8];
    for (int i = 0; i < 8; ++i) len_le[i] = static_cast<unsigned char>(hlen >> (8 * i));
    SHARDOPT_RETURN_IF_ERROR(append(len_le, 8));
    SHARDOPT_RETURN_IF_ERROR(append(h.data(), h.size()));
    size_t k = 0;
    for (const Piece& p : pieces) {
      ShardedOptimizer::OwnedSlice slice = opt.owned_slice(p.bucket);
      const float* arrays[3] = {slice.master, slice.state0, slice.state1};
      for (size_t si = 0; si < states.size(); ++si) {
        const char* data = reinterpret_cast<const char*>(arrays[si] + p.rank_offset);
        SHARDOPT_RETURN_IF_ERROR(append(data, p.length * 4));
        pieces_json[k]["crc32c"].push_back(BlockCrcs(data, p.length * 4));
        pieces_json[k]["begin"][si] = data_start + pieces_json[k]["begin"][si].get<int64_t>();
      }
      ++k;
    }
    SHARDOPT_RETURN_IF_ERROR(file->Sync());
    SHARDOPT_RETURN_IF_ERROR(file->Close());
    SHARDOPT_RETURN_IF_ERROR(fs->Rename(path + ".tmp", path));
    SHARDOPT_RETURN_IF_ERROR(fs->SyncDir(dir));
    fragment["file"] = ShardName(rank, world);
    fragment["bytes"] = data_start + offset;
    fragment["crc32c"] = crc;
    fragment["pieces"] = pieces_json;
    return absl::OkStatus();
  };
  absl::Status written = write_shard();
  if (!written.ok()) {
    written = absl::Status(written.code(),
                           absl::StrCat("rank ", rank, ": writing its shard failed: ", written.message()));
  }
  SHARDOPT_RETURN_IF_ERROR(AgreeOnSuccess(comm, written, "writing a shard"));

  // 2. Rank 0 writes the manifest once every shard is durable, then LATEST.
  SHARDOPT_ASSIGN_OR_RETURN(auto fragments, GatherStrings(comm, fragment.dump(), absl::Seconds(300)));
  absl::Status committed;
  if (rank == 0) {
    nlohmann::json m;
    m["format"] = kFormat;
    m["step"] = step;
    m["world_size"] = world;
    m["optimizer"] = OptimizerJson(opt.options());
    m["plan"] = {{"bucket_cap_elements", layout.options().bucket_cap_elements},
                 {"alignment_elements", layout.options().alignment_elements},
                 {"allow_cut", layout.options().allow_cut}};
    m["layout_hash"] = absl::StrFormat("%016x", layout.hash());
    m["states"] = states;
    m["block_bytes"] = kBlockBytes;
    for (const ParamSpec& p : layout.params()) {
      m["params"].push_back({{"name", p.name},
                             {"shape", p.shape},
                             {"dtype", DTypeName(p.dtype)},
                             {"trainable", p.trainable}});
    }
    for (int q = 0; q < world; ++q) {
      nlohmann::json f = nlohmann::json::parse(fragments[q]);
      m["files"].push_back({{"name", f["file"]}, {"bytes", f["bytes"]}, {"crc32c", f["crc32c"]}});
      for (auto& p : f["pieces"]) {
        p["file"] = q;
        m["pieces"].push_back(p);
      }
    }
    m["user_metadata"] = options.user_metadata;
    committed = WriteFileAtomically(fs, dir + "/manifest.json", m.dump(1));
    if (committed.ok()) committed = WriteFileAtomically(fs, root + "/LATEST", absl::StrCat("step-", step, "\n"));
  }
  SHARDOPT_RETURN_IF_ERROR(AgreeOnSuccess(comm, committed, "committing the checkpoint"));
  return dir;
}

absl::StatusOr<std::string> ResolveCheckpoint(FileSystem* fs, const std::string& path) {
  if (fs->Exists(path + "/manifest.json")) return path;
  if (fs->Exists(path + "/LATEST")) {
    SHARDOPT_ASSIGN_OR_RETURN(std::string latest, ReadWholeFile(fs, path + "/LATEST"));
    while (!latest.empty() && (latest.back() == '\n' || latest.back() == ' ')) latest.pop_back();
    if (latest.empty() || latest.find('/') != std::string::npos || latest.find("..") != std::string::npos) {
      return absl::DataLossError(absl::StrCat("'", path, "/LATEST' is corrupt"));
    }
    const std::string dir = path + "/" + latest;
    if (!fs->Exists(dir + "/manifest.json")) {
      return absl::DataLossError(absl::StrCat("'", path, "/LATEST' names ", latest,
                                              ", which has no manifest"));
    }
    return dir;
  }
  return absl::NotFoundError(absl::StrCat("'", path, "' is neither a checkpoint (no manifest.json) "
                                          "nor a checkpoint root (no LATEST)"));
}

absl::StatusOr<nlohmann::json> ReadManifest(FileSystem* fs, const std::string& dir) {
  SHARDOPT_ASSIGN_OR_RETURN(std::string text, ReadWholeFile(fs, dir + "/manifest.json"));
  nlohmann::json m;
  try {
    m = nlohmann::json::parse(text);
    if (m.at("format").get<std::string>() != kFormat) {
      return absl::InvalidArgumentError(absl::StrCat("'", dir, "/manifest.json': unknown format"));
    }
    (void)m.at("params").size();
    (void)m.at("pieces").size();
    (void)m.at("files").size();
  } catch (const std::exception& e) {
    return absl::DataLossError(absl::StrCat("'", dir, "/manifest.json' is corrupt: ", e.what()));
  }
  return m;
}

absl::Status VerifyCheckpoint(FileSystem* fs, const std::string& dir) {
  SHARDOPT_ASSIGN_OR_RETURN(nlohmann::json m, ReadManifest(fs, dir));
  std::vector<char> buf(kBlockBytes);
  for (const auto& f : m["files"]) {
    const std::string path = dir + "/" + f["name"].get<std::string>();
    auto size = fs->FileSize(path);
    if (!size.ok()) return absl::NotFoundError(absl::StrCat("shard '", path, "' is missing"));
    if (static_cast<int64_t>(*size) != f["bytes"].get<int64_t>()) {
      return absl::DataLossError(absl::StrCat("shard '", path, "' has ", *size, " bytes, the manifest says ",
                                              f["bytes"].get<int64_t>(), " (truncated?)"));
    }
    uint32_t crc = 0;
    for (uint64_t off = 0; off < *size; off += buf.size()) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(buf.size(), *size - off));
      SHARDOPT_RETURN_IF_ERROR(fs->ReadAt(path, off, n, buf.data()));
      crc = Crc32cExtend(crc, buf.data(), n);
    }
    if (crc != f["crc32c"].get<uint32_t>()) {
      return absl::DataLossError(absl::StrCat("shard '", path, "' fails its CRC32C check (corrupt)"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<nlohmann::json> LoadCheckpoint(ShardedOptimizer& opt, const std::string& path,
                                              FileSystem* fs) {
  Staging staging(opt);
  SHARDOPT_RETURN_IF_ERROR(staging.Begin());
  Communicator* comm = opt.communicator();
  const Layout& layout = opt.layout();
  const int rank = comm->rank();
  nlohmann::json m;
  auto read_mine = [&]() -> absl::Status {
    SHARDOPT_ASSIGN_OR_RETURN(std::string dir, ResolveCheckpoint(fs, path));
    SHARDOPT_ASSIGN_OR_RETURN(m, ReadManifest(fs, dir));
    // Same model, same optimizer.
    const auto& params = m["params"];
    if (params.size() != layout.params().size()) {
      return absl::FailedPreconditionError(absl::StrCat("checkpoint '", dir, "' is of another model: ",
                                                        params.size(), " parameters, this model has ",
                                                        layout.params().size()));
    }
    for (size_t i = 0; i < params.size(); ++i) {
      const ParamSpec& p = layout.params()[i];
      if (params[i]["name"] != p.name || params[i]["shape"].get<std::vector<int64_t>>() != p.shape ||
          params[i]["trainable"].get<bool>() != p.trainable) {
        return absl::FailedPreconditionError(absl::StrCat(
            "checkpoint '", dir, "' is of another model: parameter #", i, " is '",
            params[i]["name"].get<std::string>(), "' ", params[i]["shape"].dump(), " there, '", p.name,
            "' here"));
      }
    }
    const std::string kind = m["optimizer"]["kind"].get<std::string>();
    if (kind != OptimizerKindName(opt.options().kind)) {
      return absl::FailedPreconditionError(absl::StrCat("checkpoint '", dir, "' holds ", kind,
                                                        " state; this optimizer is ",
                                                        OptimizerKindName(opt.options().kind)));
    }
    std::vector<std::string> want = {"param"};
    for (const auto& s : opt.state_names()) want.push_back(s);
    const auto have = m["states"].get<std::vector<std::string>>();
    if (have != want) {
      return absl::FailedPreconditionError(absl::StrCat("checkpoint '", dir, "' holds states ",
                                                        m["states"].dump(), "; this optimizer needs ",
                                                        nlohmann::json(want).dump()));
    }
    const int64_t block = m["block_bytes"].get<int64_t>();
    // Old pieces by parameter, in offset order.
    std::vector<std::vector<const nlohmann::json*>> by_param(layout.params().size());
    for (const auto& p : m["pieces"]) {
      const int idx = p["param"].get<int>();
      if (idx < 0 || idx >= static_cast<int>(by_param.size())) return absl::DataLossError("manifest: bad piece");
      by_param[idx].push_back(&p);
    }
    for (auto& v : by_param) {
      std::sort(v.begin(), v.end(), [](const nlohmann::json* a, const nlohmann::json* b) {
        return (*a)["offset"].get<int64_t>() < (*b)["offset"].get<int64_t>();
      });
    }
    std::vector<std::string> files;
    for (const auto& f : m["files"]) {
      const std::string fp = dir + "/" + f["name"].get<std::string>();
      auto size = fs->FileSize(fp);
      if (!size.ok()) return absl::NotFoundError(absl::StrCat("shard '", fp, "' is missing"));
      if (static_cast<int64_t>(*size) != f["bytes"].get<int64_t>()) {
        return absl::DataLossError(absl::StrCat("shard '", fp, "' has ", *size, " bytes, the manifest says ",
                                                f["bytes"].get<int64_t>(), " (truncated?)"));
      }
      files.push_back(fp);
    }
    // Read exactly the blocks that hold what this rank now owns.
    std::vector<char> buf;
    for (const Piece& np : layout.PiecesOfRank(rank)) {
      ShardedOptimizer::OwnedSlice slice = opt.owned_slice(np.bucket);
      float* arrays[3] = {slice.master, slice.state0, slice.state1};
      const int64_t want_begin = np.param_offset, want_end = np.param_offset + np.length;
      int64_t covered = 0;
      for (const nlohmann::json* op : by_param[np.param]) {
        const int64_t ob = (*op)["offset"].get<int64_t>(), ol = (*op)["length"].get<int64_t>();
        const int64_t lo = std::max(want_begin, ob), hi = std::min(want_end, ob + ol);
        if (lo >= hi) continue;
        covered += hi - lo;
        const std::string& file = files[(*op)["file"].get<size_t>()];
        for (size_t si = 0; si < want.size(); ++si) {
          const int64_t base = (*op)["begin"][si].get<int64_t>();
          const auto& crcs = (*op)["crc32c"][si];
          // Blocks of this piece/state that overlap [lo, hi).
          const int64_t first = (lo - ob) * 4 / block, last = ((hi - ob) * 4 - 1) / block;
          for (int64_t b = first; b <= last; ++b) {
            const int64_t bb = b * block, be = std::min(ol * 4, bb + block);
            // The part of this block inside [lo, hi), and where it goes.
            const int64_t cb = std::max(bb, (lo - ob) * 4), ce = std::min(be, (hi - ob) * 4);
            char* dst = reinterpret_cast<char*>(arrays[si] + np.rank_offset) +
                        (ob * 4 + cb - want_begin * 4);
            // Whole blocks are read straight into place; partial ones via a
            // buffer (their CRC covers the whole block).
            const bool whole = cb == bb && ce == be;
            char* into = dst;
            if (!whole) {
              buf.resize(static_cast<size_t>(be - bb));
              into = buf.data();
            }
            SHARDOPT_RETURN_IF_ERROR(fs->ReadAt(file, base + bb, static_cast<size_t>(be - bb), into));
            if (Crc32c(into, static_cast<size_t>(be - bb)) != crcs.at(b).get<uint32_t>()) {
              return absl::DataLossError(absl::StrCat("shard '", file, "' is corrupt: CRC32C mismatch in ",
                                                      want[si], " of parameter '",
                                                      layout.params()[np.param].name, "'"));
            }
            if (!whole) std::memcpy(dst, buf.data() + (cb - bb), static_cast<size_t>(ce - cb));
          }
        }
      }
      if (covered != np.length) {
        return absl::DataLossError(absl::StrCat("checkpoint '", dir, "' does not cover parameter '",
                                                layout.params()[np.param].name, "'"));
      }
    }
    return absl::OkStatus();
  };
  absl::Status mine = read_mine();
  SHARDOPT_RETURN_IF_ERROR(AgreeOnSuccess(comm, mine, "loading the checkpoint"));
  SHARDOPT_RETURN_IF_ERROR(staging.CopyBack());
  SHARDOPT_RETURN_IF_ERROR(opt.FinishRestore(m["step"].get<int64_t>()));
  return m;
}

absl::Status PruneCheckpoints(FileSystem* fs, const std::string& root, int keep) {
  if (keep < 1) return absl::InvalidArgumentError("keep at least one checkpoint");
  SHARDOPT_ASSIGN_OR_RETURN(std::string latest_dir, ResolveCheckpoint(fs, root));
  SHARDOPT_ASSIGN_OR_RETURN(std::vector<std::string> entries, fs->ListDir(root));
  const std::string latest = latest_dir.substr(latest_dir.rfind('/') + 1);
  const int64_t latest_step = std::atoll(latest.c_str() + 5);
  std::vector<std::pair<int64_t, std::string>> complete, unfinished;
  for (const std::string& e : entries) {
    if (e.rfind("step-", 0) != 0) continue;
    const int64_t step = std::atoll(e.c_str() + 5);
    if (fs->Exists(root + "/" + e + "/manifest.json")) {
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
    // The manifest first: a half-deleted checkpoint never looks complete.
    if (fs->Exists(dir + "/manifest.json")) SHARDOPT_RETURN_IF_ERROR(fs->Remove(dir + "/manifest.json"));
    SHARDOPT_ASSIGN_OR_RETURN(std::vector<std::string> files, fs->ListDir(dir));
    for (const std::string& f : files) SHARDOPT_RETURN_IF_ERROR(fs->Remove(dir + "/" + f));
    SHARDOPT_RETURN_IF_ERROR(fs->RemoveDir(dir));
  }
  return fs->SyncDir(root);
}

absl::Status Consolidate(FileSystem* fs, const std::string& dir, const std::string& out,
                         const std::function<void(int64_t, int64_t)>& progress) {
  SHARDOPT_RETURN_IF_ERROR(VerifyCheckpoint(fs, dir));
  SHARDOPT_ASSIGN_OR_RETURN(nlohmann::json m, ReadManifest(fs, dir));
  const auto states = m["states"].get<std::vector<std::string>>();
  const auto& params = m["params"];
  std::vector<std::vector<const nlohmann::json*>> by_param(params.size());
  for (const auto& p : m["pieces"]) by_param[p["param"].get<size_t>()].push_back(&p);
  for (auto& v : by_param) {
    std::sort(v.begin(), v.end(), [](const nlohmann::json* a, const nlohmann::json* b) {
      return (*a)["offset"].get<int64_t>() < (*b)["offset"].get<int64_t>();
    });
  }
  // Header: whole tensors in parameter order, then states.
  nlohmann::json header = nlohmann::json::object();
  int64_t offset = 0;
  std::vector<std::pair<size_t, size_t>> order;  // (param, state)
  for (size_t si = 0; si < states.size(); ++si) {
    for (size_t i = 0; i < params.size(); ++i) {
      if (!params[i]["trainable"].get<bool>()) continue;
      int64_t numel = 1;
      for (int64_t d : params[i]["shape"]) numel *= d;
      const std::string name = params[i]["name"].get<std::string>() +
                               (states[si] == "param" ? "" : "." + states[si]);
      header[name] = {{"dtype", "F32"}, {"shape", params[i]["shape"]},
                      {"data_offsets", {offset, offset + numel * 4}}};
      offset += numel * 4;
      order.push_back({i, si});
    }
  }
  header["__metadata__"] = {{"format", "shardopt-consolidated-v1"},
                            {"step", std::to_string(m["step"].get<int64_t>())},
                            {"optimizer", m["optimizer"].dump()}};
  std::string h = header.dump();
  while ((h.size() + 8) % 8 != 0) h.push_back(' ');
  const uint64_t hlen = h.size();
  SHARDOPT_ASSIGN_OR_RETURN(auto file, fs->NewWritableFile(out + ".tmp"));
  unsigned char len_le[8];
  for (int i = 0; i < 8; ++i) len_le[i] = static_cast<unsigned char>(hlen >> (8 * i));
  SHARDOPT_RETURN_IF_ERROR(file->Append(len_le, 8));
  SHARDOPT_RETURN_IF_ERROR(file->Append(h.data(), h.size()));
  std::vector<char> buf(kBlockBytes);
  int64_t done = 0;
  for (const auto& [i, si] : order) {
    for (const nlohmann::json* p : by_param[i]) {
      const std::string file_path = dir + "/" + m["files"][(*p)["file"].get<size_t>()]["name"].get<std::string>();
      const int64_t bytes = (*p)["length"].get<int64_t>() * 4;
      const int64_t base = (*p)["begin"][si].get<int64_t>();
      for (int64_t o = 0; o < bytes; o += kBlockBytes) {
        const size_t n = static_cast<size_t>(std::min(kBlockBytes, bytes - o));
        SHARDOPT_RETURN_IF_ERROR(fs->ReadAt(file_path, base + o, n, buf.data()));
        SHARDOPT_RETURN_IF_ERROR(file->Append(buf.data(), n));
        done += static_cast<int64_t>(n);
        if (progress) progress(done, offset);
      }
    }
  }
  SHARDOPT_RETURN_IF_ERROR(file->Sync());
  SHARDOPT_RETURN_IF_ERROR(file->Close());
  SHARDOPT_RETURN_IF_ERROR(fs->Rename(out + ".tmp", out));
  const size_t slash = out.rfind('/');
  return fs->SyncDir(slash == std::string::npos ? "." : out.substr(0, slash));
}

}  // namespace shardopt
