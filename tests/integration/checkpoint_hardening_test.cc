// Hostile checkpoints: thousands of mutations of a real manifest and of a real
// consolidated safetensors header each end in a clear error naming the file,
// or (for edits that do not change what the data means) in exactly the data
// that was saved: never a crash, a hang, uninitialised output or a
// "successful" load of wrong data. Planted symlinks, FIFOs, huge sparse files
// and foreign directories are refused or left alone. Consolidated files resume
// like the sharded checkpoint they came from.
#include <ATen/Parallel.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <fstream>
#include <future>
#include <random>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "client/checkpoint/checkpoint.h"
#include "client/checkpoint/manifest.h"
#include "client/checkpoint/torch_interop.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/checkpoint_job.h"

namespace shardopt {
namespace {

using nlohmann::json;

std::string Slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void Spit(const std::string& path, const std::string& data) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << data;
}

// Runs `fn`, failing (and ending the test binary) if it takes longer than
// `seconds`: a hang is a failure, not a stuck CI job.
template <typename Fn>
auto WithinSeconds(double seconds, const char* what, Fn fn) {
  auto fut = std::async(std::launch::async, fn);
  if (fut.wait_for(std::chrono::duration<double>(seconds)) != std::future_status::ready) {
    ADD_FAILURE() << what << " did not return within " << seconds << " s";
    std::fflush(nullptr);
    std::_Exit(1);
  }
  return fut.get();
}

// JSON pointers of `j` and its descendants (at most the first two and the
// last element of each array, so that the count stays in the thousands).
void Pointers(const json& j, const std::string& at, std::vector<std::string>* out) {
  out->push_back(at);
  if (j.is_object()) {
    for (auto it = j.begin(); it != j.end(); ++it) Pointers(it.value(), at + "/" + it.key(), out);
  } else if (j.is_array()) {
    for (size_t i = 0; i < j.size(); ++i) {
      if (i < 2 || i + 1 == j.size()) Pointers(j[i], absl::StrCat(at, "/", i), out);
    }
  }
}

std::vector<json> Replacements() {
  return {json("6"),
          json(-5),
          json(-1),
          json(0),
          json(1),
          json(7),
          json(99),
          json(int64_t{1} << 62),
          json(1e300),
          json(0.5),
          json(nullptr),
          json(true),
          json::array(),
          json::object(),
          json("../shard-0-of-2.safetensors")};
}

// One saved 2-rank checkpoint plus what it must load back as.
class Fixture {
 public:
  Fixture() : root_(Fresh("hardening")), job_(2) {
    job_.Train(0, 3);
    for (const auto& s : job_.Save(root_, PosixFileSystem())) EXPECT_TRUE(s.ok()) << s.status();
    dir_ = root_ + "/step-3";
    manifest_ = Slurp(dir_ + "/manifest.json");
    for (int r = 0; r < 2; ++r) want_.push_back(job_.OwnedState(r));
    EXPECT_TRUE(Consolidate(PosixFileSystem(), dir_, root_ + "/whole.safetensors").ok());
    whole_ = Slurp(root_ + "/whole.safetensors");
  }
  const std::string& root() const { return root_; }
  const std::string& dir() const { return dir_; }
  const std::string& manifest() const { return manifest_; }
  const std::string& whole() const { return whole_; }
  Job& fresh() { return fresh_; }

  // Loads `path` into the fresh job (its state scribbled with NaN first):
  // either every rank fails, or every rank holds exactly the saved state.
  // Returns the first error ("" if it loaded).
  std::string LoadAndCheck(const std::string& path, const std::string& ctx) {
    for (int r = 0; r < 2; ++r) Scribble(r);
    const auto st = fresh_.Load(path);
    if (st[0].ok() != st[1].ok())
      ADD_FAILURE() << ctx << ": ranks disagree: " << st[0] << " / " << st[1];
    // The rank that found the problem says what it is; the other says that
    // another rank failed.
    for (const absl::Status& s : st) {
      if (!s.ok() && s.message().find("on another rank") == absl::string_view::npos)
        return std::string(s.message());
    }
    if (!st[0].ok()) return std::string(st[0].message());
    for (int r = 0; r < 2; ++r) {
      const std::vector<float> got = fresh_.OwnedState(r);
      if (std::memcmp(got.data(), want_[r].data(), got.size() * 4) != 0 ||
          got.size() != want_[r].size()) {
        ADD_FAILURE() << ctx << ": loaded OK but rank " << r << " holds other data than was saved";
      }
    }
    return "";
  }

