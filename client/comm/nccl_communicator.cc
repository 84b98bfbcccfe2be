#include "client/comm/nccl_communicator.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace shardopt {

struct NcclCommunicator::State {
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  void* scratch = nullptr;  // one float for Barrier
  absl::Mutex mu;
  struct Pending {
    cudaEvent_t done;
    CommHandlePtr handle;
    absl::Time deadline;
    // Host buffers are staged: copied into `pinned`, moved through device
    // memory, and copied back to `host` when the collective is done.
    void* host = nullptr;
    void* pinned = nullptr;
    size_t bytes = 0;
  };
  std::deque<Pending> pending ABSL_GUARDED_BY(mu);
  // Pinned staging buffers for reuse: {pointer, capacity}.
  std::vector<std::pair<void*, size_t>> pinned_free ABSL_GUARDED_BY(mu);
  bool stopping ABSL_GUARDED_BY(mu) = false;
  absl::Status aborted ABSL_GUARDED_BY(mu);
  std::array<std::atomic<int64_t>, kNumCollectiveKinds> sent{};

  // Stages the `bytes` of host memory at `buffer` for a collective on
  // `stream`: *pinned gets a pinned buffer (a free one reused, else a new
  // one) holding a copy of them, *dev device memory the copy is on its way
  // to. Returns the first CUDA error.
  cudaError_t Stage(void* buffer, size_t bytes, cudaStream_t stream, void** pinned, void** dev)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
};

namespace {

ncclDataType_t NcclType(DType t) {
  switch (t) {
    case DType::kFloat32: return ncclFloat32;
    case DType::kBFloat16: return ncclBfloat16;
    case DType::kFloat16: return ncclFloat16;
    case DType::kByte: return ncclUint8;
  }
  return ncclUint8;
}

ncclRedOp_t NcclOp(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kAverage: return ncclAvg;
    case ReduceOp::kMax: return ncclMax;
  }
  return ncclSum;
}

absl::Status CudaError(cudaError_t e, const char* what) {
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
}

absl::Status NcclError(ncclResult_t r, const char* what) {
  return absl::UnavailableError(absl::StrCat(what, ": ", ncclGetErrorString(r)));
}

// A non-blocking communicator may return ncclInProgress from any call; the
// call has then not finished (for a collective: not yet enqueued) until the
// asynchronous state leaves ncclInProgress.
ncclResult_t Settle(ncclComm_t comm, ncclResult_t r, absl::Time deadline) {
  while (r == ncclInProgress) {
    if (absl::Now() > deadline) return ncclInProgress;
    absl::SleepFor(absl::Microseconds(20));
    if (ncclCommGetAsyncError(comm, &r) != ncclSuccess) return ncclInternalError;
  }
  return r;
}

CommHandlePtr Done(absl::Status s) {
  auto h = std::make_shared<CommHandle>();
  h->Complete(std::move(s));
  return h;
}

// The verdict of a collective's event query `q`: true when the collective is
// done, with its error (if any) in *status; false while it is not ready.
bool EventFinished(cudaError_t q, absl::Status* status) {
  if (q == cudaSuccess) return true;
  if (q != cudaErrorNotReady) {
    *status = CudaError(q, "collective");
    return true;
  }
  return false;
}

}  // namespace

cudaError_t NcclCommunicator::State::Stage(void* buffer, size_t bytes, cudaStream_t stream,
                                           void** pinned, void** dev) {
  for (size_t i = 0; i < pinned_free.size(); ++i) {
    if (pinned_free[i].second >= bytes) {
      *pinned = pinned_free[i].first;
      pinned_free.erase(pinned_free.begin() + static_cast<long>(i));
      break;
    }
  }
  cudaError_t e = *pinned != nullptr ? cudaSuccess : cudaMallocHost(pinned, bytes);
  if (e == cudaSuccess) e = cudaMallocAsync(dev, bytes, stream);
  if (e == cudaSuccess) {
    std::memcpy(*pinned, buffer, bytes);
    e = cudaMemcpyAsync(*dev, *pinned, bytes, cudaMemcpyHostToDevice, stream);
  }
  return e;
}

NcclCommunicator::NcclCommunicator(int rank, int world, const NcclOptions& options)
    : rank_(rank), world_(world), options_(options), state_(std::make_unique<State>()) {}

absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Create(
    KeyValueStore* store, int rank, int world_size, const NcclOptions& options) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " / world size ", world_size, " out of range"));
  }
  if (cudaError_t e = cudaSetDevice(options.device); e != cudaSuccess)
    return CudaError(e, "cudaSetDevice");
  // The unique id: made by rank 0, shared through the store.
  ncclUniqueId id;
  const std::string key = options.store_prefix + "/unique_id";
  if (rank == 0) {
    if (ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess)
      return NcclError(r, "ncclGetUniqueId");
    if (absl::Status s = store->Set(key, std::string(reinterpret_cast<char*>(&id), sizeof(id)));
        !s.ok())
      return s;
  } else {
    auto v = store->Get(key, options.timeout);
    if (!v.ok()) return v.status();
    if (v->size() != sizeof(id)) return absl::DataLossError("NCCL unique id of the wrong size");
    std::memcpy(&id, v->data(), sizeof(id));
  }
  std::unique_ptr<NcclCommunicator> c(new NcclCommunicator(rank, world_size, options));
  if (cudaError_t e = cudaStreamCreateWithFlags(&c->state_->stream, cudaStreamNonBlocking);
      e != cudaSuccess) {
    return CudaError(e, "cudaStreamCreate");
  }
  if (cudaError_t e = cudaMalloc(&c->state_->scratch, sizeof(float)); e != cudaSuccess) {
    return CudaError(e, "cudaMalloc");
  }
  // Non-blocking initialisation, so that a missing peer cannot hang us past the timeout.
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclResult_t r = ncclCommInitRankConfig(&c->state_->comm, world_size, id, rank, &config);
  const absl::Time deadline = absl::Now() + options.timeout;
  while (r == ncclInProgress || r == ncclSuccess) {
    ncclResult_t async = ncclSuccess;
    ncclCommGetAsyncError(c->state_->comm, &async);
    if (async == ncclSuccess) break;
    if (async != ncclInProgress) {
      r = async;
      break;
    }
    if (absl::Now() > deadline) {
      ncclCommAbort(c->state_->comm);
      c->state_->comm = nullptr;
      return absl::DeadlineExceededError(
          absl::StrCat("NCCL initialisation of rank ", rank, " timed out"));
    }
    absl::SleepFor(absl::Milliseconds(1));
  }
  if (r != ncclSuccess && r != ncclInProgress) return NcclError(r, "ncclCommInitRankConfig");
  c->watcher_ = std::thread([p = c.get()] { p->Watch(); });
  return c;
}

NcclCommunicator::~NcclCommunicator() {
  {
    absl::MutexLock l(&state_->mu);
    state_->stopping = true;
  }
  if (watcher_.joinable()) watcher_.join();
  if (state_->comm != nullptr) ncclCommDestroy(state_->comm);
  if (state_->scratch != nullptr) cudaFree(state_->scratch);
  {
    absl::MutexLock l(&state_->mu);
    for (auto& [p, n] : state_->pinned_free) cudaFreeHost(p);
  }
  if (state_->stream != nullptr) cudaStreamDestroy(state_->stream);
}

bool NcclCommunicator::IsHostMemory(const void* p) {
  cudaPointerAttributes a;
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();
    return true;
  }
  return a.type == cudaMemoryTypeUnregistered || a.type == cudaMemoryTypeHost;
}

