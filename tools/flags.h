// Minimal flag parsing for the command-line tools ("--name=value" or
// "--name value"; "--help" and "--json" are switches). Flags are parsed only
// in main(). Unknown flags and bad values are errors.
#ifndef SHARDOPT_TOOLS_FLAGS_H_
#define SHARDOPT_TOOLS_FLAGS_H_

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace shardopt {

class Flags {
 public:
  // Parses argv[1..] up to "--" (the rest lands in rest()); positional
  // arguments land in positional().
  static absl::StatusOr<Flags> Parse(int argc, char** argv, const std::vector<std::string>& known) {
    Flags f;
    for (int i = 1; i < argc; ++i) {
      std::string a = argv[i];
      if (a == "--") {
        for (int j = i + 1; j < argc; ++j) f.rest_.push_back(argv[j]);
        break;
      }
      if (a.rfind("--", 0) != 0) {
        f.positional_.push_back(a);
        continue;
      }
      std::string name = a.substr(2), value = "true";
      const size_t eq = name.find('=');
      if (eq != std::string::npos) {
        value = name.substr(eq + 1);
        name = name.substr(0, eq);
      } else if (name != "help" && name != "json" && name != "worker" && i + 1 < argc &&
                 std::string(argv[i + 1]).rfind("--", 0) != 0) {
        value = argv[++i];
      }
      bool ok = false;
      for (const auto& k : known) ok |= (k == name);
      if (!ok) return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name, " (see --help)"));
      f.values_[name] = value;
    }
    return f;
  }
  bool Has(const std::string& name) const { return values_.count(name) > 0; }
  std::string Str(const std::string& name, const std::string& def) const {
    auto it = values_.find(name);
    return it == values_.end() ? def : it->second;
  }
  absl::StatusOr<int64_t> Int(const std::string& name, int64_t def) const {
    auto it = values_.find(name);
    if (it == values_.end()) return def;
    int64_t v;
    if (!absl::SimpleAtoi(it->second, &v)) {
      return absl::InvalidArgumentError(absl::StrCat("--", name, " expects an integer, got '", it->second, "'"));
    }
    return v;
  }
  absl::StatusOr<double> Double(const std::string& name, double def) const {
    auto it = values_.find(name);
    if (it == values_.end()) return def;
    double v;
    if (!absl::SimpleAtod(it->second, &v)) {
      return absl::InvalidArgumentError(absl::StrCat("--", name, " expects a number, got '", it->second, "'"));
    }
    return v;
  }
  const std::vector<std::string>& positional() const { return positional_; }
  const std::vector<std::string>& rest() const { return rest_; }

 private:
  std::map<std::string, std::string> values_;
  std::vector<std::string> positional_;
  std::vector<std::string> rest_;
};

// Reads a token from a file (trailing whitespace removed).
absl::StatusOr<std::string> ReadTokenFile(const std::string& path);

}  // namespace shardopt

#endif  // SHARDOPT_TOOLS_FLAGS_H_
