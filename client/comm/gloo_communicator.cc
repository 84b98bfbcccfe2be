#include "client/comm/gloo_communicator.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "client/comm/reduce_ops.h"
#include "gloo/rendezvous/context.h"
#include "gloo/rendezvous/store.h"
#include "gloo/transport/tcp/device.h"
#include "gloo/transport/unbound_buffer.h"

namespace shardopt {

namespace {

// Gloo's rendezvous talks to our store through this adapter. Gloo expects
// exceptions; Create() turns them back into a Status.
class GlooStoreAdapter : public gloo::rendezvous::Store {
 public:
  GlooStoreAdapter(KeyValueStore* store, absl::Duration timeout)
      : store_(store), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    absl::Status s = store_->Set(key, std::string(data.begin(), data.end()));
    if (!s.ok()) throw std::runtime_error("rendezvous store set: " + s.ToString());
  }
  std::vector<char> get(const std::string& key) override {
    auto v = store_->Get(key, timeout_);
    if (!v.ok()) throw std::runtime_error("rendezvous: " + v.status().ToString());
    return std::vector<char>(v->begin(), v->end());
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, ToChrono(timeout_)); }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    for (const auto& key : keys) {
      auto v = store_->Get(key, absl::Milliseconds(timeout.count()));
      if (!v.ok()) throw std::runtime_error("rendezvous: " + v.status().ToString());
    }
  }

 private:
  static std::chrono::milliseconds ToChrono(absl::Duration d) {
    return std::chrono::milliseconds(absl::ToInt64Milliseconds(d));
  }
  KeyValueStore* store_;
  absl::Duration timeout_;
};

std::chrono::milliseconds Millis(absl::Duration d) {
  return std::chrono::milliseconds(std::max<int64_t>(1, absl::ToInt64Milliseconds(d)));
}

}  // namespace

// An unbound buffer that Interrupt() can reach while an operation waits on it.
class GlooCommunicator::Registered {
 public:
  Registered(GlooCommunicator* comm, std::unique_ptr<gloo::transport::UnboundBuffer> buffer)
      : comm_(comm), buffer_(std::move(buffer)) {}
  ~Registered() {
    {
      absl::MutexLock lock(&comm_->registry_mu_);
      comm_->active_.erase(buffer_.get());
    }
    // After a failure Gloo may still complete operations on this buffer.
    if (comm_->aborted()) comm_->graveyard_.push_back(std::move(buffer_));
  }
  gloo::transport::UnboundBuffer* operator->() { return buffer_.get(); }
  gloo::transport::UnboundBuffer* get() { return buffer_.get(); }

 private:
  GlooCommunicator* comm_;
  std::unique_ptr<gloo::transport::UnboundBuffer> buffer_;
};

absl::StatusOr<std::unique_ptr<GlooCommunicator>> GlooCommunicator::Create(
    KeyValueStore* store, int rank, int world_size, const GlooOptions& options) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " / world size ", world_size, " out of range"));
  }
  if (options.segment_bytes < 64) {
    return absl::InvalidArgumentError("segment_bytes must be at least 64");
  }
  if (store == nullptr) return absl::InvalidArgumentError("no rendezvous store");
  try {
    gloo::transport::tcp::attr attr;
    attr.hostname = options.hostname;
    std::shared_ptr<gloo::transport::Device> device = gloo::transport::tcp::CreateDevice(attr);
    auto context = std::make_shared<gloo::rendezvous::Context>(rank, world_size);
    context->setTimeout(Millis(options.timeout));
    PrefixKeyValueStore prefixed(store, options.store_prefix);
    GlooStoreAdapter adapter(&prefixed, options.timeout);
    context->connectFullMesh(adapter, device);
    std::unique_ptr<GlooCommunicator> comm(
        new GlooCommunicator(rank, world_size, options, std::move(context)));
    comm->Start();
    return comm;
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("gloo rendezvous failed for rank ", rank, " of ", world_size, ": ", e.what()));
  }
}

GlooCommunicator::GlooCommunicator(int rank, int world_size, const GlooOptions& options,
                                   std::shared_ptr<gloo::Context> context)
    : QueuedCommunicator(rank, world_size), options_(options), context_(std::move(context)) {}

GlooCommunicator::~GlooCommunicator() {
  Stop();  // the worker finishes (or fails) what is queued; waits are bounded
  context_.reset();
  graveyard_.clear();
  scratch_graveyard_.clear();
}

