#include "client/device_backend.h"

#include <atomic>

namespace shardopt {

namespace {
std::atomic<DeviceBackend*> g_cuda{nullptr};
}  // namespace

DeviceBackend* CudaBackend() { return g_cuda.load(); }
void RegisterCudaBackend(DeviceBackend* backend) { g_cuda.store(backend); }

}  // namespace shardopt