 private:
  void Scribble(int r) {
    for (const Piece& p : fresh_.opts[r]->layout().PiecesOfRank(r)) {
      auto s = OptimizerStateAccess(*fresh_.opts[r]).owned_slice(p.bucket);
      for (float* a : {s.master, s.state0, s.state1}) {
        if (a != nullptr) std::fill(a + p.rank_offset, a + p.rank_offset + p.length, NAN);
      }
    }
  }

  std::string root_;
  Job job_;
  Job fresh_{2};
  std::string dir_, manifest_, whole_;
  std::vector<std::vector<float>> want_;
};

// The data bytes (after the header) of a safetensors file.
std::string DataOf(const std::string& file) {
  uint64_t hlen = 0;
  for (int i = 0; i < 8 && i < static_cast<int>(file.size()); ++i) {
    hlen |= static_cast<uint64_t>(static_cast<unsigned char>(file[i])) << (8 * i);
  }
  return hlen + 8 <= file.size() ? file.substr(8 + hlen) : std::string();
}

// Every structural mutation of the manifest, resealed so that it reaches the
// validation behind the CRC.
std::vector<std::pair<std::string, std::string>> ManifestMutations(const std::string& text) {
  std::vector<std::pair<std::string, std::string>> out;
  const json doc = json::parse(text);
  std::vector<std::string> ptrs;
  Pointers(doc, "", &ptrs);
  auto add = [&](const std::string& name, const json& j) {
    out.push_back({name, ResealManifestForTesting(j.dump(1))});
  };
  for (const std::string& p : ptrs) {
    if (p.empty() || p == "/manifest_crc32c") continue;
    for (const json& v : Replacements()) {
      json j = doc;
      j[json::json_pointer(p)] = v;
      add(absl::StrCat(p, " = ", v.dump()), j);
    }
    json j = doc;
    const json::json_pointer ptr(p);
    j[ptr.parent_pointer()].is_object()
        ? (void)j[ptr.parent_pointer()].erase(ptr.back())
        : (void)j[ptr.parent_pointer()].erase(std::stoul(ptr.back()));
    add(absl::StrCat("delete ", p), j);
  }
  const size_t pieces = doc["pieces"].size();
  for (size_t k = 0; k < pieces; ++k) {
    const std::string pk = absl::StrCat("pieces[", k, "]");
    json j = doc;
    j["pieces"].erase(k);
    add("remove " + pk, j);
    j = doc;
    j["pieces"].push_back(doc["pieces"][k]);
    add("duplicate " + pk, j);
    for (int64_t d : {-1, 1}) {
      j = doc;
      j["pieces"][k]["offset"] = doc["pieces"][k]["offset"].get<int64_t>() + d;
      add(absl::StrCat(pk, ".offset ", d), j);
      j = doc;
      j["pieces"][k]["length"] = doc["pieces"][k]["length"].get<int64_t>() + d;
      add(absl::StrCat(pk, ".length ", d), j);
      j = doc;
      j["pieces"][k]["begin"][0] = doc["pieces"][k]["begin"][0].get<int64_t>() + 4 * d;
      add(absl::StrCat(pk, ".begin ", 4 * d), j);
    }
    j = doc;
    j["pieces"][k]["length"] = int64_t{1} << 62;
    add(pk + ".length 2^62", j);
    j = doc;
    j["pieces"][k]["file"] = 1 - doc["pieces"][k]["file"].get<int>();
    add(pk + ".file swapped", j);
    j = doc;
    j["pieces"][k]["crc32c"][0].push_back(0);
    add(pk + ".crc32c extra block", j);
  }
  for (const char* name :
       {"../shard-0-of-2.safetensors", "/etc/passwd", "sub/shard-0-of-2.safetensors",
        "shard-1-of-2.safetensors", "manifest.json", ""}) {
    json j = doc;
    j["files"][0]["name"] = name;
    add(absl::StrCat("files[0].name = ", name), j);
  }
  for (int64_t b : {int64_t{-4}, int64_t{0}, int64_t{3}, int64_t{6}, int64_t{1} << 40}) {
    json j = doc;
    j["block_bytes"] = b;
    add(absl::StrCat("block_bytes = ", b), j);
  }
  json j = doc;
  std::swap(j["params"][0], j["params"][1]);
  add("params swapped", j);
  j = doc;
  std::swap(j["states"][1], j["states"][2]);
  add("states swapped", j);
  j = doc;
  j["files"][0]["bytes"] = doc["files"][0]["bytes"].get<int64_t>() + 1;
  add("files[0].bytes + 1", j);
  // Harmless edits: these must load the saved data exactly.
  j = doc;
  std::reverse(j["pieces"].begin(), j["pieces"].end());
  add("pieces reversed (harmless)", j);
  j = doc;
  j["user_metadata"]["note"] = "x";
  add("user_metadata edited (harmless)", j);
  return out;
}

TEST(ManifestFuzzTest, EveryMutationIsRefusedOrLoadsTheSavedData) {
  Fixture fx;
  auto cases = ManifestMutations(fx.manifest());
  // Unsealed edits and byte flips: the manifest's own CRC must catch them.
  std::mt19937 rng(12);
  for (int k = 0; k < 400; ++k) {
    std::string t = fx.manifest();
    const size_t at = rng() % t.size();
    t[at] = static_cast<char>(t[at] ^ (1 + rng() % 255));
    cases.push_back({absl::StrCat("byte ", at, " flipped"), t});
  }
  {
    json j = json::parse(fx.manifest());
    j["optimizer"]["lr"] = 0.5;
    cases.push_back({"lr edited without resealing", j.dump(1)});
  }
  ASSERT_GE(cases.size(), 2000u);
  const std::string path = fx.dir() + "/manifest.json";
  const std::string out = fx.root() + "/out.safetensors";
  int refused = 0, loaded = 0;
  auto names_dir = [&](const absl::Status& s, const std::string& what, const std::string& name) {
    EXPECT_NE(s.message().find(fx.dir()), absl::string_view::npos)
        << name << ": " << what << ": " << s;
  };
  for (const auto& [name, text] : cases) {
    Spit(path, text);
    // Every reader either refuses, naming the checkpoint, or yields exactly
    // the saved data.
    auto m = ReadManifest(PosixFileSystem(), fx.dir());
    if (!m.ok()) names_dir(m.status(), "ReadManifest", name);
    const absl::Status verified = VerifyCheckpoint(PosixFileSystem(), fx.dir());
    if (!verified.ok()) names_dir(verified, "VerifyCheckpoint", name);
    EXPECT_TRUE(m.ok() || !verified.ok()) << name;
    const absl::Status consolidated = Consolidate(PosixFileSystem(), fx.dir(), out);
    if (consolidated.ok()) {
      EXPECT_TRUE(DataOf(Slurp(out)) == DataOf(fx.whole()))
          << name << ": consolidated other data than was saved";
      std::remove(out.c_str());
    } else {
      names_dir(consolidated, "Consolidate", name);
      EXPECT_EQ(PosixFileSystem()->Kind(out), EntryKind::kMissing) << name;
    }
    EXPECT_EQ(PosixFileSystem()->Kind(out + ".tmp"), EntryKind::kMissing) << name;
    const absl::Status exported = ExportTorch(PosixFileSystem(), fx.dir(), fx.root() + "/out.pt");
    if (!exported.ok()) names_dir(exported, "ExportTorch", name);
    EXPECT_EQ(exported.ok(), verified.ok()) << name;
    const std::string err = fx.LoadAndCheck(fx.root(), name);
    if (!err.empty()) {
      names_dir(absl::DataLossError(err), "LoadCheckpoint", name);
      ++refused;
    } else {
      EXPECT_TRUE(m.ok()) << name << ": loaded although the manifest is refused";
      ++loaded;
    }
  }
  std::printf("manifest fuzz: %zu cases, %d refused, %d loaded the saved data (harmless edits)\n",
              cases.size(), refused, loaded);
  EXPECT_GE(loaded, 2);
  Spit(path, fx.manifest());
  EXPECT_EQ(fx.LoadAndCheck(fx.root(), "original"), "");
}

// Every structural mutation of the consolidated file's header.
std::vector<std::pair<std::string, std::string>> HeaderMutations(const std::string& file) {
  std::vector<std::pair<std::string, std::string>> out;
  uint64_t hlen = 0;
  for (int i = 0; i < 8; ++i)
    hlen |= static_cast<uint64_t>(static_cast<unsigned char>(file[i])) << (8 * i);
  const json header = json::parse(file.substr(8, hlen));
  const std::string data = file.substr(8 + hlen);
  auto encode = [&](const std::string& h, const std::string& d) {
    std::string o;
    for (int i = 0; i < 8; ++i)
      o.push_back(static_cast<char>(static_cast<uint64_t>(h.size()) >> (8 * i)));
    return o + h + d;
  };
  std::vector<std::string> ptrs;
  Pointers(header, "", &ptrs);
  for (const std::string& p : ptrs) {
    if (p.empty()) continue;
    for (const json& v : Replacements()) {
      json j = header;
      j[json::json_pointer(p)] = v;
      out.push_back({absl::StrCat(p, " = ", v.dump()), encode(j.dump(), data)});
    }
  }
  for (uint64_t bad : {uint64_t{0}, uint64_t{1}, hlen - 1, hlen + 1, uint64_t{file.size()} - 7,
                       uint64_t{file.size()}, uint64_t{1} << 62, ~uint64_t{0}}) {
    std::string f = file;
    for (int i = 0; i < 8; ++i) f[i] = static_cast<char>(bad >> (8 * i));
    out.push_back({absl::StrCat("header length ", bad), f});
  }
  for (size_t cut :
       {size_t{0}, size_t{4}, size_t{8}, size_t{8 + hlen / 2}, size_t{8 + hlen}, file.size() - 1}) {
    out.push_back({absl::StrCat("truncated to ", cut), file.substr(0, cut)});
  }
  out.push_back(
      {"deeply nested", encode(std::string(100000, '[') + std::string(100000, ']'), data)});
  out.push_back({"not JSON", encode("{\"a\": ", data)});
  out.push_back({"extra byte", file + "x"});
  return out;
}

TEST(SafetensorsFuzzTest, EveryHeaderMutationIsRefusedOrLoadsTheSavedData) {
  Fixture fx;
  const auto cases = HeaderMutations(fx.whole());
  ASSERT_GE(cases.size(), 300u);
  const std::string path = fx.root() + "/mutated.safetensors";
  int refused = 0, loaded = 0;
  for (const auto& [name, bytes] : cases) {
    Spit(path, bytes);
    auto h = ReadSafetensorsHeader(PosixFileSystem(), path);
    const std::string err = fx.LoadAndCheck(path, name);
    if (err.empty()) {
      ++loaded;
      EXPECT_TRUE(h.ok()) << name;
    } else {
      ++refused;
      EXPECT_NE(err.find(path), std::string::npos) << name << ": " << err;
    }
  }
  std::printf("safetensors fuzz: %zu cases, %d refused, %d loaded the saved data\n", cases.size(),
              refused, loaded);
  EXPECT_EQ(fx.LoadAndCheck(fx.root() + "/whole.safetensors", "original"), "");
}

TEST(CheckpointHardeningTest, FifosAndHugeSparseFilesNeverHangOrExhaustMemory) {
  Fixture fx;
  const std::string m = fx.dir() + "/manifest.json";
  // A 1 TiB sparse manifest.
  ASSERT_EQ(::unlink(m.c_str()), 0);
  {
    const int fd = ::open(m.c_str(), O_WRONLY | O_CREAT, 0644);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::ftruncate(fd, off_t{1} << 40), 0);
    ::close(fd);
  }
  auto big = WithinSeconds(10, "reading a 1 TiB manifest",
                           [&] { return ReadManifest(PosixFileSystem(), fx.dir()); });
  EXPECT_FALSE(big.ok());
  EXPECT_NE(big.status().message().find("manifest.json"), absl::string_view::npos) << big.status();
  // A FIFO as the manifest, and as LATEST.
  ASSERT_EQ(::unlink(m.c_str()), 0);
  ASSERT_EQ(::mkfifo(m.c_str(), 0644), 0);
  auto fifo = WithinSeconds(10, "reading a FIFO manifest",
                            [&] { return ReadManifest(PosixFileSystem(), fx.dir()); });
  EXPECT_FALSE(fifo.ok());
  EXPECT_NE(fifo.status().message().find("not a regular file"), absl::string_view::npos)
      << fifo.status();
  ASSERT_EQ(::unlink(m.c_str()), 0);
  Spit(m, fx.manifest());
  const std::string latest = fx.root() + "/LATEST";
  ASSERT_EQ(::unlink(latest.c_str()), 0);
  ASSERT_EQ(::mkfifo(latest.c_str(), 0644), 0);
  auto r = WithinSeconds(10, "resolving a FIFO LATEST",
                         [&] { return ResolveCheckpoint(PosixFileSystem(), fx.root()); });
  EXPECT_FALSE(r.ok());
  const std::string err = WithinSeconds(20, "loading with a FIFO LATEST",
                                        [&] { return fx.LoadAndCheck(fx.root(), "fifo"); });
  EXPECT_FALSE(err.empty());
  // A symlinked shard is refused, not followed.
  ASSERT_EQ(::unlink(latest.c_str()), 0);
  Spit(latest, "step-3\n");
  const std::string shard = fx.dir() + "/shard-0-of-2.safetensors";
  ASSERT_EQ(::rename(shard.c_str(), (fx.root() + "/elsewhere").c_str()), 0);
  ASSERT_EQ(::symlink((fx.root() + "/elsewhere").c_str(), shard.c_str()), 0);
  EXPECT_NE(fx.LoadAndCheck(fx.root(), "symlinked shard").find("symbolic link"), std::string::npos);
  ASSERT_EQ(::unlink(shard.c_str()), 0);
  ASSERT_EQ(::rename((fx.root() + "/elsewhere").c_str(), shard.c_str()), 0);
  EXPECT_EQ(fx.LoadAndCheck(fx.root(), "restored"), "");
}