void GlooCommunicator::Interrupt() {
  absl::MutexLock lock(&registry_mu_);
  for (auto* b : active_) {
    b->abortWaitRecv();
    b->abortWaitSend();
  }
}

std::unique_ptr<GlooCommunicator::Registered> GlooCommunicator::Register(void* ptr, size_t bytes) {
  auto buffer = context_->createUnboundBuffer(ptr, bytes);
  {
    absl::MutexLock lock(&registry_mu_);
    active_.insert(buffer.get());
  }
  return std::make_unique<Registered>(this, std::move(buffer));
}

uint64_t GlooCommunicator::NextSlotBase() { return (++op_seq_) << 40; }

std::vector<uint64_t> GlooCommunicator::SlotBases(int steps) {
  std::vector<uint64_t> base(steps);
  for (int s = 0; s < steps; ++s) base[s] = NextSlotBase();
  return base;
}

namespace {

// Slot of message `segment` in ring step `step` of the operation `base`.
uint64_t Slot(uint64_t base, int step, int64_t segment) {
  return base | (static_cast<uint64_t>(step) << 24) | static_cast<uint64_t>(segment);
}

}  // namespace

// A wait that ends early ended because the connection broke (a peer died),
// not because time ran out: say which.
absl::Status GlooCommunicator::WaitFailure(const char* what, absl::Duration waited,
                                           const char* error) const {
  if (waited < options_.timeout * 0.9) {
    return absl::UnavailableError(
        absl::StrCat("rank ", rank(), ": ", what, " failed after ",
                     absl::FormatDuration(absl::Trunc(waited, absl::Milliseconds(1))),
                     ", before its ", absl::FormatDuration(options_.timeout),
                     " timeout: the connection to a peer broke (did it exit?): ", error));
  }
  return absl::DeadlineExceededError(absl::StrCat("rank ", rank(), ": ", what, " timed out after ",
                                                  absl::FormatDuration(options_.timeout), ": ",
                                                  error));
}

absl::Status GlooCommunicator::WaitRecv(Registered& buffer) {
  if (aborted()) return abort_status();
  const absl::Time start = absl::Now();
  try {
    if (!buffer->waitRecv(nullptr, Millis(options_.timeout))) return abort_status();
    return absl::OkStatus();
  } catch (const std::exception& e) {
    absl::Status s = WaitFailure("receive", absl::Now() - start, e.what());
    Abort(s);
    return s;
  }
}

absl::Status GlooCommunicator::WaitSend(Registered& buffer) {
  if (aborted()) return abort_status();
  const absl::Time start = absl::Now();
  try {
    if (!buffer->waitSend(nullptr, Millis(options_.timeout))) return abort_status();
    return absl::OkStatus();
  } catch (const std::exception& e) {
    absl::Status s = WaitFailure("send", absl::Now() - start, e.what());
    Abort(s);
    return s;
  }
}

absl::Status GlooCommunicator::WaitSends(const std::vector<std::unique_ptr<Registered>>& chunks,
                                         const std::vector<int64_t>& sends) {
  absl::Status status;
  for (size_t i = 0; i < chunks.size() && status.ok(); ++i) {
    for (int64_t c = 0; c < sends[i] && status.ok(); ++c) status = WaitSend(*chunks[i]);
  }
  return status;
}

