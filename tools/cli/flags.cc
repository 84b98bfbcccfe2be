#include "tools/cli/flags.h"

#include <cmath>
#include <cstdlib>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/file_system.h"

namespace shardopt {
namespace {

// "got '...'" for messages: one line, bounded, escaped.
std::string Got(const std::string& v) {
  if (v.empty()) return "got an empty value";
  std::string shown = v.size() > 64 ? v.substr(0, 61) + "..." : v;
  return absl::StrCat("got '", absl::CEscape(shown), "'");
}

// A bound for messages: 86400 and 31536000 in full, 1e+30 and 3.40282e+38 short.
std::string Num(double v) {
  if (v == std::floor(v) && std::fabs(v) < 1e15) return absl::StrCat(static_cast<int64_t>(v));
  return absl::StrFormat("%g", v);
}

bool ParseInt(const std::string& s, int64_t* v) {
  // SimpleAtoi accepts surrounding whitespace; a flag value has none.
  if (s.empty() || absl::ascii_isspace(static_cast<unsigned char>(s.front())) ||
      absl::ascii_isspace(static_cast<unsigned char>(s.back()))) {
    return false;
  }
  return absl::SimpleAtoi(s, v);
}

bool ParseDouble(const std::string& s, double* v) {
  if (s.empty() || absl::ascii_isspace(static_cast<unsigned char>(s.front())) ||
      absl::ascii_isspace(static_cast<unsigned char>(s.back()))) {
    return false;
  }
  return absl::SimpleAtod(s, v);
}

}  // namespace

absl::StatusOr<Flags> Flags::Parse(int argc, char** argv, const std::vector<std::string>& known,
                                   const std::vector<std::string>& switches) {
  auto is_in = [](const std::vector<std::string>& list, const std::string& name) {
    for (const auto& k : list) {
      if (k == name) return true;
    }
    return false;
  };
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
    std::string name = a.substr(2), value;
    const size_t eq = name.find('=');
    const bool has_eq = eq != std::string::npos;
    if (has_eq) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
    }
    if (!is_in(known, name)) {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name, " (see --help)"));
    }
    if (!has_eq) {
      if (is_in(switches, name)) {
        value = "true";
      } else if (i + 1 < argc && std::string(argv[i + 1]).rfind("--", 0) != 0) {
        value = argv[++i];
      } else {
        return absl::InvalidArgumentError(
            absl::StrCat("--", name, " needs a value (--", name, "=VALUE)"));
      }
    }
    auto it = f.values_.find(name);
    if (it != f.values_.end() && it->second != value) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", name, " given twice with different values ('",
                       absl::CEscape(it->second), "' and '", absl::CEscape(value), "')"));
    }
    f.values_[name] = value;
  }
  return f;
}

std::string Flags::Str(const std::string& name, const std::string& def) const {
  auto it = values_.find(name);
  return it == values_.end() ? def : it->second;
}

absl::StatusOr<std::string> Flags::NonEmpty(const std::string& name, const std::string& def) const {
  auto it = values_.find(name);
  if (it == values_.end()) return def;
  if (it->second.empty())
    return absl::InvalidArgumentError(absl::StrCat("--", name, " needs a non-empty value"));
  return it->second;
}

absl::StatusOr<std::string> Flags::Choice(const std::string& name, const std::string& def,
                                          const std::vector<std::string>& choices) const {
  auto it = values_.find(name);
  if (it == values_.end()) return def;
  for (const auto& c : choices) {
    if (c == it->second) return c;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "--", name, " must be one of ", absl::StrJoin(choices, " | "), ", ", Got(it->second)));
}

absl::StatusOr<int64_t> Flags::Int(const std::string& name, int64_t def, int64_t min,
                                   int64_t max) const {
  auto it = values_.find(name);
  if (it == values_.end()) return def;
  int64_t v;
  if (!ParseInt(it->second, &v) || v < min || v > max) {
    return absl::InvalidArgumentError(absl::StrCat("--", name, " must be an integer in [", min,
                                                   ", ", max, "], ", Got(it->second)));
  }
  return v;
}

