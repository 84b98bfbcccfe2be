#include "client/resize.h"

#include <grpcpp/grpcpp.h>

#include <torch/torch.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <map>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "common/status_macros.h"
#include "proto/shardopt.grpc.pb.h"
#include "server/rpc_server.h"
#include "server/snapshot_service.h"

namespace shardopt {
namespace {

constexpr char kRoot[] = "/snapshot";

std::string Key(int64_t epoch, const std::string& what) {
  return absl::StrCat("resize/", epoch, "/", what);
}

// Reads the old epoch's snapshots as one file system: the shard file of old
// rank q from addresses[q]'s Snapshot service (from `local_fs` when q is in
// `local_ranks`: this rank's own, or a replica it holds), everything else
// (the manifest, LATEST, directories) from old rank 0's. Read-only.
class RemoteSnapshotFileSystem : public FileSystem {
 public:
  RemoteSnapshotFileSystem(std::vector<std::string> addresses, std::string token,
                           MemoryFileSystem* local_fs, std::vector<int> local_ranks)
      : addresses_(std::move(addresses)),
        token_(std::move(token)),
        local_fs_(local_fs),
        local_ranks_(std::move(local_ranks)) {}

  int64_t bytes_fetched() const { return fetched_; }
  int64_t bytes_local() const { return local_bytes_; }

  absl::Status ReadAt(const std::string& path, uint64_t offset, size_t n, void* out) override {
    const int q = OwnerOf(path);
    if (IsLocal(q)) {
      local_bytes_ += static_cast<int64_t>(n);
      return local_fs_->ReadAt(path, offset, n, out);
    }
    char* dst = static_cast<char*>(out);
    while (n > 0) {
      const size_t len = std::min<size_t>(n, kMaxSnapshotRead);
      SHARDOPT_ASSIGN_OR_RETURN(v1::SnapshotReadResponse r, Call(q, path, offset, len));
      if (r.data().size() != len) {
        return absl::DataLossError(absl::StrCat("rank ", q, "'s snapshot of '", path, "' answered ",
                                                r.data().size(), " bytes of ", len));
      }
      std::memcpy(dst, r.data().data(), len);
      fetched_ += static_cast<int64_t>(len);
      dst += len;
      offset += len;
      n -= len;
    }
    return absl::OkStatus();
  }
  absl::StatusOr<uint64_t> FileSize(const std::string& path) override {
    const int q = OwnerOf(path);
    if (IsLocal(q)) return local_fs_->FileSize(path);
    SHARDOPT_ASSIGN_OR_RETURN(v1::SnapshotReadResponse r, Call(q, path, 0, 0));
    if (r.is_directory()) return absl::FailedPreconditionError(path + " is a directory");
    return r.file_size();
  }
  EntryKind Kind(const std::string& path) override {
    const int q = OwnerOf(path);
    if (IsLocal(q)) return local_fs_->Kind(path);
    auto r = Call(q, path, 0, 0);
    if (!r.ok()) return EntryKind::kMissing;
    return r->is_directory() ? EntryKind::kDirectory : EntryKind::kFile;
  }
  bool Exists(const std::string& path) override { return Kind(path) != EntryKind::kMissing; }

  absl::StatusOr<std::unique_ptr<WritableFile>> NewWritableFile(const std::string&) override {
    return ReadOnly();
  }
  absl::Status Rename(const std::string&, const std::string&) override { return ReadOnly(); }
  absl::Status SyncDir(const std::string&) override { return ReadOnly(); }
  absl::Status MakeDirs(const std::string&) override { return ReadOnly(); }
  absl::StatusOr<std::vector<std::string>> ListDir(const std::string&) override {
    return ReadOnly();
  }
  absl::Status Remove(const std::string&) override { return ReadOnly(); }
  absl::Status RemoveDir(const std::string&) override { return ReadOnly(); }