TEST(CheckpointHardeningTest, SavesNeverWriteThroughPlantedSymlinks) {
  const std::string root = Fresh("planted");
  const std::string victim = root + "/victim.txt";
  Spit(victim, "precious");
  Job job(2);
  job.Train(0, 1);
  ASSERT_EQ(::mkdir((root + "/step-1").c_str(), 0755), 0);
  ASSERT_EQ(::symlink(victim.c_str(), (root + "/LATEST.tmp").c_str()), 0);
  ASSERT_EQ(::symlink(victim.c_str(), (root + "/step-1/shard-0-of-2.safetensors.tmp").c_str()), 0);
  ASSERT_EQ(::symlink(victim.c_str(), (root + "/step-1/manifest.json.tmp").c_str()), 0);
  for (const auto& s : job.Save(root, PosixFileSystem())) ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(Slurp(victim), "precious");
  EXPECT_EQ(PosixFileSystem()->Kind(root + "/LATEST"), EntryKind::kFile);
  EXPECT_TRUE(VerifyCheckpoint(PosixFileSystem(), root + "/step-1").ok());
  // A consolidation output planted as a symlink is replaced, not written through.
  ASSERT_EQ(::symlink(victim.c_str(), (root + "/whole.safetensors.tmp").c_str()), 0);
  ASSERT_TRUE(Consolidate(PosixFileSystem(), root + "/step-1", root + "/whole.safetensors").ok());
  EXPECT_EQ(Slurp(victim), "precious");
}

