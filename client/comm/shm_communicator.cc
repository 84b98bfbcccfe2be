#include "client/comm/shm_communicator.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstring>
#include <fstream>
#include <new>
#include <random>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "client/comm/reduce_ops.h"

namespace shardopt {

namespace {

constexpr uint64_t kMagic = 0x74706f6472616873ULL;  // "shardopt"
constexpr uint32_t kVersion = 1;
constexpr int kMaxSlots = 64;
constexpr size_t kPage = 4096;
// How often a waiting rank checks its neighbours' liveness.
constexpr absl::Duration kWaitSlice = absl::Milliseconds(50);

struct SlotMeta {
  uint64_t seq;    // the sender's collective number
  uint64_t bytes;  // the sub-operation's chunk size
  uint32_t code;   // kind, phase, root
  uint32_t segment_bytes;
  uint32_t sub;      // sub-operation within the collective
  uint32_t type_op;  // element type and reduce op
};

// Start of every region. The channel carries messages from the owner's left
// neighbour: `head` counts the messages it published, `tail` those the owner
// consumed. `doorbell` is bumped by whoever changes something the owner may
// be waiting for (a message published to it, a slot freed by its right
// neighbour, an abort), and futex-woken when `waiting` is set.
struct Header {
  uint64_t magic;
  uint32_t version;
  uint32_t slots;
  uint64_t slot_bytes;
  int32_t owner_pid;
  int32_t owner_rank;
  alignas(64) std::atomic<uint32_t> doorbell;
  std::atomic<uint32_t> waiting;
  alignas(64) std::atomic<uint64_t> head;
  alignas(64) std::atomic<uint64_t> tail;
  alignas(64) std::atomic<uint32_t> closed;  // the owner aborted or closed its communicator
  char reason[500];
  alignas(64) SlotMeta meta[kMaxSlots];
};
static_assert(std::atomic<uint32_t>::is_always_lock_free, "futex words must be lock-free");
static_assert(std::atomic<uint64_t>::is_always_lock_free, "counters must be lock-free");

size_t DataOffset() { return (sizeof(Header) + kPage - 1) / kPage * kPage; }
size_t RegionBytes(const ShmOptions& o) {
  return DataOffset() + static_cast<size_t>(o.slots) * static_cast<size_t>(o.slot_bytes);
}

void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, absl::Duration timeout) {
  timespec ts = absl::ToTimespec(std::max(timeout, absl::Microseconds(100)));
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void FutexWake(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

void RingBell(Header* h, bool always_wake = false) {
  h->doorbell.fetch_add(1, std::memory_order_seq_cst);
  if (always_wake || h->waiting.load(std::memory_order_seq_cst) != 0) FutexWake(&h->doorbell);
}

absl::Status Errno(const std::string& what) {
  return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(errno)));
}

// Collective descriptors: kind, phase (0 reduce-scatter, 1 all-gather,
// 2 broadcast) and the broadcast root.
uint32_t Code(CollectiveKind kind, int phase, int root) {
  return (static_cast<uint32_t>(kind) << 28) | (static_cast<uint32_t>(phase) << 24) |
         (static_cast<uint32_t>(root) & 0xffffff);
}

int OpenPidfd(int pid) {
#ifdef SYS_pidfd_open
  return static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
#else
  (void)pid;
  return -1;
#endif
}

}  // namespace

std::string ShmHostIdentity() {
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  std::string boot;
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::getline(in, boot);
  struct stat st {};
  std::string shm = stat("/dev/shm", &st) == 0 ? absl::StrCat(st.st_dev, ":", st.st_ino)
                                               : std::string("no-dev-shm");
  // The network namespace too: ranks that see different networks are treated
  // as different hosts (as tests that simulate hosts with namespaces expect;
  // Gloo works across them, whatever they share).
  // And the pid namespace: a neighbour's liveness is checked through its pid.
  char net[128] = {0}, pid[128] = {0};
  const ssize_t n = readlink("/proc/self/ns/net", net, sizeof(net) - 1);
  const ssize_t m = readlink("/proc/self/ns/pid", pid, sizeof(pid) - 1);
  return absl::StrCat(host, " boot ", boot, " shm ", shm, " ", n > 0 ? net : "net:?", " ",
                      m > 0 ? pid : "pid:?");
}

