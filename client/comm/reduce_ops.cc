#include "client/comm/reduce_ops.h"

#include <algorithm>
#include <cstring>

#include "common/bf16.h"

namespace shardopt {

void ReduceInto(void* dst, const void* src, int64_t count, DType type, ReduceOp op) {
  const bool max = op == ReduceOp::kMax;
  if (type == DType::kFloat32) {
    float* __restrict d = static_cast<float*>(dst);
    const float* __restrict s = static_cast<const float*>(src);
    if (max) {
      for (int64_t i = 0; i < count; ++i) d[i] = std::max(d[i], s[i]);
    } else {
      for (int64_t i = 0; i < count; ++i) d[i] += s[i];
    }
    return;
  }
  uint16_t* __restrict d = static_cast<uint16_t*>(dst);
  const uint16_t* __restrict s = static_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < count; ++i) {
    const float a = Bf16ToFloat(d[i]), b = Bf16ToFloat(s[i]);
    d[i] = FloatToBf16(max ? std::max(a, b) : a + b);
  }
}

void Scale(void* buffer, int64_t count, DType type, float factor) {
  if (type == DType::kFloat32) {
    float* b = static_cast<float*>(buffer);
    for (int64_t i = 0; i < count; ++i) b[i] *= factor;
    return;
  }
  uint16_t* b = static_cast<uint16_t*>(buffer);
  for (int64_t i = 0; i < count; ++i) b[i] = FloatToBf16(Bf16ToFloat(b[i]) * factor);
}

std::vector<char*> AdjacentChunks(void* buffer, int world_size, int64_t chunk_bytes) {
  std::vector<char*> chunks(world_size);
  for (int i = 0; i < world_size; ++i) chunks[i] = static_cast<char*>(buffer) + i * chunk_bytes;
  return chunks;
}

absl::Status ReduceScatterFromHalf(const std::vector<char*>& chunks, int64_t count, DType type,
                                   ReduceOp op, int rank, int world_size,
                                   const RingReduceHalf& reduce_scatter) {
  absl::Status s = reduce_scatter(chunks, count * DTypeSize(type));
  if (!s.ok()) return s;
  if (op == ReduceOp::kAverage && world_size > 1) {
    Scale(chunks[rank], count, type, 1.0f / world_size);
  }
  return absl::OkStatus();
}

absl::Status AllReduceFromHalves(void* buffer, int64_t count, DType type, ReduceOp op, int rank,
                                 int world_size, const RingReduceHalf& reduce_scatter,
                                 const RingHalf& all_gather,
                                 std::vector<std::unique_ptr<std::vector<char>>>* keep_on_failure) {
  const int n = world_size;
  const int elem = DTypeSize(type);
  if (n == 1 || count == 0) return absl::OkStatus();
  const int64_t per_rank = count / n;
  char* base = static_cast<char*>(buffer);
  if (per_rank > 0) {
    absl::Status s = reduce_scatter(AdjacentChunks(base, n, per_rank * elem), per_rank * elem);
    if (!s.ok()) return s;
    if (op == ReduceOp::kAverage) Scale(base + rank * per_rank * elem, per_rank, type, 1.0f / n);
    s = all_gather(base, per_rank * elem);
    if (!s.ok()) return s;
  }
  const int64_t rest = count - per_rank * n;
  if (rest == 0) return absl::OkStatus();
  auto padded = std::make_unique<std::vector<char>>(static_cast<size_t>(n * elem), 0);
  std::memcpy(padded->data(), base + per_rank * n * elem, rest * elem);
  absl::Status s = reduce_scatter(AdjacentChunks(padded->data(), n, elem), elem);
  if (s.ok()) s = all_gather(padded->data(), elem);
  if (!s.ok()) {
    keep_on_failure->push_back(std::move(padded));
    return s;
  }
  if (op == ReduceOp::kAverage) Scale(padded->data(), rest, type, 1.0f / n);
  std::memcpy(base + per_rank * n * elem, padded->data(), rest * elem);
  return absl::OkStatus();
}

absl::Status BarrierFromHalves(int world_size, const RingReduceHalf& reduce_scatter,
                               const RingHalf& all_gather,
                               std::vector<std::unique_ptr<std::vector<char>>>* keep_on_failure) {
  if (world_size == 1) return absl::OkStatus();
  auto padded = std::make_unique<std::vector<char>>(world_size * sizeof(float), 0);
  const float token = 1.0f;
  std::memcpy(padded->data(), &token, sizeof(float));
  absl::Status s =
      reduce_scatter(AdjacentChunks(padded->data(), world_size, sizeof(float)), sizeof(float));
  if (s.ok()) s = all_gather(padded->data(), sizeof(float));
  if (!s.ok()) keep_on_failure->push_back(std::move(padded));
  return s;
}

}  // namespace shardopt