// Ring reduce-scatter, pipelined by segments and across steps. In step s this
// rank sends chunk (r-s-1) mod N to its right neighbour and receives chunk
// (r-s-2) mod N from its left one, reducing it into its own copy; a segment is
// forwarded as soon as it has been reduced. After N-1 steps chunk r is complete.
absl::Status GlooCommunicator::RingReduceScatter(const std::vector<char*>& chunk_ptr,
                                                 int64_t chunk_bytes, DType type, ReduceOp op,
                                                 CollectiveKind kind) {
  const int n = world_size(), r = rank();
  if (n == 1 || chunk_bytes == 0) return absl::OkStatus();
  const int elem = DTypeSize(type);
  const int64_t seg = std::max<int64_t>(elem, options_.segment_bytes / elem * elem);
  const int64_t nseg = (chunk_bytes + seg - 1) / seg;
  auto seg_len = [&](int64_t k) { return std::min(seg, chunk_bytes - k * seg); };
  const int right = (r + 1) % n, left = (r + n - 1) % n;
  auto chunk_of_step = [&](int s, int shift) { return ((r - s - shift) % n + 2 * n) % n; };

  std::vector<std::unique_ptr<Registered>> chunks;
  for (int i = 0; i < n; ++i) chunks.push_back(Register(chunk_ptr[i], chunk_bytes));
  auto scratch_mem = std::make_unique<std::vector<char>>(2 * std::min(seg, chunk_bytes));
  char* scratch_ptr[2] = {scratch_mem->data(), scratch_mem->data() + std::min(seg, chunk_bytes)};
  std::unique_ptr<Registered> scratch[2] = {Register(scratch_ptr[0], std::min(seg, chunk_bytes)),
                                            Register(scratch_ptr[1], std::min(seg, chunk_bytes))};
  const std::vector<uint64_t> base = SlotBases(n - 1);
  std::vector<int64_t> sends(n, 0);

  absl::Status status;
  try {
    const int64_t items = static_cast<int64_t>(n - 1) * nseg;
    auto post_recv = [&](int64_t j) {
      const int s = static_cast<int>(j / nseg);
      const int64_t k = j % nseg;
      (*scratch[j % 2])->recv(left, Slot(base[s], s, k), 0, seg_len(k));
    };
    for (int64_t j = 0; j < std::min<int64_t>(2, items); ++j) post_recv(j);
    const int first = chunk_of_step(0, 1);
    for (int64_t k = 0; k < nseg; ++k) {
      (*chunks[first])->send(right, Slot(base[0], 0, k), k * seg, seg_len(k));
      ++sends[first];
    }
    for (int64_t j = 0; j < items && status.ok(); ++j) {
      const int s = static_cast<int>(j / nseg);
      const int64_t k = j % nseg;
      status = WaitRecv(*scratch[j % 2]);
      if (!status.ok()) break;
      const int target = chunk_of_step(s, 2);
      ReduceInto(chunk_ptr[target] + k * seg, scratch_ptr[j % 2], seg_len(k) / elem, type, op);
      if (j + 2 < items) post_recv(j + 2);
      if (s + 1 < n - 1) {
        (*chunks[target])->send(right, Slot(base[s + 1], s + 1, k), k * seg, seg_len(k));
        ++sends[target];
      }
    }
    if (status.ok()) status = WaitSends(chunks, sends);
  } catch (const std::exception& e) {
    status = absl::UnavailableError(absl::StrCat("gloo: ", e.what()));
    Abort(status);
  }
  if (!status.ok()) {
    scratch_graveyard_.push_back(std::move(scratch_mem));
    return status;
  }
  CountSent(kind, (n - 1) * chunk_bytes);
  CountReceived(kind, (n - 1) * chunk_bytes);
  return absl::OkStatus();
}

// Ring all-gather: in step s this rank sends chunk (r-s) mod N and receives
// chunk (r-s-1) mod N, directly into place; every received segment is
// forwarded at once.
absl::Status GlooCommunicator::RingAllGather(char* buffer, int64_t chunk_bytes,
                                             CollectiveKind kind) {
  const int n = world_size(), r = rank();
  if (n == 1 || chunk_bytes == 0) return absl::OkStatus();
  const int64_t seg = std::max<int64_t>(1, options_.segment_bytes);
  const int64_t nseg = (chunk_bytes + seg - 1) / seg;
  auto seg_len = [&](int64_t k) { return std::min(seg, chunk_bytes - k * seg); };
  const int right = (r + 1) % n, left = (r + n - 1) % n;
  auto recv_chunk = [&](int s) { return ((r - s - 1) % n + 2 * n) % n; };

  std::vector<std::unique_ptr<Registered>> chunks;
  for (int i = 0; i < n; ++i) chunks.push_back(Register(buffer + i * chunk_bytes, chunk_bytes));
  const std::vector<uint64_t> base = SlotBases(n - 1);
  std::vector<int64_t> sends(n, 0);
  absl::Status status;
  try {
    // Every chunk is received once, in its own region: post all receives now.
    for (int s = 0; s < n - 1; ++s) {
      for (int64_t k = 0; k < nseg; ++k) {
        (*chunks[recv_chunk(s)])->recv(left, Slot(base[s], s, k), k * seg, seg_len(k));
      }
    }
    for (int64_t k = 0; k < nseg; ++k) {
      (*chunks[r])->send(right, Slot(base[0], 0, k), k * seg, seg_len(k));
      ++sends[r];
    }
    for (int s = 0; s < n - 1 && status.ok(); ++s) {
      const int c = recv_chunk(s);
      for (int64_t k = 0; k < nseg; ++k) {
        // Segments of one chunk arrive in order over the one connection from
        // the left neighbour, so the k-th completion is segment k.
        status = WaitRecv(*chunks[c]);
        if (!status.ok()) break;
        if (s + 1 < n - 1) {
          (*chunks[c])->send(right, Slot(base[s + 1], s + 1, k), k * seg, seg_len(k));
          ++sends[c];
        }
      }
    }
    if (status.ok()) status = WaitSends(chunks, sends);
  } catch (const std::exception& e) {
    status = absl::UnavailableError(absl::StrCat("gloo: ", e.what()));
    Abort(status);
  }
  if (!status.ok()) return status;
  CountSent(kind, (n - 1) * chunk_bytes);
  CountReceived(kind, (n - 1) * chunk_bytes);
  return absl::OkStatus();
}

