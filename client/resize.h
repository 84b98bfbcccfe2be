// Live resize of a running job (docs/elastic.md): the optimizer state moves
// from the ranks of one membership epoch to those of the next, directly
// between ranks and only where its owner changes, without the disk.
//
// At the step boundary the ranks agreed on (RankAgent's AgreedStep::resize):
//
//   old epoch, every rank    StateSnapshot::Take    (collective, old communicator)
//   new epoch, every rank    FindSnapshots, then LoadFromSnapshots
//                            (collective, new communicator and optimizer)
//   new rank 0               AnnounceHandOver
//   leaving ranks            AwaitHandOver, then exit
//
// Take saves the rank's owned state as a sharded checkpoint (the format of
// client/checkpoint/checkpoint.h) into memory and serves its files (service
// Snapshot, server/snapshot_service.h). LoadFromSnapshots is LoadCheckpoint
// reading those files by byte range: every rank of the new epoch reads
// exactly the ranges it now owns, its own old shard from its own memory and
// the rest from the rank that held it, each block checked against its
// CRC32C. So a live resize restores what a checkpoint saved at that step and
// resumed at the new size restores, bit for bit, by construction.
#ifndef SHARDOPT_CLIENT_RESIZE_H_
#define SHARDOPT_CLIENT_RESIZE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/checkpoint/checkpoint.h"
#include "client/coordinator_client.h"
#include "client/sharded_optimizer.h"
#include "common/layout.h"
#include "common/membership.h"
#include "common/memory_file_system.h"

namespace shardopt {

class RpcServer;
class SnapshotService;

// A resize every rank agreed to make at the end of a step.
struct ResizeOrder {
  int64_t request = 0;
  int64_t epoch = 0;  // the membership epoch moved to
  int from_world = 0;
  int to_world = 0;
  std::vector<int> leave;  // old ranks that leave (sorted)
  // Rank in the new epoch of `old_rank` (-1: it leaves).
  int NewRank(int old_rank) const { return RankAfterResize(old_rank, leave); }
};

// What the old epoch's rank 0 publishes besides the snapshots: the step, and
// the control requests already acted on (so that the new epoch's agents do
// not act on them again).
struct ResizeContext {
  int64_t step = 0;
  int from_world = 0;
  int64_t checkpoint_requests_done = 0;
  int64_t lr_versions_done = 0;
  int64_t resize_requests_done = 0;
};

// One rank's optimizer state in memory, served to the next epoch.
class StateSnapshot {
 public:
  // Collective over opt's communicator (every rank of the old epoch): saves
  // this rank's owned state at opt.step_count() into memory, serves it on
  // `host` (a port chosen by the OS; `token` required when non-empty) and
  // publishes its address in the coordinator's store; rank 0 publishes
  // `context` too.
  static absl::StatusOr<std::unique_ptr<StateSnapshot>> Take(
      ShardedOptimizer& opt, CoordinatorApi* client, const ResizeOrder& order,
      const ResizeContext& context, const std::string& host, const std::string& token);
  ~StateSnapshot();  // stops serving
  StateSnapshot(const StateSnapshot&) = delete;
  StateSnapshot& operator=(const StateSnapshot&) = delete;

  int old_rank() const { return old_rank_; }
  MemoryFileSystem* fs() { return &fs_; }
  int64_t bytes() const { return fs_.bytes(); }
  // Bytes of its files read by other ranks so far.
  int64_t bytes_served() const;
  std::string address() const;

