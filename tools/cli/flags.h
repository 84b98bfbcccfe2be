// Flag parsing for the command-line tools ("--name=value" or "--name value").
// Switches ("--help", "--json", "--worker" unless the caller names others)
// take no value; every other flag needs one. Flags are parsed only in main().
//
// Parse() refuses unknown flags, a flag without a value, and a flag given
// twice with different values. The typed accessors refuse malformed and
// out-of-range values by name, with one-line messages such as
//   --log-every must be an integer in [1, 100000000], got '0'
// Programs check every accessor's status and exit 2 with that message; no
// value is ever silently replaced by its default.
#ifndef SHARDOPT_TOOLS_CLI_FLAGS_H_
#define SHARDOPT_TOOLS_CLI_FLAGS_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"  // (users rely on these two)
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/hyper_params.h"

namespace shardopt {

class Flags {
 public:
  // Parses argv[1..] up to "--" (the rest lands in rest()); positional
  // arguments land in positional(). `known` lists every accepted flag name
  // (without "--"); `switches` the ones that take no value.
  static absl::StatusOr<Flags> Parse(int argc, char** argv, const std::vector<std::string>& known,
                                     const std::vector<std::string>& switches = {"help", "json",
                                                                                 "worker"});

  bool Has(const std::string& name) const { return values_.count(name) > 0; }
  // The raw value (any string, empty included), or `def` when absent.
  std::string Str(const std::string& name, const std::string& def) const;
  // Like Str(), but a given value must not be empty ("--ckpt-dir=").
  absl::StatusOr<std::string> NonEmpty(const std::string& name, const std::string& def) const;
  // One of `choices`, or `def` when absent.
  absl::StatusOr<std::string> Choice(const std::string& name, const std::string& def,
                                     const std::vector<std::string>& choices) const;

  // A decimal integer in [min, max], or `def` when absent (def is not checked).
  absl::StatusOr<int64_t> Int(const std::string& name, int64_t def, int64_t min, int64_t max) const;
  // A finite number in [min, max] ((min, max] when min_exclusive), or `def`
  // when absent. nan and inf are refused.
  absl::StatusOr<double> Double(const std::string& name, double def, double min, double max,
                                bool min_exclusive = false) const;
  // A value of hyper-parameter `p` (common/hyper_params.h: the rule every
  // path shares), or `def` when absent.
  absl::StatusOr<double> HyperParam(const std::string& name, HyperParameter p, double def) const;
  // A TCP port in [0, 65535] (0: chosen by the OS).
  absl::StatusOr<int> Port(const std::string& name, int def) const;
  // A finite number of seconds in [min, max] ((min, max] when min_exclusive).
  absl::StatusOr<absl::Duration> Seconds(const std::string& name, double def, double min,
                                         double max, bool min_exclusive = false) const;
  // true/false (also 1/0, yes/no); a bare switch ("--json") is true.
  absl::StatusOr<bool> Bool(const std::string& name, bool def) const;

  // Unbounded forms, kept for the benchmarks: an integer; a finite number.
  absl::StatusOr<int64_t> Int(const std::string& name, int64_t def) const;
  absl::StatusOr<double> Double(const std::string& name, double def) const;

  const std::vector<std::string>& positional() const { return positional_; }
  const std::vector<std::string>& rest() const { return rest_; }

 private:
  std::map<std::string, std::string> values_;
  std::vector<std::string> positional_;
  std::vector<std::string> rest_;
};

// An integer in [min, max] from the environment variable `name`, or `def`
// when it is unset; errors read "RANK must be an integer in [0, 1], got 'x'".
absl::StatusOr<int64_t> EnvInt(const char* name, int64_t def, int64_t min, int64_t max);
// A number in [min, max] from the environment variable `name`, or `def`.
absl::StatusOr<double> EnvDouble(const char* name, double def, double min, double max);

// Reads a token from a file (trailing whitespace removed).
absl::StatusOr<std::string> ReadTokenFile(const std::string& path);

}  // namespace shardopt

#endif  // SHARDOPT_TOOLS_CLI_FLAGS_H_