absl::StatusOr<double> Flags::Double(const std::string& name, double def, double min, double max,
                                     bool min_exclusive) const {
  auto it = values_.find(name);
  if (it == values_.end()) return def;
  double v;
  if (!ParseDouble(it->second, &v) || !std::isfinite(v) || v < min || (min_exclusive && v == min) ||
      v > max) {
    return absl::InvalidArgumentError(absl::StrCat("--", name, " must be a number in ",
                                                   min_exclusive ? "(" : "[", Num(min), ", ",
                                                   Num(max), "], ", Got(it->second)));
  }
  return v;
}

absl::StatusOr<double> Flags::HyperParam(const std::string& name, HyperParameter p,
                                         double def) const {
  auto it = values_.find(name);
  if (it == values_.end()) return def;
  double v;
  if (!ParseDouble(it->second, &v)) {
    return absl::InvalidArgumentError(absl::StrCat("--", name, " must be a number ",
                                                   HyperParameterRange(p), ", ", Got(it->second)));
  }
  if (absl::Status s = ValidateHyperParameter(p, v); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--", name, ": ", s.message()));
  }
  return v;
}

absl::StatusOr<int> Flags::Port(const std::string& name, int def) const {
  auto it = values_.find(name);
  if (it == values_.end()) return def;
  int64_t v;
  if (!ParseInt(it->second, &v) || v < 0 || v > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", name, " must be a port number in [0, 65535], ", Got(it->second)));
  }
  return static_cast<int>(v);
}

absl::StatusOr<absl::Duration> Flags::Seconds(const std::string& name, double def, double min,
                                              double max, bool min_exclusive) const {
  auto it = values_.find(name);
  if (it == values_.end()) return absl::Seconds(def);
  double v;
  if (!ParseDouble(it->second, &v) || !std::isfinite(v) || v < min || (min_exclusive && v == min) ||
      v > max) {
    return absl::InvalidArgumentError(absl::StrCat("--", name, " must be a number of seconds in ",
                                                   min_exclusive ? "(" : "[", Num(min), ", ",
                                                   Num(max), "], ", Got(it->second)));
  }
  return absl::Seconds(v);
}

absl::StatusOr<bool> Flags::Bool(const std::string& name, bool def) const {
  auto it = values_.find(name);
  if (it == values_.end()) return def;
  const std::string& v = it->second;
  if (v == "true" || v == "1" || v == "yes") return true;
  if (v == "false" || v == "0" || v == "no") return false;
  return absl::InvalidArgumentError(absl::StrCat("--", name, " must be true or false, ", Got(v)));
}

absl::StatusOr<int64_t> Flags::Int(const std::string& name, int64_t def) const {
  auto it = values_.find(name);
  if (it == values_.end()) return def;
  int64_t v;
  if (!ParseInt(it->second, &v)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", name, " must be an integer, ", Got(it->second)));
  }
  return v;
}

absl::StatusOr<double> Flags::Double(const std::string& name, double def) const {
  auto it = values_.find(name);
  if (it == values_.end()) return def;
  double v;
  if (!ParseDouble(it->second, &v) || !std::isfinite(v)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", name, " must be a finite number, ", Got(it->second)));
  }
  return v;
}

absl::StatusOr<int64_t> EnvInt(const char* name, int64_t def, int64_t min, int64_t max) {
  const char* e = std::getenv(name);
  if (e == nullptr) return def;
  int64_t v;
  if (!ParseInt(e, &v) || v < min || v > max) {
    return absl::InvalidArgumentError(absl::StrCat(
        "environment variable ", name, " must be an integer in [", min, ", ", max, "], ", Got(e)));
  }
  return v;
}

absl::StatusOr<double> EnvDouble(const char* name, double def, double min, double max) {
  const char* e = std::getenv(name);
  if (e == nullptr) return def;
  double v;
  if (!ParseDouble(e, &v) || !(v >= min) || !(v <= max)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "environment variable ", name, " must be a number in [", min, ", ", max, "], ", Got(e)));
  }
  return v;
}

absl::StatusOr<std::string> ReadTokenFile(const std::string& path) {
  auto read = ReadConfigFile(path);
  if (!read.ok()) return absl::NotFoundError(absl::StrCat("cannot read token file '", path, "'"));
  std::string t = *read;
  while (!t.empty() && (t.back() == '\n' || t.back() == '\r' || t.back() == ' ')) t.pop_back();
  if (t.empty())
    return absl::InvalidArgumentError(absl::StrCat("token file '", path, "' is empty"));
  return t;
}

}  // namespace shardopt