struct ShmCommunicator::Region {
  std::string name;
  void* base = nullptr;
  size_t size = 0;
  bool owner = false;
  bool linked = false;  // the name still exists in /dev/shm

  Header* h() const { return static_cast<Header*>(base); }
  char* slot(uint64_t i) const {
    return static_cast<char*>(base) + DataOffset() + i * h()->slot_bytes;
  }
  ~Region() {
    if (owner && linked) shm_unlink(name.c_str());
    if (base != nullptr) munmap(base, size);
  }
};

namespace {

// Create()'s checks of its arguments, before anything is set up.
absl::Status ValidateArguments(const KeyValueStore* store, int rank, int world_size,
                               const ShmOptions& options) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " / world size ", world_size, " out of range"));
  }
  if (options.slot_bytes < 64 || options.slot_bytes % 64 != 0 ||
      options.slot_bytes > (int64_t{1} << 30)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "slot_bytes must be a multiple of 64 in [64, 1 GiB], not ", options.slot_bytes));
  }
  if (options.slots < 2 || options.slots > kMaxSlots) {
    return absl::InvalidArgumentError(
        absl::StrCat("slots must be in [2, ", kMaxSlots, "], not ", options.slots));
  }
  if (options.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("timeout must be positive");
  }
  if (store == nullptr) return absl::InvalidArgumentError("no rendezvous store");
  return absl::OkStatus();
}

// Creates this rank's region in /dev/shm (a fresh name, mode 0600) into `own`,
// allocated, mapped and with its header written. On failure `own` holds what
// there is to undo (its destructor unlinks the name and unmaps).
absl::Status CreateOwnRegion(int rank, const ShmOptions& options, ShmCommunicator::Region* own) {
  std::random_device rd;
  own->name = absl::StrCat("/shardopt-", getpid(), "-r", rank, "-",
                           absl::Hex((static_cast<uint64_t>(rd()) << 32) | rd(), absl::kZeroPad16));
  const int fd = shm_open(own->name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) return Errno(absl::StrCat("shm_open ", own->name));
  own->owner = true;
  own->linked = true;
  own->size = RegionBytes(options);
  // posix_fallocate: a full /dev/shm is an error here, not a SIGBUS later.
  const int err = posix_fallocate(fd, 0, static_cast<off_t>(own->size));
  if (err != 0) {
    close(fd);
    return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", own->size,
                                                     " bytes in /dev/shm for ", own->name, ": ",
                                                     std::strerror(err)));
  }
  own->base = mmap(nullptr, own->size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (own->base == MAP_FAILED) {
    own->base = nullptr;
    return Errno("mmap");
  }
  Header* h = new (own->base) Header();
  h->magic = kMagic;
  h->version = kVersion;
  h->slots = static_cast<uint32_t>(options.slots);
  h->slot_bytes = static_cast<uint64_t>(options.slot_bytes);
  h->owner_pid = getpid();
  h->owner_rank = rank;
  return absl::OkStatus();
}

}  // namespace

// Create()'s side of the key-value store (keys under `store_prefix`), and the
// mapping of a neighbour's region from its record. A rank that fails says so
// where its neighbours wait for it (Fail()), so they fail at once naming the
// cause instead of at their timeout.
class ShmCommunicator::Rendezvous {
 public:
  Rendezvous(KeyValueStore* store, int rank, int world_size, const ShmOptions& options)
      : kv_(store, options.store_prefix),
        rank_(rank),
        world_size_(world_size),
        options_(options),
        where_(absl::StrCat("shared-memory rendezvous of rank ", rank, " of ", world_size)) {}

  // `s`, prefixed with where it happened, after publishing it in place of
  // this rank's records not published yet.
  absl::Status Fail(const absl::Status& s);
  // Every rank must be on this host. A failure has gone through Fail(), except
  // a rank on another host (FailedPrecondition).
  absl::Status CheckSameHost();
  // Publishes this rank's region `name` (and pid). A failure has gone through Fail().
  absl::Status PublishRegion(const std::string& name);
  // Maps rank `peer`'s region from its record; *pid gets its pid.
  absl::StatusOr<std::unique_ptr<Region>> MapPeer(int peer, int* pid);
  // Says this rank has mapped its neighbours' regions, then waits until both
  // neighbours have mapped its own. A failure has gone through Fail().
  absl::Status PublishMappedAndWait(int left, int right);