 private:
  bool IsLocal(int q) const {
    return local_fs_ != nullptr &&
           std::find(local_ranks_.begin(), local_ranks_.end(), q) != local_ranks_.end();
  }
  static absl::Status ReadOnly() {
    return absl::UnimplementedError("the snapshots of a resize are read-only");
  }
  // The old rank whose snapshot holds `path`: q for ".../shard-q-of-N.safetensors", else 0.
  int OwnerOf(const std::string& path) const {
    const std::string base = path.substr(path.rfind('/') + 1);
    int q = 0;
    if (absl::StartsWith(base, "shard-")) {
      std::vector<std::string> parts = absl::StrSplit(base.substr(6), "-of-");
      if (parts.size() == 2 && absl::SimpleAtoi(parts[0], &q) && q >= 0 &&
          q < static_cast<int>(addresses_.size())) {
        return q;
      }
      return 0;
    }
    return 0;
  }
  v1::Snapshot::Stub* Stub(int q) {
    absl::MutexLock lock(&mu_);
    auto& s = stubs_[q];
    if (!s) {
      grpc::ChannelArguments args;
      args.SetMaxReceiveMessageSize(static_cast<int>(kMaxSnapshotRead) + (1 << 20));
      s = v1::Snapshot::NewStub(
          grpc::CreateCustomChannel(addresses_[q], grpc::InsecureChannelCredentials(), args));
    }
    return s.get();
  }
  absl::StatusOr<v1::SnapshotReadResponse> Call(int q, const std::string& path, uint64_t offset,
                                                uint64_t length) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    if (!token_.empty()) ctx.AddMetadata("authorization", "Bearer " + token_);
    v1::SnapshotReadRequest req;
    req.set_path(path);
    req.set_offset(offset);
    req.set_length(length);
    v1::SnapshotReadResponse resp;
    grpc::Status s = Stub(q)->Read(&ctx, req, &resp);
    if (!s.ok()) {
      return FromGrpc(s, absl::StrCat("reading rank ", q, "'s snapshot at ", addresses_[q]));
    }
    return resp;
  }

