// The CPU communicator a trainer should use: shared memory when every rank is
// on one host, Gloo over TCP otherwise (or either, on request).
#ifndef SHARDOPT_CLIENT_COMM_HOST_COMMUNICATOR_H_
#define SHARDOPT_CLIENT_COMM_HOST_COMMUNICATOR_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "client/comm/communicator.h"
#include "client/comm/kv_store.h"
#include "client/comm/shm_communicator.h"

namespace shardopt {

enum class CpuTransport {
  kAuto,  // shm when every rank is on this host, else gloo (decided alike on every rank)
  kGloo,  // GlooCommunicator: TCP, any hosts
  kShm,   // ShmCommunicator: shared memory, one host only
};
// "auto", "gloo", "shm"; anything else is InvalidArgument naming the choices.
absl::StatusOr<CpuTransport> ParseCpuTransport(absl::string_view name);
const char* CpuTransportName(CpuTransport transport);

struct CpuCommOptions {
  CpuTransport transport = CpuTransport::kAuto;
  // Address Gloo listens on (port chosen by the OS).
  std::string hostname = "127.0.0.1";
  // Bound on rendezvous and on every wait inside a collective.
  absl::Duration timeout = absl::Seconds(60);
  // Keys in the store are prefixed with this.
  std::string store_prefix = "comm";
  // The shared-memory channels (timeout and store_prefix are taken from above).
  ShmOptions shm;
};

struct CpuComm {
  std::unique_ptr<Communicator> comm;
  CpuTransport transport;  // the one chosen (never kAuto)
  // kAuto only: why shared memory was chosen and then given up for Gloo
  // (e.g. a /dev/shm too small for the channels on some rank); empty otherwise.
  std::string fallback_reason;
};

// Every rank of the job must call it with the same transport and prefix.
// With kAuto, ranks on one host try shared memory and, if it fails on any
// rank, all of them fall back to Gloo together (fallback_reason says why).
absl::StatusOr<CpuComm> CreateCpuCommunicator(KeyValueStore* store, int rank, int world_size,
                                              const CpuCommOptions& options);

}  // namespace shardopt

#endif  // SHARDOPT_CLIENT_COMM_HOST_COMMUNICATOR_H_