TEST(CheckpointHardeningTest, PruneOnlyRemovesCheckpointsItWrote) {
  const std::string root = Fresh("prune_hostile");
  Job job(2);
  for (int k = 1; k <= 4; ++k) {
    job.Train(k - 1, k);
    for (const auto& s : job.Save(root, PosixFileSystem())) ASSERT_TRUE(s.ok());
  }
  // Someone else's directory that merely starts with "step-", a symlink named
  // like an old checkpoint, and an old checkpoint with a user file in it.
  const std::string other = Fresh("prune_other");
  Spit(other + "/keep.txt", "mine");
  ASSERT_EQ(::mkdir((root + "/step-0-notes").c_str(), 0755), 0);
  Spit(root + "/step-0-notes/notes.txt", "notes");
  ASSERT_EQ(::symlink(other.c_str(), (root + "/step-0").c_str()), 0);
  Spit(root + "/step-1/my-notes.txt", "x");
  std::vector<std::string> skipped;
  ASSERT_TRUE(PruneCheckpoints(PosixFileSystem(), root, 1, &skipped).ok());
  EXPECT_EQ(Slurp(other + "/keep.txt"), "mine");
  EXPECT_EQ(Slurp(root + "/step-0-notes/notes.txt"), "notes");
  EXPECT_EQ(Slurp(root + "/step-1/my-notes.txt"), "x");
  EXPECT_EQ(PosixFileSystem()->Kind(root + "/step-0"), EntryKind::kSymlink);
  EXPECT_EQ(PosixFileSystem()->Kind(root + "/step-2"), EntryKind::kMissing);
  EXPECT_EQ(PosixFileSystem()->Kind(root + "/step-3"), EntryKind::kMissing);
  EXPECT_TRUE(VerifyCheckpoint(PosixFileSystem(), root + "/step-4").ok());
  EXPECT_EQ(skipped.size(), 2u);  // step-0 (a symlink) and step-1 (a foreign file)
}

