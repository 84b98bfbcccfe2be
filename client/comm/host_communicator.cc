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

namespace {

absl::Status Rendezvous(int rank, const absl::Status& s) {
  return absl::Status(s.code(),
                      absl::StrCat("transport rendezvous of rank ", rank, ": ", s.message()));
}

}  // namespace

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
    auto hosts = ExchangeRecords(&kv, "host", rank, world_size, identity, options.timeout);
    if (!hosts.ok()) return Rendezvous(rank, hosts.status());
    transport = CpuTransport::kShm;
    for (const std::string& h : *hosts) {
      if (h != identity) transport = CpuTransport::kGloo;
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
    auto results =
        ExchangeRecords(&kv, "shm-ok", rank, world_size,
                        c.ok() ? "1" : absl::StrCat("0", c.status().message()), options.timeout);
    if (!results.ok()) return Rendezvous(rank, results.status());
    std::string why;
    for (int p = 0; p < world_size && why.empty(); ++p) {
      const std::string& v = (*results)[p];
      if (v != "1") why = absl::StrCat("rank ", p, ": ", v.substr(1));
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