template <typename Enqueue>
CommHandlePtr NcclCommunicator::Submit(CollectiveKind kind, int64_t sent, void* buffer,
                                       size_t bytes, Enqueue enqueue) {
  absl::Status failed;
  auto handle = std::make_shared<CommHandle>();
  // NCCL moves device memory only; small host buffers (control values, the
  // model check, checkpoint agreement) are staged through device memory.
  const bool staged = buffer != nullptr && bytes > 0 && IsHostMemory(buffer);
  {
    // Held across the enqueue so that Abort() cannot free the communicator
    // under it.
    absl::MutexLock l(&state_->mu);
    if (!state_->aborted.ok()) return Done(state_->aborted);
    cudaStream_t stream = state_->stream;
    // Order after the work already queued on the compute stream.
    cudaEvent_t ready, done;
    cudaEventCreateWithFlags(&ready, cudaEventDisableTiming);
    cudaEventCreateWithFlags(&done, cudaEventDisableTiming);
    cudaEventRecord(ready, static_cast<cudaStream_t>(options_.compute_stream));
    cudaStreamWaitEvent(stream, ready, 0);
    cudaEventDestroy(ready);
    void* pinned = nullptr;
    void* dev = buffer;
    if (staged) {
      if (cudaError_t e = state_->Stage(buffer, bytes, stream, &pinned, &dev); e != cudaSuccess) {
        cudaEventDestroy(done);
        return Done(CudaError(e, "staging a host buffer"));
      }
    }
    const ncclResult_t r =
        Settle(state_->comm, enqueue(dev, stream), absl::Now() + options_.timeout);
    if (r != ncclSuccess) {
      cudaEventDestroy(done);
      failed = r == ncclInProgress ? absl::DeadlineExceededError(absl::StrCat(
                                         CollectiveKindName(kind), ": NCCL did not enqueue within ",
                                         absl::FormatDuration(options_.timeout)))
                                   : NcclError(r, CollectiveKindName(kind));
    } else {
      if (staged) {
        cudaMemcpyAsync(pinned, dev, bytes, cudaMemcpyDeviceToHost, stream);
        cudaFreeAsync(dev, stream);
      }
      cudaEventRecord(done, stream);
      state_->sent[static_cast<int>(kind)] += sent;
      state_->pending.push_back({done, handle, absl::Now() + options_.timeout,
                                 staged ? buffer : nullptr, pinned, staged ? bytes : 0});
    }
  }
  if (!failed.ok()) {
    Abort(failed);
    return Done(failed);
  }
  return handle;
}

void NcclCommunicator::Watch() {
  while (true) {
    State::Pending front;
    {
      absl::MutexLock l(&state_->mu);
      if (state_->pending.empty()) {
        if (state_->stopping) return;
      } else {
        front = state_->pending.front();
      }
    }
    if (!front.handle) {
      absl::SleepFor(absl::Microseconds(200));
      continue;
    }
    cudaError_t q;
    {
      // Under the lock: Abort() takes the pending list under it and then
      // destroys the events, so the one queried here is still alive.
      absl::MutexLock l(&state_->mu);
      if (state_->pending.empty() || state_->pending.front().handle != front.handle) continue;
      q = cudaEventQuery(front.done);
    }
    absl::Status status;
    // Not ready: NCCL's asynchronous error or the deadline ends it.
    const bool finished = EventFinished(q, &status) || PendingFailed(front.deadline, &status);
    if (!finished) {
      absl::SleepFor(absl::Microseconds(50));
      continue;
    }
    bool mine = false;  // false: an Abort() elsewhere already failed it
    {
      absl::MutexLock l(&state_->mu);
      if (!state_->pending.empty() && state_->pending.front().handle == front.handle) {
        state_->pending.pop_front();
        mine = true;
      }
    }
    if (!status.ok()) Abort(status);
    if (mine) {
      cudaEventDestroy(front.done);
      if (front.pinned != nullptr) {
        if (status.ok()) std::memcpy(front.host, front.pinned, front.bytes);
        absl::MutexLock l(&state_->mu);
        state_->pinned_free.push_back({front.pinned, front.bytes});
      }
      front.handle->Complete(status);
    }
  }
}

bool NcclCommunicator::PendingFailed(absl::Time deadline, absl::Status* status) {
  ncclResult_t async = ncclSuccess;
  {
    absl::MutexLock l(&state_->mu);
    if (state_->comm != nullptr) ncclCommGetAsyncError(state_->comm, &async);
  }
  if (async != ncclSuccess && async != ncclInProgress) {
    *status = NcclError(async, "collective");
    return true;
  }
  if (absl::Now() > deadline) {
    *status = absl::DeadlineExceededError(absl::StrCat("rank ", rank_,
                                                       ": NCCL collective did not complete within ",
                                                       absl::FormatDuration(options_.timeout)));
    return true;
  }
  return false;
}

