// The gRPC face of a rank's in-memory snapshot during a live resize (service
// Snapshot in proto/shardopt.proto; client/resize.h): the files of the sharded
// checkpoint it saved into a MemoryFileSystem, read by byte range (at most
// kMaxSnapshotRead bytes per call) by the ranks of the job's next epoch.
// Read-only; requires the job's bearer token when given one.
#ifndef SHARDOPT_SERVER_SNAPSHOT_SERVICE_H_
#define SHARDOPT_SERVER_SNAPSHOT_SERVICE_H_

#include <atomic>
#include <cstdint>
#include <string>

#include "common/memory_file_system.h"
#include "proto/shardopt.grpc.pb.h"
#include "server/rpc_server.h"

namespace shardopt {

inline constexpr uint64_t kMaxSnapshotRead = 2 << 20;

class SnapshotService final : public v1::Snapshot::CallbackService, public ManagedService {
 public:
  // `fs` must outlive the service.
  SnapshotService(MemoryFileSystem* fs, std::string token) : fs_(fs), token_(std::move(token)) {}
  bool RequiresToken() const override { return !token_.empty(); }
  grpc::ServerUnaryReactor* Read(grpc::CallbackServerContext* ctx,
                                 const v1::SnapshotReadRequest* req,
                                 v1::SnapshotReadResponse* resp) override;
  // Bytes of file data served so far.
  int64_t bytes_served() const { return served_.load(); }

 private:
  MemoryFileSystem* const fs_;
  const std::string token_;
  std::atomic<int64_t> served_{0};
};

}  // namespace shardopt

#endif  // SHARDOPT_SERVER_SNAPSHOT_SERVICE_H_
