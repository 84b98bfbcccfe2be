#include "common/dtype.h"

namespace shardopt {

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float32";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat16: return "float16";
    case DType::kByte: return "byte";
  }
  return "unknown";
}

}  // namespace shardopt