  const std::vector<std::string> addresses_;
  const std::string token_;
  MemoryFileSystem* const local_fs_;
  const std::vector<int> local_ranks_;
  int64_t fetched_ = 0;
  int64_t local_bytes_ = 0;
  absl::Mutex mu_;
  std::map<int, std::unique_ptr<v1::Snapshot::Stub>> stubs_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::StatusOr<std::unique_ptr<StateSnapshot>> StateSnapshot::Take(
    ShardedOptimizer& opt, CoordinatorApi* client, const ResizeOrder& order,
    const ResizeContext& context, const std::string& host, const std::string& token) {
  std::unique_ptr<StateSnapshot> snap(new StateSnapshot());
  snap->old_rank_ = opt.communicator()->rank();
  CheckpointOptions copt;
  copt.fs = &snap->fs_;
  // Each range a new owner reads is read in whole CRC blocks: small ones
  // keep that close to the bytes that change owner.
  copt.block_bytes = 64 << 10;
  auto saved = SaveCheckpoint(opt, kRoot, copt);
  if (!saved.ok()) {
    return absl::Status(saved.status().code(),
                        absl::StrCat("saving the state in memory: ", saved.status().message()));
  }
  snap->service_ = std::make_unique<SnapshotService>(&snap->fs_, token);
  RpcServerOptions sopt;
  sopt.address = host + ":0";
  sopt.reflection = false;
  auto server = RpcServer::Start(sopt, {snap->service_.get()});
  if (!server.ok()) return server.status();
  snap->server_ = *std::move(server);
  if (snap->old_rank_ == 0) {
    SHARDOPT_RETURN_IF_ERROR(client->KvSet(
        Key(order.epoch, "context"),
        absl::StrCat(context.step, " ", context.from_world, " ", context.checkpoint_requests_done,
                     " ", context.lr_versions_done, " ", context.resize_requests_done)));
  }
  SHARDOPT_RETURN_IF_ERROR(
      client->KvSet(Key(order.epoch, absl::StrCat("snapshot/", snap->old_rank_)), snap->address()));
  return snap;
}

StateSnapshot::~StateSnapshot() {
  if (server_) server_->Shutdown(absl::Seconds(1));
}

int64_t StateSnapshot::bytes_served() const { return service_ ? service_->bytes_served() : 0; }

std::string StateSnapshot::address() const { return server_->address(); }

absl::StatusOr<SnapshotSource> FindSnapshots(CoordinatorApi* client, int64_t epoch,
                                             absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  SnapshotSource src;
  src.epoch = epoch;
  SHARDOPT_ASSIGN_OR_RETURN(std::string ctx, client->KvGet(Key(epoch, "context"), timeout));
  std::vector<std::string> f = absl::StrSplit(ctx, ' ');
  ResizeContext& c = src.context;
  if (f.size() != 5 || !absl::SimpleAtoi(f[0], &c.step) || !absl::SimpleAtoi(f[1], &c.from_world) ||
      !absl::SimpleAtoi(f[2], &c.checkpoint_requests_done) ||
      !absl::SimpleAtoi(f[3], &c.lr_versions_done) ||
      !absl::SimpleAtoi(f[4], &c.resize_requests_done) || c.from_world < 1 || c.step < 0) {
    return absl::DataLossError(absl::StrCat("malformed resize context '", ctx, "'"));
  }
  for (int q = 0; q < c.from_world; ++q) {
    SHARDOPT_ASSIGN_OR_RETURN(std::string a,
                              client->KvGet(Key(epoch, absl::StrCat("snapshot/", q)),
                                            std::max(absl::Seconds(1), deadline - absl::Now())));
    src.addresses.push_back(std::move(a));
  }
  return src;
}

absl::StatusOr<SnapshotSource> AwaitSnapshotsToJoin(CoordinatorApi* client, int64_t epoch,
                                                    int to_world, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    const absl::Duration slice = std::min(absl::Seconds(2), deadline - absl::Now());
    auto source = FindSnapshots(client, epoch, std::max(slice, absl::Milliseconds(1)));
    if (source.ok() || !absl::IsDeadlineExceeded(source.status())) return source;
    auto job = client->GetJob();
    if (job.ok() && job->state() == "finished") {
      return absl::CancelledError(absl::StrCat("the job finished before it could grow to ",
                                               to_world, " ranks; not needed"));
    }
    if (job.ok() && job->state() == "failed") {
      return absl::AbortedError(absl::StrCat("the job failed: ", job->failure()));
    }
    if (absl::Now() >= deadline) return source.status();
  }
}

absl::StatusOr<SnapshotLoad> LoadFromSnapshots(ShardedOptimizer& new_opt,
                                               const SnapshotSource& source,
                                               const std::string& token, StateSnapshot* local) {
  RemoteSnapshotFileSystem fs(source.addresses, token, local ? local->fs() : nullptr,
                              local ? std::vector<int>{local->old_rank()} : std::vector<int>{});
  SnapshotLoad out;
  auto info = LoadCheckpoint(new_opt, absl::StrCat(kRoot, "/step-", source.context.step), &fs,
                             /*whole_files=*/false);
  if (!info.ok()) return info.status();
  out.info = *std::move(info);
  out.bytes_fetched = fs.bytes_fetched();
  out.bytes_local = fs.bytes_local();
  return out;
}

namespace {

std::string ReplicaKey(int64_t epoch, const std::string& what) {
  return absl::StrCat("replica/", epoch, "/", what);
}

std::string StepDir(int64_t step) { return absl::StrCat(kRoot, "/step-", step); }

// Removes `dir` and the files in it.
absl::Status RemoveTree(FileSystem* fs, const std::string& dir) {
  auto names = fs->ListDir(dir);
  if (!names.ok()) return names.status();
  for (const std::string& n : *names) SHARDOPT_RETURN_IF_ERROR(fs->Remove(dir + "/" + n));
  return fs->RemoveDir(dir);
}

// Copies `path` from `from` into `to` (whole, in reads of at most 4 MiB).
absl::Status CopyFile(FileSystem* from, FileSystem* to, const std::string& path) {
  SHARDOPT_ASSIGN_OR_RETURN(uint64_t size, from->FileSize(path));
  SHARDOPT_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> out, to->NewWritableFile(path));
  std::vector<char> buf(std::min<uint64_t>(size, 4 << 20));
  for (uint64_t off = 0; off < size;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(buf.size(), size - off));
    SHARDOPT_RETURN_IF_ERROR(from->ReadAt(path, off, n, buf.data()));
    SHARDOPT_RETURN_IF_ERROR(out->Append(buf.data(), n));
    off += n;
  }
  return out->Close();
}

std::string ShardFile(int64_t step, int rank, int world) {
  return absl::StrCat(StepDir(step), "/shard-", rank, "-of-", world, ".safetensors");
}

}  // namespace

absl::StatusOr<std::unique_ptr<ReplicaStore>> ReplicaStore::Start(const std::string& host,
                                                                  const std::string& token) {
  std::unique_ptr<ReplicaStore> s(new ReplicaStore());
  s->token_ = token;
  s->service_ = std::make_unique<SnapshotService>(&s->fs_, token);
  RpcServerOptions sopt;
  sopt.address = host + ":0";
  sopt.reflection = false;
  auto server = RpcServer::Start(sopt, {s->service_.get()});
  if (!server.ok()) return server.status();
  s->server_ = *std::move(server);
  return s;
}