absl::Status GlooCommunicator::RunReduceScatter(const std::vector<char*>& chunks, int64_t count,
                                                DType type, ReduceOp op) {
  return ReduceScatterFromHalf(chunks, count, type, op, rank(), world_size(),
                               [&](const std::vector<char*>& b, int64_t chunk) {
                                 return RingReduceScatter(b, chunk, type, op,
                                                          CollectiveKind::kReduceScatter);
                               });
}

absl::Status GlooCommunicator::RunAllGather(void* buffer, int64_t count, DType type) {
  return RingAllGather(static_cast<char*>(buffer), count * DTypeSize(type),
                       CollectiveKind::kAllGather);
}

absl::Status GlooCommunicator::RunAllReduce(void* buffer, int64_t count, DType type, ReduceOp op) {
  return AllReduceFromHalves(
      buffer, count, type, op, rank(), world_size(),
      [&](const std::vector<char*>& b, int64_t chunk) {
        return RingReduceScatter(b, chunk, type, op, CollectiveKind::kAllReduce);
      },
      [&](char* b, int64_t chunk) { return RingAllGather(b, chunk, CollectiveKind::kAllReduce); },
      &scratch_graveyard_);
}

// Pipelined chain root -> root+1 -> ... -> root-1, forwarding each segment as
// it arrives.
absl::Status GlooCommunicator::RunBroadcast(void* buffer, int64_t count, DType type, int root) {
  const int n = world_size(), r = rank();
  const int64_t bytes = count * DTypeSize(type);
  if (n == 1 || bytes == 0) return absl::OkStatus();
  const int64_t seg = std::max<int64_t>(1, options_.segment_bytes);
  const int64_t nseg = (bytes + seg - 1) / seg;
  auto seg_len = [&](int64_t k) { return std::min(seg, bytes - k * seg); };
  const int pos = (r - root + n) % n;
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  auto buf = Register(buffer, bytes);
  const uint64_t base = NextSlotBase();
  int64_t sends = 0;
  absl::Status status;
  try {
    if (pos > 0) {
      for (int64_t k = 0; k < nseg; ++k) (*buf)->recv(prev, Slot(base, 0, k), k * seg, seg_len(k));
    }
    for (int64_t k = 0; k < nseg && status.ok(); ++k) {
      if (pos > 0) {
        status = WaitRecv(*buf);
        if (!status.ok()) break;
      }
      if (pos < n - 1) {
        (*buf)->send(next, Slot(base, 0, k), k * seg, seg_len(k));
        ++sends;
      }
    }
    for (int64_t c = 0; c < sends && status.ok(); ++c) status = WaitSend(*buf);
  } catch (const std::exception& e) {
    status = absl::UnavailableError(absl::StrCat("gloo: ", e.what()));
    Abort(status);
  }
  if (!status.ok()) return status;
  if (pos < n - 1) CountSent(CollectiveKind::kBroadcast, bytes);
  if (pos > 0) CountReceived(CollectiveKind::kBroadcast, bytes);
  return absl::OkStatus();
}

absl::Status GlooCommunicator::RunBarrier() {
  return BarrierFromHalves(
      world_size(),
      [&](const std::vector<char*>& b, int64_t chunk) {
        return RingReduceScatter(b, chunk, DType::kFloat32, ReduceOp::kSum,
                                 CollectiveKind::kBarrier);
      },
      [&](char* b, int64_t chunk) { return RingAllGather(b, chunk, CollectiveKind::kBarrier); },
      &scratch_graveyard_);
}

}  // namespace shardopt
