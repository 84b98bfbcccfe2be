#include "server/snapshot_service.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace shardopt {
namespace {

grpc::ServerUnaryReactor* Done(grpc::CallbackServerContext* ctx, const grpc::Status& s) {
  return FinishUnary(ctx, s);
}

}  // namespace

grpc::ServerUnaryReactor* SnapshotService::Read(grpc::CallbackServerContext* ctx,
                                                const v1::SnapshotReadRequest* req,
                                                v1::SnapshotReadResponse* resp) {
  if (auto s = CheckToken(ctx, token_); !s.ok()) return Done(ctx, s);
  if (req->path().empty() || req->path().size() > 4096) {
    return Done(ctx, grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "bad path"));
  }
  if (req->length() > kMaxSnapshotRead) {
    return Done(ctx, grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                  absl::StrCat("at most ", kMaxSnapshotRead, " bytes per read")));
  }
  const EntryKind kind = fs_->Kind(req->path());
  if (kind == EntryKind::kDirectory) {
    resp->set_is_directory(true);
    return Done(ctx, grpc::Status::OK);
  }
  auto size = fs_->FileSize(req->path());
  if (!size.ok()) return Done(ctx, ToGrpc(absl::NotFoundError(size.status().message())));
  resp->set_file_size(*size);
  if (req->length() > 0) {
    std::string* data = resp->mutable_data();
    data->resize(req->length());
    absl::Status s = fs_->ReadAt(req->path(), req->offset(), req->length(), data->data());
    if (!s.ok()) return Done(ctx, ToGrpc(s));
    served_ += static_cast<int64_t>(req->length());
  }
  return Done(ctx, grpc::Status::OK);
}

}  // namespace shardopt