TEST(CheckpointHardeningTest, FailedConsolidationLeavesNothing) {
  Fixture fx;
  FaultInjectingFileSystem full(PosixFileSystem());
  full.set_budget_bytes(1000);
  const std::string out = fx.root() + "/full.safetensors";
  const absl::Status s = Consolidate(&full, fx.dir(), out);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_EQ(PosixFileSystem()->Kind(out), EntryKind::kMissing);
  EXPECT_EQ(PosixFileSystem()->Kind(out + ".tmp"), EntryKind::kMissing);
}

// A save whose collective times out on one rank: that rank returns an error
// and frees its buffers, and nothing can write into them afterwards (the
// communicator is aborted first). Run under --config=asan, a write into
// freed memory would be reported.
TEST(CheckpointHardeningTest, TimedOutCollectiveNeverWritesIntoFreedMemory) {
  const std::string root = Fresh("timeout");
  InProcessWorld world(2, absl::Seconds(30));
  std::vector<std::unique_ptr<Communicator>> comms;
  std::vector<std::unique_ptr<TrainModel>> models;
  std::vector<std::unique_ptr<ShardedOptimizer>> opts(2);
  TrainConfig config;
  ShardedOptimizerOptions o = OptionsFor(config);
  o.timeout = absl::Milliseconds(300);
  for (int r = 0; r < 2; ++r) {
    comms.push_back(world.Connect(r));
    models.push_back(*MakeModel("small", 42));
  }
  std::vector<std::thread> t;
  for (int r = 0; r < 2; ++r) {
    t.emplace_back([&, r] {
      opts[r] =
          std::move(*ShardedOptimizer::Create(models[r]->NamedParameters(), o, comms[r].get()));
    });
  }
  for (auto& x : t) x.join();
  // Rank 0 saves alone: its agreement times out.
  auto alone = SaveCheckpoint(*opts[0], root);
  EXPECT_FALSE(alone.ok());
  EXPECT_EQ(alone.status().code(), absl::StatusCode::kDeadlineExceeded) << alone.status();
  // Rank 1 arrives late: its collectives must fail, not complete into rank
  // 0's freed buffers.
  auto late = SaveCheckpoint(*opts[1], root);
  EXPECT_FALSE(late.ok());
  EXPECT_EQ(PosixFileSystem()->Kind(root + "/LATEST"), EntryKind::kMissing);
}