ReplicaStore::~ReplicaStore() {
  if (server_) server_->Shutdown(absl::Seconds(1));
}

std::string ReplicaStore::address() const { return server_->address(); }

std::vector<int64_t> ReplicaStore::steps() const {
  std::vector<int64_t> out;
  for (const auto& [step, context] : complete_) out.push_back(step);
  return out;
}

void ReplicaStore::Clear() {
  if (fs_.Kind(kRoot) == EntryKind::kDirectory) {
    auto names = fs_.ListDir(kRoot);
    if (names.ok()) {
      for (const std::string& n : *names) {
        const std::string path = absl::StrCat(kRoot, "/", n);
        if (fs_.Kind(path) == EntryKind::kDirectory) {
          (void)RemoveTree(&fs_, path);
        } else {
          (void)fs_.Remove(path);
        }
      }
    }
  }
  complete_.clear();
  epoch_ = -1;
}

absl::Status ReplicaStore::Refresh(ShardedOptimizer& opt, CoordinatorApi* client, int64_t epoch,
                                   const ResizeContext& context, absl::Duration timeout) {
  Communicator* comm = opt.communicator();
  const int rank = comm->rank(), world = comm->world_size();
  const bool first = epoch != epoch_;
  if (first) {
    Clear();
    epoch_ = epoch;
    SHARDOPT_RETURN_IF_ERROR(
        client->KvSet(ReplicaKey(epoch, absl::StrCat("addr/", rank)), address()));
  }
  const int64_t step = context.step;
  if (complete_.count(step) != 0) return absl::OkStatus();
  if (fs_.Kind(StepDir(step)) == EntryKind::kDirectory) {
    SHARDOPT_RETURN_IF_ERROR(RemoveTree(&fs_, StepDir(step)));  // an incomplete try
  }
  CheckpointOptions copt;
  copt.fs = &fs_;
  copt.block_bytes = 64 << 10;  // (a recovery reads whole CRC blocks)
  auto saved = SaveCheckpoint(opt, kRoot, copt);
  if (!saved.ok()) return saved.status();
  // Every rank's save is complete: copy the successor's files.
  SHARDOPT_RETURN_IF_ERROR(SumOverRanks(comm, 0, timeout).status());
  const int succ = (rank + 1) % world;
  SHARDOPT_ASSIGN_OR_RETURN(std::string succ_address,
                            client->KvGet(ReplicaKey(epoch, absl::StrCat("addr/", succ)), timeout));
  RemoteSnapshotFileSystem remote(std::vector<std::string>(world, succ_address), token_, nullptr,
                                  {});
  SHARDOPT_RETURN_IF_ERROR(CopyFile(&remote, &fs_, ShardFile(step, succ, world)));
  if (succ == 0) {
    SHARDOPT_RETURN_IF_ERROR(CopyFile(&remote, &fs_, StepDir(step) + "/manifest.json"));
  }
  complete_[step] = context;
  // Every rank holds generation `step` complete: the older ones may go.
  SHARDOPT_RETURN_IF_ERROR(SumOverRanks(comm, 0, timeout).status());
  for (auto it = complete_.begin(); it != complete_.end();) {
    if (it->first == step) {
      ++it;
      continue;
    }
    SHARDOPT_RETURN_IF_ERROR(RemoveTree(&fs_, StepDir(it->first)));
    it = complete_.erase(it);
  }
  if (first) SHARDOPT_RETURN_IF_ERROR(client->KvSet(ReplicaReadyKey(epoch, rank), "1"));
  return absl::OkStatus();
}