void NcclCommunicator::Abort(const absl::Status& reason) {
  std::deque<State::Pending> failed;
  absl::Status status;
  {
    absl::MutexLock l(&state_->mu);
    if (!state_->aborted.ok()) return;
    state_->aborted = absl::AbortedError(absl::StrCat("communicator aborted: ", reason.ToString()));
    status = state_->aborted;
    failed.swap(state_->pending);
    // ncclCommAbort stops in-flight collectives (also ones waiting for a
    // peer that died) and frees the communicator.
    if (state_->comm != nullptr) ncclCommAbort(state_->comm);
    state_->comm = nullptr;
  }
  for (auto& p : failed) {
    cudaEventDestroy(p.done);
    p.handle->Complete(status);
  }
}

CommHandlePtr NcclCommunicator::ReduceScatter(void* buffer, int64_t count, DType type,
                                              ReduceOp op) {
  if (absl::Status s = CheckCollectiveArgs(buffer, count, type, /*reduces=*/true); !s.ok())
    return Done(s);
  const int64_t bytes = count * DTypeSize(type);
  return Submit(CollectiveKind::kReduceScatter, (world_ - 1) * bytes, buffer, world_ * bytes,
                [&](void* buf, cudaStream_t s) {
                  char* base = static_cast<char*>(buf);
                  return ncclReduceScatter(base, base + rank_ * bytes, count, NcclType(type),
                                           NcclOp(op), state_->comm, s);
                });
}

CommHandlePtr NcclCommunicator::AllGather(void* buffer, int64_t count, DType type) {
  if (absl::Status s = CheckCollectiveArgs(buffer, count, type, /*reduces=*/false); !s.ok())
    return Done(s);
  const int64_t bytes = count * DTypeSize(type);
  return Submit(CollectiveKind::kAllGather, (world_ - 1) * bytes, buffer, world_ * bytes,
                [&](void* buf, cudaStream_t s) {
                  char* base = static_cast<char*>(buf);
                  return ncclAllGather(base + rank_ * bytes, base, count, NcclType(type),
                                       state_->comm, s);
                });
}

CommHandlePtr NcclCommunicator::AllReduce(void* buffer, int64_t count, DType type, ReduceOp op) {
  if (absl::Status s = CheckCollectiveArgs(buffer, count, type, /*reduces=*/true); !s.ok())
    return Done(s);
  const int64_t bytes = count * DTypeSize(type);
  return Submit(CollectiveKind::kAllReduce, 2 * (world_ - 1) * bytes / world_, buffer, bytes,
                [&](void* buf, cudaStream_t s) {
                  return ncclAllReduce(buf, buf, count, NcclType(type), NcclOp(op), state_->comm,
                                       s);
                });
}

CommHandlePtr NcclCommunicator::Broadcast(void* buffer, int64_t count, DType type, int root) {
  absl::Status err = CheckCollectiveArgs(buffer, count, type, /*reduces=*/false);
  if (err.ok()) err = CheckRoot(root, world_);
  if (!err.ok()) return Done(err);
  const int64_t bytes = count * DTypeSize(type);
  return Submit(CollectiveKind::kBroadcast, rank_ == root ? bytes : 0, buffer, bytes,
                [&](void* buf, cudaStream_t s) {
                  return ncclBroadcast(buf, buf, count, NcclType(type), root, state_->comm, s);
                });
}

CommHandlePtr NcclCommunicator::Barrier() {
  return Submit(CollectiveKind::kBarrier, 0, nullptr, 0, [&](void*, cudaStream_t s) {
    return ncclAllReduce(state_->scratch, state_->scratch, 1, ncclFloat32, ncclSum, state_->comm,
                         s);
  });
}

bool NcclCommunicator::OrderStreamAfter(const CommHandlePtr& handle, void* stream) {
  if (handle == nullptr) return false;
  absl::MutexLock l(&state_->mu);
  if (!state_->aborted.ok()) return false;
  for (const State::Pending& p : state_->pending) {
    if (p.handle != handle) continue;
    // A staged host buffer is complete only once the watcher copied it back.
    if (p.pinned != nullptr) return false;
    const cudaError_t e = cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), p.done, 0);
    if (e != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    return true;
  }
  // Not pending: its event has fired (or it failed); the host wait is short.
  return false;
}

ByteCounters NcclCommunicator::counters() const {
  ByteCounters c;
  for (int i = 0; i < kNumCollectiveKinds; ++i) c.sent[i] = state_->sent[i].load();
  return c;
}

}  // namespace shardopt
