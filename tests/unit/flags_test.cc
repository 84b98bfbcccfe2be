// The flag parser of the command-line tools (tools/cli/flags.h): every malformed
// or out-of-range value is refused by name, nothing falls back silently.
#include "tools/cli/flags.h"

#include <cstdlib>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace shardopt {
namespace {

const std::vector<std::string> kKnown = {
    "steps",  "log-every",          "lr",       "clip",      "port",
    "nnodes", "heartbeat-timeout",  "ckpt-dir", "optimizer", "json",
    "help",   "collective-timeout", "batch",    "token-file"};

absl::StatusOr<Flags> ParseArgs(std::vector<std::string> args) {
  args.insert(args.begin(), "prog");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  return Flags::Parse(static_cast<int>(args.size()), argv.data(), kKnown);
}

Flags MustParse(std::vector<std::string> args) {
  auto f = ParseArgs(std::move(args));
  EXPECT_TRUE(f.ok()) << f.status();
  return f.ok() ? *f : Flags();
}

std::string Msg(const absl::Status& s) { return std::string(s.message()); }

TEST(FlagsParse, BothForms) {
  Flags f = MustParse({"--steps=5", "--lr", "0.5", "pos", "--json", "--", "prog", "--steps=9"});
  EXPECT_EQ(*f.Int("steps", 1, 1, 10), 5);
  EXPECT_DOUBLE_EQ(*f.Double("lr", 1, 0, 1), 0.5);
  EXPECT_TRUE(f.Has("json"));
  EXPECT_TRUE(*f.Bool("json", false));
  EXPECT_EQ(f.positional(), std::vector<std::string>({"pos"}));
  EXPECT_EQ(f.rest(), std::vector<std::string>({"prog", "--steps=9"}));
}

TEST(FlagsParse, NegativeValueAfterSpace) {
  Flags f = MustParse({"--clip", "-1"});
  EXPECT_EQ(Msg(f.Double("clip", 0, 0, 10).status()),
            "--clip must be a number in [0, 10], got '-1'");
}

TEST(FlagsParse, UnknownFlag) {
  EXPECT_EQ(Msg(ParseArgs({"--bogus=1"}).status()), "unknown flag --bogus (see --help)");
}

TEST(FlagsParse, MissingValue) {
  EXPECT_EQ(Msg(ParseArgs({"--steps"}).status()), "--steps needs a value (--steps=VALUE)");
  EXPECT_EQ(Msg(ParseArgs({"--steps", "--lr=1"}).status()),
            "--steps needs a value (--steps=VALUE)");
  // Switches need none.
  EXPECT_TRUE(ParseArgs({"--help", "--json"}).ok());
}

TEST(FlagsParse, GivenTwice) {
  EXPECT_EQ(Msg(ParseArgs({"--steps=3", "--steps=5"}).status()),
            "--steps given twice with different values ('3' and '5')");
  EXPECT_EQ(Msg(ParseArgs({"--steps=3", "--steps", "5"}).status()),
            "--steps given twice with different values ('3' and '5')");
  // The same value twice is harmless.
  Flags f = MustParse({"--steps=3", "--steps", "3"});
  EXPECT_EQ(*f.Int("steps", 1, 1, 10), 3);
}

TEST(FlagsInt, RangeAndMalformed) {
  Flags f = MustParse({"--log-every=0"});
  EXPECT_EQ(Msg(f.Int("log-every", 1, 1, 1000000).status()),
            "--log-every must be an integer in [1, 1000000], got '0'");
  for (const char* bad :
       {"abc", "1e11", "1.5", "0x10", " 5", "5 ", "5x", "99999999999999999999", "nan"}) {
    Flags g = MustParse({std::string("--steps=") + bad});
    auto v = g.Int("steps", 20, 1, 100000000);
    ASSERT_FALSE(v.ok()) << bad;
    EXPECT_EQ(Msg(v.status()),
              absl::StrCat("--steps must be an integer in [1, 100000000], got '", bad, "'"));
  }
  Flags big = MustParse({"--nnodes=2147483648"});
  EXPECT_EQ(Msg(big.Int("nnodes", 1, 1, 1024).status()),
            "--nnodes must be an integer in [1, 1024], got '2147483648'");
  Flags batch = MustParse({"--batch=100000000000"});
  EXPECT_FALSE(batch.Int("batch", 16, 1, 65536).ok());
  Flags ok = MustParse({"--steps=+7"});
  EXPECT_EQ(*ok.Int("steps", 20, 1, 10), 7);
  Flags neg = MustParse({"--steps=-1"});
  EXPECT_EQ(*neg.Int("steps", 20, -1, 10), -1);
}

TEST(FlagsInt, EmptyValueRefused) {
  Flags f = MustParse({"--steps="});
  EXPECT_EQ(Msg(f.Int("steps", 20, 1, 100).status()),
            "--steps must be an integer in [1, 100], got an empty value");
  EXPECT_FALSE(f.Int("steps", 20).ok());  // also the unbounded form
}

TEST(FlagsInt, DefaultWhenAbsent) {
  Flags f = MustParse({});
  EXPECT_EQ(*f.Int("steps", 20, 1, 100), 20);
  EXPECT_EQ(*f.Int("steps", 20), 20);
}

TEST(FlagsDouble, NonFiniteAndRange) {
  for (const char* bad : {"nan", "NaN", "inf", "-inf", "infinity", "1e400", "abc", "1.0.0", ""}) {
    Flags f = MustParse({std::string("--clip=") + bad});
    auto v = f.Double("clip", 0, 0, 1e30);
    ASSERT_FALSE(v.ok()) << bad;
    EXPECT_NE(Msg(v.status()).find("--clip must be a number in [0, 1e+30], got "),
              std::string::npos)
        << Msg(v.status());
    EXPECT_FALSE(f.Double("clip", 0).ok()) << bad;  // the unbounded form refuses them too
  }
  Flags f = MustParse({"--clip=2e30"});
  EXPECT_EQ(Msg(f.Double("clip", 0, 0, 1e30).status()),
            "--clip must be a number in [0, 1e+30], got '2e30'");
  Flags open = MustParse({"--clip=0"});
  EXPECT_EQ(Msg(open.Double("clip", 1, 0, 5, /*min_exclusive=*/true).status()),
            "--clip must be a number in (0, 5], got '0'");
  Flags good = MustParse({"--clip=2.5"});
  EXPECT_DOUBLE_EQ(*good.Double("clip", 0, 0, 5), 2.5);
}

// The values themselves: tests/unit/hyper_params_test.cc (the shared table).
TEST(FlagsHyperParam, NamesTheFlagAndTheRange) {
  for (const char* bad : {"1e39", "nan", "inf", "-1e-4", "abc", ""}) {
    Flags f = MustParse({std::string("--lr=") + bad});
    auto v = f.HyperParam("lr", HyperParameter::kLearningRate, 1e-4);
    ASSERT_FALSE(v.ok()) << bad;
    EXPECT_EQ(Msg(v.status()).rfind("--lr", 0), 0u) << Msg(v.status());
    EXPECT_NE(Msg(v.status()).find("in [0, 3.4028235e+38]"), std::string::npos) << Msg(v.status());
  }
  Flags f = MustParse({"--lr=1e39"});
  EXPECT_EQ(Msg(f.HyperParam("lr", HyperParameter::kLearningRate, 1).status()),
            "--lr: invalid lr 1e+39: must be in [0, 3.4028235e+38] (float32: the kernels compute "
            "in float32)");
  for (const char* good : {"1e-4", "1e30", "3e38", "0.5", "0"}) {
    Flags g = MustParse({std::string("--lr=") + good});
    EXPECT_TRUE(g.HyperParam("lr", HyperParameter::kLearningRate, 1).ok()) << good;
  }
  EXPECT_DOUBLE_EQ(*MustParse({}).HyperParam("lr", HyperParameter::kLearningRate, 1e-4), 1e-4);
}

TEST(FlagsPort, Range) {
  for (const char* bad : {"70000", "65536", "-1", "abc", "", "80.5"}) {
    Flags f = MustParse({std::string("--port=") + bad});
    auto v = f.Port("port", 0);
    ASSERT_FALSE(v.ok()) << bad;
    EXPECT_EQ(Msg(v.status()).rfind("--port must be a port number in [0, 65535], got ", 0), 0u);
  }
  EXPECT_EQ(Msg(MustParse({"--port=70000"}).Port("port", 0).status()),
            "--port must be a port number in [0, 65535], got '70000'");
  EXPECT_EQ(*MustParse({"--port=0"}).Port("port", 1), 0);
  EXPECT_EQ(*MustParse({"--port", "65535"}).Port("port", 0), 65535);
}

TEST(FlagsSeconds, NonFiniteAndRange) {
  for (const char* bad : {"nan", "inf", "abc", "-1", "0", "", "1e9"}) {
    Flags f = MustParse({std::string("--heartbeat-timeout=") + bad});
    auto v = f.Seconds("heartbeat-timeout", 10, 0.1, 86400);
    ASSERT_FALSE(v.ok()) << bad;
    EXPECT_EQ(
        Msg(v.status())
            .rfind("--heartbeat-timeout must be a number of seconds in [0.1, 86400], got ", 0),
        0u)
        << Msg(v.status());
  }
  EXPECT_EQ(Msg(MustParse({"--collective-timeout=abc"})
                    .Seconds("collective-timeout", 120, 0.1, 86400)
                    .status()),
            "--collective-timeout must be a number of seconds in [0.1, 86400], got 'abc'");
  EXPECT_EQ(*MustParse({"--collective-timeout=2.5"}).Seconds("collective-timeout", 120, 0.1, 86400),
            absl::Milliseconds(2500));
  EXPECT_EQ(*MustParse({}).Seconds("collective-timeout", 120, 0.1, 86400), absl::Seconds(120));
  EXPECT_FALSE(
      MustParse({"--collective-timeout=0"}).Seconds("collective-timeout", 1, 0, 10, true).ok());
}

TEST(FlagsBool, Values) {
  EXPECT_TRUE(*MustParse({"--json"}).Bool("json", false));
  EXPECT_TRUE(*MustParse({"--json=yes"}).Bool("json", false));
  EXPECT_FALSE(*MustParse({"--json=false"}).Bool("json", true));
  EXPECT_FALSE(*MustParse({"--json=0"}).Bool("json", true));
  EXPECT_TRUE(*MustParse({}).Bool("json", true));
  EXPECT_EQ(Msg(MustParse({"--json=maybe"}).Bool("json", false).status()),
            "--json must be true or false, got 'maybe'");
}

TEST(FlagsStrings, NonEmptyAndChoice) {
  Flags f = MustParse({"--ckpt-dir=", "--optimizer=adagrad", "--token-file="});
  EXPECT_EQ(Msg(f.NonEmpty("ckpt-dir", "").status()), "--ckpt-dir needs a non-empty value");
  EXPECT_EQ(f.Str("ckpt-dir", "x"), "");  // Str() is raw
  EXPECT_EQ(Msg(f.Choice("optimizer", "adam", {"adam", "adamw", "sgd"}).status()),
            "--optimizer must be one of adam | adamw | sgd, got 'adagrad'");
  EXPECT_EQ(*MustParse({}).NonEmpty("ckpt-dir", "d"), "d");
  EXPECT_EQ(*MustParse({"--optimizer=sgd"}).Choice("optimizer", "adam", {"adam", "sgd"}), "sgd");
}

TEST(FlagsMessages, OneLineAndBounded) {
  Flags f = MustParse({"--steps=a\nb", std::string("--lr=") + std::string(500, '9') + "x"});
  const std::string m1 = Msg(f.Int("steps", 1, 1, 2).status());
  EXPECT_EQ(m1.find('\n'), std::string::npos) << m1;
  const std::string m2 = Msg(f.HyperParam("lr", HyperParameter::kLearningRate, 1).status());
  EXPECT_LT(m2.size(), 200u) << m2;
}

TEST(EnvInt, RangeAndMalformed) {
  ::unsetenv("SHARDOPT_FLAGS_TEST");
  EXPECT_EQ(*EnvInt("SHARDOPT_FLAGS_TEST", 3, 0, 5), 3);
  ::setenv("SHARDOPT_FLAGS_TEST", "abc", 1);
  EXPECT_EQ(Msg(EnvInt("SHARDOPT_FLAGS_TEST", 3, 0, 5).status()),
            "environment variable SHARDOPT_FLAGS_TEST must be an integer in [0, 5], got 'abc'");
  ::setenv("SHARDOPT_FLAGS_TEST", "2147483648", 1);
  EXPECT_FALSE(EnvInt("SHARDOPT_FLAGS_TEST", 3, 0, 1 << 20).ok());
  ::setenv("SHARDOPT_FLAGS_TEST", "4", 1);
  EXPECT_EQ(*EnvInt("SHARDOPT_FLAGS_TEST", 3, 0, 5), 4);
  ::unsetenv("SHARDOPT_FLAGS_TEST");
}

}  // namespace
}  // namespace shardopt
