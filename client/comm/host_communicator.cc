#include "client/comm/host_communicator.h"

#include "absl/strings/str_cat.h"
#include "client/comm/gloo_communicator.h"
#include "client/comm/shm_communicator.h"

namespace shardopt {

absl::StatusOr<CpuTransport> ParseCpuTransport(absl::string_view name) {
  if (name == "auto") return CpuTransport::kAuto;
  if (name == "gloo") return CpuTransport::kGloo;
  if (name == "shm") return CpuTransport::kShm;
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown transport '", name, "': auto (shared memory on one host, else Gloo), gloo or shm"));
}

const char* CpuTransportName(CpuTransport transport) {
  switch (transport) {
    case CpuTransport::kAuto: return "auto";
    case CpuTransport::kGloo: return "gloo";
    case CpuTransport::kShm: return "shm";
  }
  return "?";
}

absl::StatusOr<CpuComm> CreateCpuCommunicator(KeyValueStore* store, int rank, int world_size,
                                              const CpuCommOptions& options) {
  if (store == nullptr) return absl::InvalidArgumentError("no rendezvous store");
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " / world size ", world_size, " out of range"));
  }
  CpuTransport transport = options.transport;
  if (transport == CpuTransport::kAuto) {
    // Every rank publishes where it runs and reads everyone's, so all of them
    // take the same decision.
    PrefixKeyValueStore kv(store, options.store_prefix + "/auto");
    const std::string identity = ShmHostIdentity();
    absl::Status s = kv.Set(absl::StrCat("host/", rank), identity);
    if (!s.ok()) return s;
    transport = CpuTransport::kShm;
    for (int p = 0; p < world_size; ++p) {
      if (p == rank) continue;
      auto other = kv.Get(absl::StrCat("host/", p), options.timeout);
      if (!other.ok()) {
        return absl::Status(other.status().code(),
                            absl::StrCat("transport rendezvous of rank ", rank,
                                         ": waiting for rank ", p, ": ", other.status().message()));
      }
      if (*other != identity) transport = CpuTransport::kGloo;
    }
  }
  CpuComm out;
  out.transport = transport;
  if (transport == CpuTransport::kShm) {
    ShmOptions o = options.shm;
    o.timeout = options.timeout;
    o.store_prefix = options.store_prefix + "/shm";
    auto c = ShmCommunicator::Create(store, rank, world_size, o);
    if (options.transport == CpuTransport::kShm) {
      if (!c.ok()) return c.status();
      out.comm = std::move(*c);
      return out;
    }
    // auto: shared memory can still fail on one host (a full or missing
    // /dev/shm, limits). Every rank says how it went and reads everyone's, so
    // all of them keep shm or all fall back to Gloo together.
    PrefixKeyValueStore kv(store, options.store_prefix + "/auto");
    absl::Status s = kv.Set(absl::StrCat("shm-ok/", rank),
                            c.ok() ? "1" : absl::StrCat("0", c.status().message()));
    if (!s.ok()) return s;
    std::string why;
    if (!c.ok()) why = absl::StrCat("rank ", rank, ": ", c.status().message());
    for (int p = 0; p < world_size; ++p) {
      if (p == rank) continue;
      auto v = kv.Get(absl::StrCat("shm-ok/", p), options.timeout);
      if (!v.ok()) {
        return absl::Status(v.status().code(),
                            absl::StrCat("transport rendezvous of rank ", rank,
                                         ": waiting for rank ", p, ": ", v.status().message()));
      }
      if (*v != "1" && why.empty()) why = absl::StrCat("rank ", p, ": ", v->substr(1));
    }
    if (why.empty()) {
      out.comm = std::move(*c);
      return out;
    }
    out.transport = CpuTransport::kGloo;
    out.fallback_reason = absl::StrCat("shared memory failed (", why, "); using Gloo");
  }
  GlooOptions o;
  o.hostname = options.hostname;
  o.timeout = options.timeout;
  o.store_prefix = options.store_prefix + "/gloo";
  auto c = GlooCommunicator::Create(store, rank, world_size, o);
  if (!c.ok()) return c.status();
  out.comm = std::move(*c);
  return out;
}

}  // namespace shardopt