absl::StatusOr<SnapshotSource> ReplicaStore::AgreeOnRecovery(CoordinatorApi* client,
                                                             const ResizeOrder& order, int old_rank,
                                                             int64_t old_epoch,
                                                             absl::Duration timeout) {
  if (order.leave.size() != 1) return absl::InvalidArgumentError("a recovery drops one rank");
  const int lost = order.leave[0];
  const absl::Time deadline = absl::Now() + timeout;
  auto left = [&deadline] { return std::max(absl::Seconds(1), deadline - absl::Now()); };
  std::vector<std::string> held;
  for (int64_t s : steps()) held.push_back(std::to_string(s));
  SHARDOPT_RETURN_IF_ERROR(client->KvSet(ReplicaKey(order.epoch, absl::StrCat("held/", old_rank)),
                                         absl::StrJoin(held, " ")));
  // The newest generation every survivor holds.
  std::map<int64_t, int> count;
  for (int q = 0; q < order.from_world; ++q) {
    if (q == lost) continue;
    SHARDOPT_ASSIGN_OR_RETURN(
        std::string v, client->KvGet(ReplicaKey(order.epoch, absl::StrCat("held/", q)), left()));
    for (absl::string_view s : absl::StrSplit(v, ' ', absl::SkipEmpty())) {
      int64_t step = 0;
      if (absl::SimpleAtoi(s, &step)) ++count[step];
    }
  }
  int64_t step = -1;
  for (const auto& [s, n] : count) {
    if (n == order.from_world - 1) step = s;
  }
  if (step < 0 || complete_.count(step) == 0) {
    return absl::FailedPreconditionError(
        "no generation of replicas is held by every remaining rank");
  }
  SnapshotSource src;
  src.epoch = order.epoch;
  src.context = complete_[step];
  for (int q = 0; q < order.from_world; ++q) {
    const int holder = q == lost ? ReplicaHolder(lost, order.from_world) : q;
    SHARDOPT_ASSIGN_OR_RETURN(
        std::string a, client->KvGet(ReplicaKey(old_epoch, absl::StrCat("addr/", holder)), left()));
    src.addresses.push_back(std::move(a));
  }
  return src;
}

absl::StatusOr<SnapshotLoad> LoadFromReplicas(ShardedOptimizer& new_opt,
                                              const SnapshotSource& source,
                                              const std::string& token, ReplicaStore* store,
                                              int old_rank, int lost) {
  std::vector<int> local = {old_rank};
  if (ReplicaHolder(lost, source.context.from_world) == old_rank) local.push_back(lost);
  RemoteSnapshotFileSystem fs(source.addresses, token, store->fs(), local);
  SnapshotLoad out;
  auto info = LoadCheckpoint(new_opt, StepDir(source.context.step), &fs, /*whole_files=*/false);
  if (!info.ok()) return info.status();
  out.info = *std::move(info);
  out.bytes_fetched = fs.bytes_fetched();
  out.bytes_local = fs.bytes_local();
  return out;
}

absl::Status AnnounceHandOver(CoordinatorApi* client, int64_t epoch) {
  return client->KvSet(Key(epoch, "loaded"), "1");
}

absl::Status AwaitHandOver(CoordinatorApi* client, int64_t epoch, absl::Duration timeout) {
  return client->KvGet(Key(epoch, "loaded"), timeout).status();
}

int64_t BytesChangingOwner(const Layout& from, const Layout& to, const std::vector<int>& leave,
                           int num_states) {
  // Per parameter: the element runs of each old owner, by its new rank.
  std::vector<std::vector<Piece>> old_runs(from.params().size());
  for (const Piece& p : from.AllPieces()) old_runs[p.param].push_back(p);
  int64_t elements = 0;
  for (const Piece& np : to.AllPieces()) {
    const int64_t lo = np.param_offset, hi = np.param_offset + np.length;
    for (const Piece& op : old_runs[np.param]) {
      const int64_t a = std::max(lo, op.param_offset),
                    b = std::min(hi, op.param_offset + op.length);
      if (a < b && RankAfterResize(op.rank, leave) != np.rank) elements += b - a;
    }
  }
  return elements * 4 * num_states;
}

absl::StatusOr<double> SumOverRanks(Communicator* comm, double value, absl::Duration timeout) {
  auto buf = std::make_shared<std::array<float, 1>>();
  (*buf)[0] = static_cast<float>(value);
  absl::Status s = WaitSafely(
      comm, comm->AllReduce(buf->data(), 1, DType::kFloat32, ReduceOp::kSum), timeout, buf);
  if (!s.ok()) return s;
  return (*buf)[0];
}

void PrefaultStateBuffers(int64_t total_elements, int world) {
  // (The flat buffers add a little padding: the allocator reuses within 2x.)
  const int64_t owned = (total_elements + world - 1) / std::max(world, 1);
  std::vector<torch::Tensor> touched;
  for (int64_t n : {total_elements, total_elements, owned, owned, owned}) {
    touched.push_back(torch::zeros({std::max<int64_t>(n, 1)}, torch::kFloat32));
  }
}

}  // namespace shardopt