 private:
  StateSnapshot() = default;
  int old_rank_ = 0;
  MemoryFileSystem fs_;
  std::unique_ptr<SnapshotService> service_;
  std::unique_ptr<RpcServer> server_;
};

// Where the old epoch's snapshots are.
struct SnapshotSource {
  int64_t epoch = 0;
  ResizeContext context;
  std::vector<std::string> addresses;  // per old rank
};
// Waits (up to `timeout`) for every old rank's snapshot to be published.
absl::StatusOr<SnapshotSource> FindSnapshots(CoordinatorApi* client, int64_t epoch,
                                             absl::Duration timeout);
// A rank started to grow the job to `to_world` ranks (epoch `epoch`): waits
// (up to `timeout`) for the ranks already there to reach the resize's step
// boundary and publish their snapshots, watching the job meanwhile.
// Cancelled when the job finished first (the resize came too late to
// happen: the rank is not needed); Aborted when the job failed.
absl::StatusOr<SnapshotSource> AwaitSnapshotsToJoin(CoordinatorApi* client, int64_t epoch,
                                                    int to_world, absl::Duration timeout);

struct SnapshotLoad {
  RestoredCheckpoint info;
  int64_t bytes_fetched = 0;  // read from other ranks' snapshots
  int64_t bytes_local = 0;    // read from this rank's own
};
// Collective over new_opt's communicator (every rank of the new epoch):
// restores the state of the snapshots' step as LoadCheckpoint restores a
// checkpoint, reading each range from the rank that holds it (`local`: this
// rank's own snapshot, null for a rank that joined).
absl::StatusOr<SnapshotLoad> LoadFromSnapshots(ShardedOptimizer& new_opt,
                                               const SnapshotSource& source,
                                               const std::string& token, StateSnapshot* local);

// Once the new epoch has loaded (new rank 0): the leaving ranks may go.
absl::Status AnnounceHandOver(CoordinatorApi* client, int64_t epoch);
// A leaving rank: waits for that, up to `timeout`.
absl::Status AwaitHandOver(CoordinatorApi* client, int64_t epoch, absl::Duration timeout);

// Bytes of optimizer state (`num_states` fp32 arrays per element: the
// parameter copy and each state, as a checkpoint saves them) whose owner changes from `from` to
// `to` when the old ranks `leave` go: the least that any resize must move between ranks.
int64_t BytesChangingOwner(const Layout& from, const Layout& to, const std::vector<int>& leave,
                           int num_states);

// In-memory replicas for recovering a lost rank (shardrun --replicate-shards,
// docs/elastic.md). Every K steps each rank saves its owned state in memory
// (the sharded-checkpoint format, as StateSnapshot) and copies its
// successor's, so that rank q's state at that step lives on rank q-1 too;
// it keeps the newest generation every rank completed, and the one being
// made. When a rank is lost (RankAgent::AwaitRecovery), the others agree on
// the newest generation all of them hold and load it at the smaller size
// (LoadFromReplicas): bit for bit a checkpoint of that step resumed there.
class ReplicaStore {
 public:
  // Serves the store (service Snapshot) on `host`, a port chosen by the OS.
  static absl::StatusOr<std::unique_ptr<ReplicaStore>> Start(const std::string& host,
                                                             const std::string& token);
  ~ReplicaStore();  // stops serving
  ReplicaStore(const ReplicaStore&) = delete;
  ReplicaStore& operator=(const ReplicaStore&) = delete;

  // Collective over opt's communicator (every rank of membership epoch
  // `epoch`): generation context.step (== opt.step_count()). Saves this
  // rank's owned state, copies its successor's, then drops the older
  // generations; the first time in an epoch it also publishes its address
  // and then ReplicaReadyKey(epoch, rank).
  absl::Status Refresh(ShardedOptimizer& opt, CoordinatorApi* client, int64_t epoch,
                       const ResizeContext& context, absl::Duration timeout);
  // Forgets every generation (a live resize changes the layout).
  void Clear();

  // Steps of the complete generations held (own state and the successor's).
  std::vector<int64_t> steps() const;
  int64_t bytes() const { return fs_.bytes(); }
  MemoryFileSystem* fs() { return &fs_; }
  std::string address() const;

  // Where the survivors of `order` (a recovery: order.leave is the lost
  // rank of epoch `old_epoch`) load from: the newest generation every one
  // of them holds, agreed through the coordinator's store (this rank was
  // `old_rank`). Its step is source.context.step.
  absl::StatusOr<SnapshotSource> AgreeOnRecovery(CoordinatorApi* client, const ResizeOrder& order,
                                                 int old_rank, int64_t old_epoch,
                                                 absl::Duration timeout);

 private:
  ReplicaStore() = default;
  MemoryFileSystem fs_;
  std::string token_;
  std::unique_ptr<SnapshotService> service_;
  std::unique_ptr<RpcServer> server_;
  int64_t epoch_ = -1;                         // the epoch of the generations held
  std::map<int64_t, ResizeContext> complete_;  // step -> its context
};

// Collective over new_opt's communicator (the survivors): restores
// generation source.context.step from the replicas, this rank's own and
// the lost rank's (if it held them) from `store`, the rest from the ranks
// that hold them. `old_rank`, `lost`: this rank's and the lost rank's
// numbers in the old epoch.
absl::StatusOr<SnapshotLoad> LoadFromReplicas(ShardedOptimizer& new_opt,
                                              const SnapshotSource& source,
                                              const std::string& token, ReplicaStore* store,
                                              int old_rank, int lost);

// The sum over every rank of `value` (collective over comm; fp32): the
// bytes a resize moved, summed by the ranks of the new epoch. The buffer
// outlives a timed-out wait (WaitSafely).
absl::StatusOr<double> SumOverRanks(Communicator* comm, double value, absl::Duration timeout);

// A rank that joins a running job touches host buffers of the sizes its
// optimizer will allocate for `total_elements` parameters at `world` ranks,
// and frees them (the host allocator keeps such mappings for reuse), before
// it says it is ready: the job, paused while the new epoch forms, then does
// not wait for the joiner's page faults.
void PrefaultStateBuffers(int64_t total_elements, int world);

}  // namespace shardopt

#endif  // SHARDOPT_CLIENT_RESIZE_H_