 private:
  // A neighbour's record, or its failure.
  absl::StatusOr<std::string> Get(const std::string& key, int peer);
  // Why shm_open of rank `peer`'s region `name` failed, with errno as
  // shm_open left it.
  absl::Status OpenError(int peer, const std::string& name);

  PrefixKeyValueStore kv_;
  const int rank_;
  const int world_size_;
  const ShmOptions& options_;
  const std::string where_;
  bool region_published_ = false;
  bool mapped_published_ = false;
};

absl::Status ShmCommunicator::Rendezvous::Fail(const absl::Status& s) {
  absl::Status out(s.code(), absl::StrCat(where_, ": ", s.message()));
  const std::string record = absl::StrCat("!", out.message());
  if (!region_published_) (void)kv_.Set(absl::StrCat("region/", rank_), record);
  if (!mapped_published_) (void)kv_.Set(absl::StrCat("mapped/", rank_), record);
  return out;
}

absl::StatusOr<std::string> ShmCommunicator::Rendezvous::Get(const std::string& key, int peer) {
  auto v = kv_.Get(absl::StrCat(key, "/", peer), options_.timeout);
  if (!v.ok()) {
    return absl::Status(v.status().code(),
                        absl::StrCat("waiting for rank ", peer, ": ", v.status().message()));
  }
  if (!v->empty() && (*v)[0] == '!') {
    return absl::FailedPreconditionError(absl::StrCat("rank ", peer, " failed: ", v->substr(1)));
  }
  return v;
}

absl::Status ShmCommunicator::Rendezvous::CheckSameHost() {
  const std::string identity = ShmHostIdentity();
  auto hosts = ExchangeRecords(&kv_, "host", rank_, world_size_, identity, options_.timeout);
  if (!hosts.ok()) return Fail(hosts.status());
  for (int p = 0; p < world_size_; ++p) {
    if ((*hosts)[p] != identity) {
      return absl::FailedPreconditionError(absl::StrCat(
          where_, ": rank ", p, " is on another host (", (*hosts)[p], "; this one: ", identity,
          "): the shared-memory transport needs every rank on one host; use the gloo transport"));
    }
  }
  return absl::OkStatus();
}

absl::Status ShmCommunicator::Rendezvous::PublishRegion(const std::string& name) {
  absl::Status s = kv_.Set(absl::StrCat("region/", rank_), absl::StrCat(name, " ", getpid()));
  if (!s.ok()) return Fail(s);
  region_published_ = true;
  return absl::OkStatus();
}

absl::Status ShmCommunicator::Rendezvous::OpenError(int peer, const std::string& name) {
  if (errno == EACCES) {
    return absl::PermissionDeniedError(absl::StrCat(
        "cannot open rank ", peer, "'s region ", name,
        ": permission denied (regions are private to their user: run every rank as one user)"));
  }
  const int err = errno;
  if (err == ENOENT) {
    // Gone already: the rank failed its rendezvous (and says why), or
    // its /dev/shm is another one.
    auto record = kv_.Get(absl::StrCat("mapped/", peer), absl::Seconds(2));
    if (record.ok() && !record->empty() && (*record)[0] == '!') {
      return absl::FailedPreconditionError(
          absl::StrCat("rank ", peer, " failed: ", record->substr(1)));
    }
  }
  errno = err;
  return Errno(absl::StrCat("cannot open rank ", peer, "'s region ", name,
                            " (did its own rendezvous fail? is its /dev/shm another one?)"));
}

