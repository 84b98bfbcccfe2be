#include "tools/flags.h"

#include "common/file_system.h"

#include <fstream>
#include <sstream>

namespace shardopt {

absl::StatusOr<std::string> ReadTokenFile(const std::string& path) {
  auto read = ReadWholeFile(PosixFileSystem(), path);
  if (!read.ok()) return absl::NotFoundError(absl::StrCat("cannot read token file '", path, "'"));
  std::string t = *read;
  while (!t.empty() && (t.back() == '\n' || t.back() == '\r' || t.back() == ' ')) t.pop_back();
  if (t.empty()) return absl::InvalidArgumentError(absl::StrCat("token file '", path, "' is empty"));
  return t;
}

}  // namespace shardopt
