#include "tools/flags.h"

#include <fstream>
#include <sstream>

namespace shardopt {

absl::StatusOr<std::string> ReadTokenFile(const std::string& path) {
  std::ifstream f(path);
  if (!f) return absl::NotFoundError(absl::StrCat("cannot read token file '", path, "'"));
  std::stringstream ss;
  ss << f.rdbuf();
  std::string t = ss.str();
  while (!t.empty() && (t.back() == '\n' || t.back() == '\r' || t.back() == ' ')) t.pop_back();
  if (t.empty()) return absl::InvalidArgumentError(absl::StrCat("token file '", path, "' is empty"));
  return t;
}

}  // namespace shardopt