absl::StatusOr<std::unique_ptr<ShmCommunicator::Region>> ShmCommunicator::Rendezvous::MapPeer(
    int peer, int* pid) {
  auto value = Get("region", peer);
  if (!value.ok()) return value.status();
  std::vector<std::string> parts = absl::StrSplit(*value, ' ');
  if (parts.size() != 2 || !absl::SimpleAtoi(parts[1], pid)) {
    return absl::InternalError(absl::StrCat("bad region record of rank ", peer, ": ", *value));
  }
  auto region = std::make_unique<Region>();
  region->name = parts[0];
  const int fd = shm_open(region->name.c_str(), O_RDWR, 0);
  if (fd < 0) return OpenError(peer, region->name);
  struct stat st {};
  if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != RegionBytes(options_)) {
    close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", peer, "'s region is ", st.st_size, " bytes, this rank expects ",
                     RegionBytes(options_), ": every rank must use the same slots and slot_bytes"));
  }
  region->size = RegionBytes(options_);
  region->base = mmap(nullptr, region->size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (region->base == MAP_FAILED) {
    region->base = nullptr;
    return Errno("mmap");
  }
  const Header* h = region->h();
  if (h->magic != kMagic || h->version != kVersion || h->owner_rank != peer ||
      h->slots != static_cast<uint32_t>(options_.slots) ||
      h->slot_bytes != static_cast<uint64_t>(options_.slot_bytes)) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", peer, "'s region (", region->name,
                                                   ") does not match this rank's options"));
  }
  return region;
}

absl::Status ShmCommunicator::Rendezvous::PublishMappedAndWait(int left, int right) {
  absl::Status s = kv_.Set(absl::StrCat("mapped/", rank_), "1");
  if (!s.ok()) return Fail(s);
  mapped_published_ = true;
  for (int peer : {left, right}) {
    auto v = Get("mapped", peer);
    if (!v.ok()) return Fail(v.status());
  }
  return absl::OkStatus();
}