// Resuming from the consolidated file equals resuming from the sharded
// checkpoint (bitwise at the same world size) and restores step and lr.
TEST(ConsolidatedResumeTest, ResumesLikeTheShardedCheckpointAtAnyWorldSize) {
  const std::string root = Fresh("consolidated_resume");
  Job first(2);
  first.Train(0, 3);
  first.opts[0]->SetLearningRate(0.02);
  first.opts[1]->SetLearningRate(0.02);
  for (const auto& s : first.Save(root, PosixFileSystem())) ASSERT_TRUE(s.ok());
  const std::string whole = root + "/whole.safetensors";
  ASSERT_TRUE(Consolidate(PosixFileSystem(), root + "/step-3", whole).ok());
  const std::string pt = root + "/adam.pt";
  ASSERT_TRUE(ExportTorch(PosixFileSystem(), root + "/step-3", pt).ok());
  for (int n : {1, 2, 3}) {
    Job sharded(n);
    for (const auto& s : sharded.Load(root)) ASSERT_TRUE(s.ok()) << s;
    sharded.Train(3, 5);
    for (const std::string& file : {whole, pt}) {
      Job from_file(n);
      std::vector<absl::StatusOr<RestoredCheckpoint>> st(n, absl::UnknownError(""));
      from_file.Parallel([&](int r) { st[r] = LoadAnyCheckpoint(*from_file.opts[r], file); });
      for (const auto& s : st)
        ASSERT_TRUE(s.ok()) << file << " at " << n << " ranks: " << s.status();
      EXPECT_EQ(st[0]->step, 3);
      EXPECT_EQ(from_file.opts[0]->step_count(), 3);
      EXPECT_DOUBLE_EQ(from_file.opts[0]->learning_rate(), 0.02) << "the saved lr is restored";
      from_file.Train(3, 5);
      EXPECT_EQ(from_file.Params(), sharded.Params()) << file << " at " << n << " ranks";
    }
  }
}

}  // namespace
}  // namespace shardopt

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  at::set_num_threads(1);
  return RUN_ALL_TESTS();
}