absl::Status ShmCommunicator::MapNeighbours(Rendezvous* rv) {
  const int left = (rank() + world_size() - 1) % world_size(), right = (rank() + 1) % world_size();
  auto right_region = rv->MapPeer(right, &right_pid_);
  if (!right_region.ok()) return rv->Fail(right_region.status());
  right_region_ = std::move(*right_region);
  if (left == right) {
    left_pid_ = right_pid_;
  } else {
    auto left_region = rv->MapPeer(left, &left_pid_);
    if (!left_region.ok()) return rv->Fail(left_region.status());
    left_region_ = std::move(*left_region);
  }
  left_ = left;
  right_ = right;
  left_pidfd_ = OpenPidfd(left_pid_);
  right_pidfd_ = left == right ? -1 : OpenPidfd(right_pid_);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<ShmCommunicator>> ShmCommunicator::Create(
    KeyValueStore* store, int rank, int world_size, const ShmOptions& options) {
  absl::Status s = ValidateArguments(store, rank, world_size, options);
  if (!s.ok()) return s;
  std::unique_ptr<ShmCommunicator> comm(new ShmCommunicator(rank, world_size, options));
  if (world_size == 1) {
    comm->Start();
    return comm;
  }
  // On a failure below, it is published first (Rendezvous::Fail), then what
  // was set up is undone in reverse: `own` unlinked and unmapped, then `comm`
  // (the neighbours' regions unmapped, the pidfds closed).
  Rendezvous rv(store, rank, world_size, options);
  s = rv.CheckSameHost();
  if (!s.ok()) return s;
  auto own = std::make_unique<Region>();
  s = CreateOwnRegion(rank, options, own.get());
  if (!s.ok()) return rv.Fail(s);
  s = rv.PublishRegion(own->name);
  if (!s.ok()) return s;
  s = comm->MapNeighbours(&rv);
  if (!s.ok()) return s;
  // Both neighbours map this rank's region; then its name can go, so nothing
  // is left in /dev/shm whatever happens to the processes later.
  s = rv.PublishMappedAndWait(comm->left_, comm->right_);
  if (!s.ok()) return s;
  shm_unlink(own->name.c_str());
  own->linked = false;
  comm->own_ = std::move(own);
  comm->Start();
  return comm;
}

ShmCommunicator::ShmCommunicator(int rank, int world_size, const ShmOptions& options)
    : QueuedCommunicator(rank, world_size), options_(options) {}

ShmCommunicator::~ShmCommunicator() {
  Stop();  // the worker finishes (or fails) what is queued; waits are bounded
  {
    absl::MutexLock lock(&close_mu_);
    if (own_ != nullptr) {
      Header* h = own_->h();
      if (h->closed.load(std::memory_order_acquire) == 0) {
        std::snprintf(h->reason, sizeof(h->reason), "rank %d closed its communicator", rank());
        h->closed.store(1, std::memory_order_release);
      }
      RingBell(right_region_->h(), true);
      if (left_region_ != nullptr) RingBell(left_region_->h(), true);
    }
    released_ = true;  // a late Interrupt() touches nothing now
  }
  if (left_pidfd_ >= 0) close(left_pidfd_);
  if (right_pidfd_ >= 0) close(right_pidfd_);
}

void ShmCommunicator::Interrupt() {
  absl::MutexLock lock(&close_mu_);
  if (own_ == nullptr || released_) return;
  Header* h = own_->h();
  if (h->closed.load(std::memory_order_acquire) == 0) {
    // The first cause travels on unchanged (a neighbour's, if that is why).
    const std::string why = !relayed_.empty() ? relayed_ : abort_status().ToString();
    std::snprintf(h->reason, sizeof(h->reason), "%s", why.c_str());
    h->closed.store(1, std::memory_order_release);
  }
  RingBell(h, true);
  RingBell(right_region_->h(), true);
  if (left_region_ != nullptr) RingBell(left_region_->h(), true);
}

absl::Status ShmCommunicator::Fail(absl::Status status) {
  Abort(status);
  return status;
}

absl::Status ShmCommunicator::PeerFailure(int peer, std::string* origin) const {
  const bool is_left = peer == left_;
  const Region* region =
      !is_left || left_region_ == nullptr ? right_region_.get() : left_region_.get();
  const Header* h = region->h();
  if (h->closed.load(std::memory_order_acquire) != 0) {
    *origin = std::string(h->reason, strnlen(h->reason, sizeof(h->reason)));
    return absl::UnavailableError(
        absl::StrCat("rank ", rank(), ": rank ", peer, " left the collective: ", *origin));
  }
  const int pidfd = is_left || left_ == right_ ? left_pidfd_ : right_pidfd_;
  const int pid = is_left ? left_pid_ : right_pid_;
  bool exited = false;
  if (pidfd >= 0) {
    pollfd p{pidfd, POLLIN, 0};
    exited = poll(&p, 1, 0) > 0;
  } else {
    exited = kill(pid, 0) != 0 && errno == ESRCH;
  }
  if (exited) {
    return absl::UnavailableError(absl::StrCat("rank ", rank(), ": rank ", peer, " (pid ", pid,
                                               ") exited in the middle of a collective"));
  }
  return absl::OkStatus();
}

std::string ShmCommunicator::Describe(uint32_t code, uint32_t type_op, uint64_t bytes) const {
  static const char* const kKinds[] = {"reduce-scatter", "all-gather", "all-reduce", "broadcast",
                                       "barrier"};
  static const char* const kPhases[] = {"reduce-scatter", "all-gather", "broadcast"};
  static const char* const kTypes[] = {"fp32", "bf16", "bytes"};
  static const char* const kOps[] = {"sum", "average", "max"};
  const uint32_t kind = code >> 28, phase = (code >> 24) & 0xf;
  const uint32_t type = type_op >> 4, op = type_op & 0xf;
  std::string out = kind < 5 ? kKinds[kind] : "?";
  if (phase < 3 && out != kPhases[phase]) absl::StrAppend(&out, " (", kPhases[phase], " phase)");
  if (phase == 2) absl::StrAppend(&out, " from root ", code & 0xffffff);
  absl::StrAppend(&out, " of ", bytes, " bytes per chunk, ", type < 3 ? kTypes[type] : "?");
  if (phase == 0) absl::StrAppend(&out, " ", op < 3 ? kOps[op] : "?");
  return out;
}

ShmCommunicator::OpDesc ShmCommunicator::NextDesc(CollectiveKind kind, int phase, int root,
                                                  DType type, ReduceOp op, int64_t bytes) {
  return OpDesc{op_seq_, sub_++, Code(kind, phase, root),
                (static_cast<uint32_t>(type) << 4) | static_cast<uint32_t>(op),
                static_cast<uint64_t>(bytes)};
}

bool ShmCommunicator::PublishSends(const OpDesc& desc, std::deque<Send>* sends) {
  Header* out = right_region_->h();
  const uint64_t slots = static_cast<uint64_t>(options_.slots);
  bool progress = false;
  while (!sends->empty() && sent_ - out->tail.load(std::memory_order_acquire) < slots) {
    const uint64_t i = sent_ % slots;
    const Send& m = sends->front();
    std::memcpy(right_region_->slot(i), m.data, static_cast<size_t>(m.bytes));
    out->meta[i] = SlotMeta{desc.seq, desc.bytes,  desc.code, static_cast<uint32_t>(m.bytes),
                            desc.sub, desc.type_op};
    out->head.store(++sent_, std::memory_order_release);
    RingBell(out);
    CountSent(static_cast<CollectiveKind>(desc.code >> 28), m.bytes);
    sends->pop_front();
    progress = true;
  }
  return progress;
}

absl::StatusOr<bool> ShmCommunicator::ConsumeRecvs(const OpDesc& desc, int64_t num_recvs,
                                                   const std::function<Recv(int64_t)>& recv,
                                                   DType type, ReduceOp op, int64_t* next,
                                                   std::deque<Send>* sends) {
  Header* in = own_->h();
  Header* back = (left_region_ != nullptr ? left_region_ : right_region_)->h();
  const uint64_t slots = static_cast<uint64_t>(options_.slots);
  const int elem = DTypeSize(type);
  bool progress = false;
  while (*next < num_recvs && in->head.load(std::memory_order_acquire) > consumed_) {
    const uint64_t i = consumed_ % slots;
    const SlotMeta meta = in->meta[i];
    const Recv r = recv(*next);
    if (meta.seq != desc.seq || meta.sub != desc.sub || meta.code != desc.code ||
        meta.bytes != desc.bytes || meta.type_op != desc.type_op ||
        meta.segment_bytes != static_cast<uint64_t>(r.bytes)) {
      return Fail(absl::InvalidArgumentError(absl::StrCat(
          "collective mismatch: rank ", left_, " sent a segment of its collective #", meta.seq,
          " (", Describe(meta.code, meta.type_op, meta.bytes), ") while rank ", rank(),
          " runs its collective #", desc.seq, " (", Describe(desc.code, desc.type_op, desc.bytes),
          ")", ": every rank must issue the same collectives in the same order")));
    }
    const char* src = own_->slot(i);
    if (r.reduce) {
      ReduceInto(r.dst, src, r.bytes / elem, type, op);
    } else {
      std::memcpy(r.dst, src, static_cast<size_t>(r.bytes));
    }
    in->tail.store(++consumed_, std::memory_order_release);
    RingBell(back);
    CountReceived(static_cast<CollectiveKind>(desc.code >> 28), r.bytes);
    if (r.forward) sends->push_back(Send{r.dst, r.bytes});
    ++*next;
    progress = true;
  }
  return progress;
}

absl::Status ShmCommunicator::NeighbourFailure(bool want_data, bool want_slots,
                                               std::string* origin) const {
  absl::Status peer = PeerFailure(want_data ? left_ : right_, origin);
  if (peer.ok() && want_data && want_slots && left_ != right_) {
    peer = PeerFailure(right_, origin);
  }
  return peer;
}

absl::Status ShmCommunicator::FailRelaying(absl::Status status, const std::string& origin) {
  if (!origin.empty()) {
    absl::MutexLock lock(&close_mu_);
    relayed_ = origin;
  }
  return Fail(std::move(status));
}

absl::Status ShmCommunicator::TimeoutError(const OpDesc& desc, bool want_data,
                                           bool want_slots) const {
  std::string whom = want_data ? absl::StrCat("rank ", left_, " to send")
                               : absl::StrCat("rank ", right_, " to take its messages");
  if (want_data && want_slots) {
    absl::StrAppend(&whom, " and rank ", right_, " to take its messages");
  }
  return absl::DeadlineExceededError(absl::StrCat(
      "rank ", rank(), ": ", Describe(desc.code, desc.type_op, desc.bytes), " timed out after ",
      absl::FormatDuration(options_.timeout), " without progress, waiting for ", whom));
}

void ShmCommunicator::WaitForBell(uint32_t bell, absl::Duration limit) {
  Header* in = own_->h();
  in->waiting.store(1, std::memory_order_seq_cst);
  if (in->doorbell.load(std::memory_order_seq_cst) == bell) FutexWait(&in->doorbell, bell, limit);
  in->waiting.store(0, std::memory_order_seq_cst);
}

absl::Status ShmCommunicator::Exchange(const OpDesc& desc, std::deque<Send> sends,
                                       int64_t num_recvs, const std::function<Recv(int64_t)>& recv,
                                       DType type, ReduceOp op) {
  const Header* in = own_->h();
  int64_t next = 0;
  absl::Time last_progress = absl::Now();
  bool rechecked = false;
  while (!sends.empty() || next < num_recvs) {
    // The doorbell before the abort flag: an Abort() after this read rings it.
    const uint32_t bell = in->doorbell.load(std::memory_order_seq_cst);
    if (aborted()) return abort_status();
    const bool sent = PublishSends(desc, &sends);
    const absl::StatusOr<bool> received =
        ConsumeRecvs(desc, num_recvs, recv, type, op, &next, &sends);
    if (!received.ok()) return received.status();
    if (sent || *received) {
      last_progress = absl::Now();
      rechecked = false;
      continue;
    }
    // Nothing to do until a neighbour acts. Only the neighbours this rank
    // still needs are checked: one that finished its part and closed its
    // communicator (or exited) is no failure of this collective. A failure
    // further along the ring reaches this rank hop by hop: each rank that
    // fails closes its channel, and its neighbours see that.
    const bool want_data = next < num_recvs;
    const bool want_slots = !sends.empty();
    std::string origin;
    absl::Status peer = NeighbourFailure(want_data, want_slots, &origin);
    if (!peer.ok()) {
      // What a neighbour published before it left is still usable: look once more.
      if (!rechecked) {
        rechecked = true;
        continue;
      }
      return FailRelaying(std::move(peer), origin);
    }
    const absl::Duration waited = absl::Now() - last_progress;
    if (waited >= options_.timeout) return Fail(TimeoutError(desc, want_data, want_slots));
    WaitForBell(bell, std::min(kWaitSlice, options_.timeout - waited));
  }
  return absl::OkStatus();
}

// Ring reduce-scatter (as GlooCommunicator's): this rank first sends chunk
// (r-1) mod N; the s-th incoming chunk, (r-s-2) mod N, is reduced into place
// straight from the slot and forwarded while s < N-2. Chunk r ends complete.
absl::Status ShmCommunicator::RingReduceScatter(const std::vector<char*>& chunks,
                                                int64_t chunk_bytes, DType type, ReduceOp op,
                                                CollectiveKind kind) {
  const int n = world_size(), r = rank();
  if (n == 1 || chunk_bytes == 0) return absl::OkStatus();
  const int elem = DTypeSize(type);
  const int64_t seg = std::max<int64_t>(elem, options_.slot_bytes / elem * elem);
  const int64_t nseg = (chunk_bytes + seg - 1) / seg;
  auto seg_len = [&](int64_t k) { return std::min(seg, chunk_bytes - k * seg); };
  auto chunk = [&](int s, int shift) { return ((r - s - shift) % n + 2 * n) % n; };
  std::deque<Send> sends;
  for (int64_t k = 0; k < nseg; ++k) {
    sends.push_back(Send{chunks[chunk(0, 1)] + k * seg, seg_len(k)});
  }
  const OpDesc desc = NextDesc(kind, 0, 0, type, op, chunk_bytes);
  return Exchange(
      desc, std::move(sends), (n - 1) * nseg,
      [&](int64_t j) {
        const int s = static_cast<int>(j / nseg);
        const int64_t k = j % nseg;
        return Recv{chunks[chunk(s, 2)] + k * seg, seg_len(k), true, s + 1 < n - 1};
      },
      type, op);
}

// Ring all-gather: this rank sends its chunk; the s-th incoming chunk,
// (r-s-1) mod N, is copied into place and forwarded while s < N-2.
absl::Status ShmCommunicator::RingAllGather(char* buffer, int64_t chunk_bytes, DType type,
                                            CollectiveKind kind) {
  const int n = world_size(), r = rank();
  if (n == 1 || chunk_bytes == 0) return absl::OkStatus();
  const int64_t seg = options_.slot_bytes;
  const int64_t nseg = (chunk_bytes + seg - 1) / seg;
  auto seg_len = [&](int64_t k) { return std::min(seg, chunk_bytes - k * seg); };
  std::deque<Send> sends;
  for (int64_t k = 0; k < nseg; ++k)
    sends.push_back(Send{buffer + r * chunk_bytes + k * seg, seg_len(k)});
  const OpDesc desc = NextDesc(kind, 1, 0, type, ReduceOp::kSum, chunk_bytes);
  return Exchange(
      desc, std::move(sends), (n - 1) * nseg,
      [&](int64_t j) {
        const int s = static_cast<int>(j / nseg);
        const int64_t k = j % nseg;
        const int c = ((r - s - 1) % n + 2 * n) % n;
        return Recv{buffer + c * chunk_bytes + k * seg, seg_len(k), false, s + 1 < n - 1};
      },
      DType::kByte, ReduceOp::kSum);
}

absl::Status ShmCommunicator::RunReduceScatter(const std::vector<char*>& chunks, int64_t count,
                                               DType type, ReduceOp op) {
  BeginCollective();
  return ReduceScatterFromHalf(chunks, count, type, op, rank(), world_size(),
                               [&](const std::vector<char*>& b, int64_t chunk) {
                                 return RingReduceScatter(b, chunk, type, op,
                                                          CollectiveKind::kReduceScatter);
                               });
}

absl::Status ShmCommunicator::RunAllGather(void* buffer, int64_t count, DType type) {
  BeginCollective();
  return RingAllGather(static_cast<char*>(buffer), count * DTypeSize(type), type,
                       CollectiveKind::kAllGather);
}

absl::Status ShmCommunicator::RunAllReduce(void* buffer, int64_t count, DType type, ReduceOp op) {
  BeginCollective();
  return AllReduceFromHalves(
      buffer, count, type, op, rank(), world_size(),
      [&](const std::vector<char*>& b, int64_t chunk) {
        return RingReduceScatter(b, chunk, type, op, CollectiveKind::kAllReduce);
      },
      [&](char* b, int64_t chunk) {
        return RingAllGather(b, chunk, type, CollectiveKind::kAllReduce);
      },
      &scratch_);
}

// A chain root -> root+1 -> ... -> root-1 around the ring, every segment
// forwarded as it arrives.
absl::Status ShmCommunicator::RunBroadcast(void* buffer, int64_t count, DType type, int root) {
  BeginCollective();
  const int n = world_size(), r = rank();
  const int64_t bytes = count * DTypeSize(type);
  if (n == 1 || bytes == 0) return absl::OkStatus();
  const int64_t seg = options_.slot_bytes;
  const int64_t nseg = (bytes + seg - 1) / seg;
  auto seg_len = [&](int64_t k) { return std::min(seg, bytes - k * seg); };
  const int pos = (r - root + n) % n;
  char* buf = static_cast<char*>(buffer);
  std::deque<Send> sends;
  if (pos == 0) {
    for (int64_t k = 0; k < nseg; ++k) sends.push_back(Send{buf + k * seg, seg_len(k)});
  }
  const OpDesc desc = NextDesc(CollectiveKind::kBroadcast, 2, root, type, ReduceOp::kSum, bytes);
  return Exchange(
      desc, std::move(sends), pos == 0 ? 0 : nseg,
      [&](int64_t k) {
        return Recv{buf + k * seg, seg_len(k), false, pos < n - 1};
      },
      DType::kByte, ReduceOp::kSum);
}

absl::Status ShmCommunicator::RunBarrier() {
  BeginCollective();
  return BarrierFromHalves(
      world_size(),
      [&](const std::vector<char*>& b, int64_t chunk) {
        return RingReduceScatter(b, chunk, DType::kFloat32, ReduceOp::kSum,
                                 CollectiveKind::kBarrier);
      },
      [&](char* b, int64_t chunk) {
        return RingAllGather(b, chunk, DType::kFloat32, CollectiveKind::kBarrier);
      },
      &scratch_);
}

}  // namespace shardopt
