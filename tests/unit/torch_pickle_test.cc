// The torch.save reader: files written by Debian's python3-torch (1.13) read
// back bitwise as torch.load reads them; LibTorch's pickle_save output too;
// truncated, mutated, hostile and foreign input is an error Status, never a
// crash, a hang or a blow-up.
#include "client/checkpoint/torch_pickle.h"

#include <ATen/ATen.h>
#include <caffe2/serialize/inline_container.h>
#include <malloc.h>
#include <sys/stat.h>
#include <torch/serialize.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"

namespace shardopt {
namespace {

using Kind = PyValue::Kind;
using namespace std::string_literals;

std::string TmpDir() {
  const char* t = std::getenv("TEST_TMPDIR");
  return t != nullptr ? t : "/tmp";
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void WriteFile(const std::string& path, const std::string& data) {
  std::ofstream(path, std::ios::binary)
      .write(data.data(), static_cast<std::streamsize>(data.size()));
}

// The peak resident memory of this process since construction: VmHWM, reset
// to the current RSS through /proc/self/clear_refs.
class PeakRss {
 public:
  PeakRss() {
    malloc_trim(0);
    std::ofstream("/proc/self/clear_refs") << "5";
    base_ = Field("VmRSS:");
    reset_ = Field("VmHWM:") <= base_ + (4 << 20);
  }
  int64_t Growth() const { return Field("VmHWM:") - base_; }
  // False where the kernel cannot reset VmHWM: Growth() is then meaningless.
  bool reset() const { return reset_; }

  // The bound every hostile read must stay within.
  static int64_t Bound(size_t file_bytes) {
    return std::max<int64_t>(int64_t{64} << 20, 16 * static_cast<int64_t>(file_bytes));
  }

 private:
  static int64_t Field(const char* name) {
    std::ifstream in("/proc/self/status");
    std::string line;
    while (std::getline(in, line)) {
      if (line.rfind(name, 0) == 0) return std::atoll(line.c_str() + std::strlen(name)) << 10;
    }
    return -1;
  }
  int64_t base_;
  bool reset_;
};

std::string MiB(int64_t bytes) { return absl::StrCat(bytes >> 20, " MiB"); }

std::string DtypeName(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kLong: return "int64";
    case at::kInt: return "int32";
    case at::kShort: return "int16";
    case at::kChar: return "int8";
    case at::kByte: return "uint8";
    case at::kBool: return "bool";
    default: return "?";
  }
}

// The same flattening as torch_pickle_files.py's flat().
void Flat(const PyValue& v, const std::string& path, std::vector<std::string>* out) {
  switch (v.kind) {
    case Kind::kTensor: {
      const at::Tensor& t = v.tensor;
      EXPECT_TRUE(t.is_contiguous()) << path;
      EXPECT_FALSE(t.requires_grad()) << path;
      const std::string raw(static_cast<const char*>(t.data_ptr()), t.numel() * t.element_size());
      out->push_back(absl::StrCat(path, "\ttensor\t", DtypeName(t.scalar_type()), "\t[",
                                  absl::StrJoin(t.sizes(), ", "), "]\t",
                                  absl::BytesToHexString(raw)));
      return;
    }
    case Kind::kDict:
      out->push_back(absl::StrCat(path, "\tdict\t", v.entries.size()));
      for (const auto& [k, x] : v.entries) {
        std::string key = k->kind == Kind::kString ? "s:" + k->s
                          : k->kind == Kind::kInt  ? absl::StrCat("i:", k->i)
                                                   : "?" + k->Describe();
        Flat(*x, path + "/" + key, out);
      }
      return;
    case Kind::kList:
    case Kind::kTuple:
      out->push_back(
          absl::StrCat(path, v.kind == Kind::kList ? "\tlist\t" : "\ttuple\t", v.items.size()));
      for (size_t i = 0; i < v.items.size(); ++i)
        Flat(*v.items[i], absl::StrCat(path, "/", i), out);
      return;
    case Kind::kNone: out->push_back(path + "\tNone"); return;
    case Kind::kBool: out->push_back(absl::StrCat(path, "\tbool\t", v.b ? 1 : 0)); return;
    case Kind::kInt: out->push_back(absl::StrCat(path, "\tint\t", v.i)); return;
    case Kind::kFloat:
      out->push_back(absl::StrCat(
          path, "\tfloat\t",
          absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(&v.f), 8))));
      return;
    case Kind::kString:
      out->push_back(absl::StrCat(path, "\tstr\t", absl::BytesToHexString(v.s)));
      return;
    case Kind::kBytes:
      out->push_back(absl::StrCat(path, "\tbytes\t", absl::BytesToHexString(v.s)));
      return;
  }
}

std::vector<std::string> Flatten(const PyValue& v) {
  std::vector<std::string> out;
  Flat(v, "", &out);
  return out;
}

// ---------------------------------------------------------------------------
// Files written by Python's torch.save

class PythonFilesTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(TmpDir() + "/torch_pickle_files");
    const std::string log = *dir_ + ".log";
    const std::string cmd =
        absl::StrCat("timeout 120 /usr/bin/python3 tests/testing/torch_pickle_files.py '", *dir_,
                     "' >'", log, "' 2>&1");
    const int rc = std::system(cmd.c_str());
    if (rc != 0) {
      error_ = new std::string(absl::StrCat(
          "writing the torch.save files failed (", cmd, ": status ", rc,
          "; Debian's python3-torch is needed: tools/setup.sh installs it):\n", ReadFile(log)));
    }
  }

  void SetUp() override {
    if (error_ != nullptr) FAIL() << *error_;
  }

  static std::string Path(const std::string& name) { return *dir_ + "/" + name + ".pt"; }

  static PyValuePtr Read(const std::string& name) {
    absl::StatusOr<PyValuePtr> v = ReadTorchFile(Path(name));
    EXPECT_TRUE(v.ok()) << v.status();
    return v.ok() ? *v : nullptr;
  }

  // Reads NAME.pt and compares every value with what torch.load read.
  static PyValuePtr ReadAndCompare(const std::string& name) {
    PyValuePtr v = Read(name);
    if (v == nullptr) return nullptr;
    std::vector<std::string> want = absl::StrSplit(ReadFile(*dir_ + "/" + name + ".expect"), '\n');
    while (!want.empty() && want.back().empty()) want.pop_back();
    const std::vector<std::string> got = Flatten(*v);
    EXPECT_EQ(got.size(), want.size()) << name;
    for (size_t i = 0; i < std::min(got.size(), want.size()); ++i) {
      if (got[i] != want[i]) {
        ADD_FAILURE() << name << " line " << i << ":\n got  " << got[i].substr(0, 300) << "\n want "
                      << want[i].substr(0, 300);
        break;
      }
    }
    return v;
  }

  static std::string* dir_;
  static std::string* error_;
};

std::string* PythonFilesTest::dir_ = nullptr;
std::string* PythonFilesTest::error_ = nullptr;

TEST_F(PythonFilesTest, AdamStateDict) {
  PyValuePtr v = ReadAndCompare("adam");
  ASSERT_NE(v, nullptr);
  const PyValue* state = v->Find("state");
  ASSERT_NE(state, nullptr);
  ASSERT_EQ(state->kind, Kind::kDict);
  EXPECT_EQ(state->entries.size(), 6u);  // 2 Linear x (weight, bias) + BatchNorm (weight, bias)
  const PyValue* s0 = state->Find(int64_t{0});
  ASSERT_NE(s0, nullptr);
  ASSERT_NE(s0->Find("step"), nullptr);
  EXPECT_TRUE(s0->Find("step")->IsNumber());
  EXPECT_EQ(s0->Find("step")->AsDouble(), 2.0);
  EXPECT_EQ(s0->Find("step")->Describe(), "tensor float32 []");
  EXPECT_EQ(s0->Find("exp_avg")->Describe(), "tensor float32 [8, 4]");
  const PyValue* groups = v->Find("param_groups");
  ASSERT_NE(groups, nullptr);
  ASSERT_EQ(groups->kind, Kind::kList);
  ASSERT_EQ(groups->items.size(), 1u);
  const PyValue& g = *groups->items[0];
  EXPECT_EQ(g.Find("lr")->AsDouble(), 1e-3);
  ASSERT_EQ(g.Find("betas")->kind, Kind::kTuple);
  EXPECT_EQ(g.Find("betas")->items[1]->f, 0.999);
  EXPECT_EQ(g.Find("foreach")->kind, Kind::kNone);
  EXPECT_EQ(g.Find("amsgrad")->kind, Kind::kBool);
  ASSERT_EQ(g.Find("params")->items.size(), 6u);
  EXPECT_EQ(g.Find("params")->items[5]->i, 5);
  EXPECT_EQ(g.Find("nope"), nullptr);
  EXPECT_EQ(g.Find(int64_t{0}), nullptr);
  EXPECT_TRUE(std::isnan(g.AsDouble()));
}

TEST_F(PythonFilesTest, AdamWWithTwoParamGroups) {
  PyValuePtr v = ReadAndCompare("adamw");
  ASSERT_NE(v, nullptr);
  const PyValue* groups = v->Find("param_groups");
  ASSERT_NE(groups, nullptr);
  ASSERT_EQ(groups->items.size(), 2u);
  EXPECT_EQ(groups->items[0]->Find("weight_decay")->AsDouble(), 0.01);
  EXPECT_EQ(groups->items[1]->Find("weight_decay")->AsDouble(), 0.0);
  EXPECT_EQ(groups->items[0]->Find("params")->items.size(), 2u);
  EXPECT_EQ(groups->items[1]->Find("params")->items.size(), 4u);
  EXPECT_EQ(v->Find("state")->entries.size(), 6u);
}

TEST_F(PythonFilesTest, SgdWithMomentum) {
  PyValuePtr v = ReadAndCompare("sgd");
  ASSERT_NE(v, nullptr);
  const PyValue* s3 = v->Find("state")->Find(int64_t{3});
  ASSERT_NE(s3, nullptr);
  EXPECT_EQ(s3->Find("momentum_buffer")->Describe(), "tensor float32 [8]");
  EXPECT_EQ(s3->Find("step"), nullptr);
  EXPECT_EQ(v->Find("param_groups")->items[0]->Find("momentum")->AsDouble(), 0.9);
}

TEST_F(PythonFilesTest, ModelStateDictIsAnOrderedDictWithBuffers) {
  PyValuePtr v = ReadAndCompare("model");
  ASSERT_NE(v, nullptr);
  std::vector<std::string> keys;
  for (const auto& [k, x] : v->entries) keys.push_back(k->s);
  EXPECT_EQ(absl::StrJoin(keys, " "),
            "0.weight 0.bias 1.weight 1.bias 1.running_mean 1.running_var 1.num_batches_tracked "
            "3.weight 3.bias");
  EXPECT_EQ(v->Find("1.num_batches_tracked")->Describe(), "tensor int64 []");
  EXPECT_EQ(v->Find("1.num_batches_tracked")->AsDouble(), 2.0);
}

TEST_F(PythonFilesTest, CombinedCheckpoint) {
  PyValuePtr v = ReadAndCompare("combined");
  ASSERT_NE(v, nullptr);
  ASSERT_NE(v->Find("model"), nullptr);
  ASSERT_NE(v->Find("optimizer"), nullptr);
  EXPECT_NE(v->Find("optimizer")->Find("state"), nullptr);
  EXPECT_EQ(v->Find("epoch")->i, 7);
}

TEST_F(PythonFilesTest, ViewSavedAloneIsCopiedOutOfItsStorage) {
  PyValuePtr v = ReadAndCompare("view");
  ASSERT_NE(v, nullptr);
  ASSERT_EQ(v->kind, Kind::kTensor);
  const at::Tensor& t = v->tensor;
  EXPECT_EQ(t.sizes(), at::IntArrayRef({3, 5}));
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_EQ(t.storage_offset(), 0);
  EXPECT_EQ(t.storage().nbytes(), 15u * 4);  // not the 60-element storage
  const float* p = t.data_ptr<float>();
  for (int r = 0; r < 3; ++r) {
    for (int c = 0; c < 5; ++c) EXPECT_EQ(p[r * 5 + c], (r + 1) * 10 + c + 2);
  }
}

TEST_F(PythonFilesTest, ViewsOfOneStorage) {
  PyValuePtr v = ReadAndCompare("views");
  ASSERT_NE(v, nullptr);
  // The same object twice in the pickle is one value; a whole storage is shared.
  EXPECT_EQ(v->Find("whole"), v->Find("again"));
  const at::Tensor& whole = v->Find("whole")->tensor;
  const at::Tensor& t = v->Find("t")->tensor;
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_TRUE(at::equal(t, whole.t()));
  EXPECT_NE(t.data_ptr(), whole.data_ptr());
  EXPECT_EQ(v->Find("expand")->Describe(), "tensor float32 [3, 2]");
  EXPECT_EQ(v->Find("empty")->Describe(), "tensor float32 [0, 3]");
  EXPECT_EQ(v->Find("scalar")->AsDouble(), 3.25);
}

TEST_F(PythonFilesTest, Dtypes) {
  PyValuePtr v = ReadAndCompare("dtypes");
  ASSERT_NE(v, nullptr);
  EXPECT_EQ(v->Find("bf16")->Describe(), "tensor bfloat16 [5, 3]");
  EXPECT_EQ(v->Find("fp16")->Describe(), "tensor float16 [4]");
  EXPECT_EQ(v->Find("i64")->tensor.data_ptr<int64_t>()[0], -(int64_t{1} << 62));
  EXPECT_EQ(v->Find("bf16_slice")->Describe(), "tensor bfloat16 [2, 2]");
}

TEST_F(PythonFilesTest, PythonScalarsAndContainers) {
  PyValuePtr v = ReadAndCompare("scalars");
  ASSERT_NE(v, nullptr);
  EXPECT_EQ(v->Find("device")->s, "cuda:1");
  EXPECT_EQ(v->Find("dtype")->s, "torch.float32");
  EXPECT_EQ(v->Find("bytes")->s, std::string("\x00\xff\x80"
                                             "a",
                                             4));
  EXPECT_EQ(v->Find("ints")->items.back()->i, INT64_MIN);
  EXPECT_EQ(v->Find("big_list")->items.size(), 2500u);
}

TEST_F(PythonFilesTest, SmallStateDict) { ReadAndCompare("small"); }

TEST_F(PythonFilesTest, RefusesWhatItCannotRepresent) {
  auto expect_error = [](const std::string& path, const std::string& part) {
    absl::StatusOr<PyValuePtr> v = ReadTorchFile(path);
    ASSERT_FALSE(v.ok()) << path;
    EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument) << v.status();
    EXPECT_NE(v.status().message().find(path), std::string::npos) << v.status();
    EXPECT_NE(v.status().message().find(part), std::string::npos) << v.status();
    EXPECT_EQ(v.status().message().find('\n'), std::string::npos) << v.status();
  };
  expect_error(Path("set"), "sets are not supported");
  // A class it does not rebuild is read as an opaque object (never imported).
  absl::StatusOr<PyValuePtr> date = ReadTorchFile(Path("date"));
  ASSERT_TRUE(date.ok()) << date.status();
  ASSERT_NE((*date)->Find("d"), nullptr);
  EXPECT_EQ((*date)->Find("d")->kind, PyValue::Kind::kObject);
  EXPECT_EQ((*date)->Find("d")->Describe(), "object of datetime.date (not read)");
  expect_error(Path("legacy"), "_use_new_zipfile_serialization=False");
  expect_error(Path("badversion"), "archive format version 999; this LibTorch reads versions 1 to");
  expect_error(Path("nofolder"), "records are not in a folder");
  expect_error(Path("deflated"), "is compressed (zip method 8)");
  absl::StatusOr<PyValuePtr> v = ReadTorchFile(Path("dirflag"));
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(v.status().code(), absl::StatusCode::kDataLoss) << v.status();
  EXPECT_NE(v.status().message().find("record 'small/data/0' is marked as a directory"),
            std::string::npos)
      << v.status();
}

TEST_F(PythonFilesTest, EveryTruncationIsAnError) {
  for (const std::string name : {"small", "sgd"}) {
    const std::string bytes = ReadFile(Path(name));
    ASSERT_TRUE(ReadTorchBytes(bytes, name).ok());
    for (size_t n = 0; n < bytes.size(); ++n) {
      absl::StatusOr<PyValuePtr> v = ReadTorchBytes(bytes.substr(0, n), name);
      ASSERT_FALSE(v.ok()) << name << " cut to " << n << " bytes";
      EXPECT_TRUE(v.status().code() == absl::StatusCode::kDataLoss ||
                  v.status().code() == absl::StatusCode::kInvalidArgument)
          << v.status();
    }
  }
}

// Random bytes changed in data.pkl (through ParsePickle, storages from the
// real archive) and anywhere in the file: an error or a value, never a crash.
TEST_F(PythonFilesTest, RandomByteFlipsNeverCrash) {
  caffe2::serialize::PyTorchStreamReader reader(Path("adam"));
  auto [pkl_ptr, pkl_len] = reader.getRecord("data.pkl");
  const std::string pkl(static_cast<const char*>(pkl_ptr.get()), pkl_len);
  StorageLoader loader = [&](const std::string& key, at::ScalarType dtype,
                             int64_t numel) -> absl::StatusOr<at::Tensor> {
    if (!reader.hasRecord("data/" + key)) return absl::DataLossError("no record data/" + key);
    auto [ptr, len] = reader.getRecord("data/" + key);
    if (numel < 0 || static_cast<uint64_t>(numel) * c10::elementSize(dtype) != len) {
      return absl::DataLossError("size mismatch");
    }
    if (dtype == at::kBool) return absl::InvalidArgumentError("no bools here");
    return at::from_blob(ptr.get(), {numel}, at::TensorOptions().dtype(dtype)).clone();
  };
  TorchReadLimits limits;
  limits.max_tensor_bytes = 1 << 26;
  ASSERT_TRUE(ParsePickle(pkl, loader, "adam", limits).ok());
  std::mt19937_64 rng(20240611);
  int errors = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    std::string m = pkl;
    const int flips = 1 + static_cast<int>(rng() % 3);
    for (int k = 0; k < flips; ++k) m[rng() % m.size()] = static_cast<char>(rng() % 256);
    absl::StatusOr<PyValuePtr> v = ParsePickle(m, loader, "adam", limits);
    if (!v.ok()) {
      ++errors;
      EXPECT_EQ(v.status().message().find('\n'), std::string::npos) << v.status();
    } else {
      Flatten(**v);  // walk whatever came out
    }
  }
  EXPECT_GT(errors, 400);
  std::cout << "data.pkl flips: " << errors << " of 2000 were errors\n";

  const std::string file = ReadFile(Path("adam"));
  errors = 0;
  for (int trial = 0; trial < 1000; ++trial) {
    std::string m = file;
    const int flips = 1 + static_cast<int>(rng() % 3);
    for (int k = 0; k < flips; ++k) m[rng() % m.size()] = static_cast<char>(rng() % 256);
    absl::StatusOr<PyValuePtr> v = ReadTorchBytes(m, "adam", limits);
    if (!v.ok()) {
      ++errors;
    } else {
      Flatten(**v);
    }
  }
  std::cout << "whole-file flips: " << errors << " of 1000 were errors\n";
}

// torch.save of torch.zeros(1).expand(20000, 20000): a 1 KB file whose
// tensor is a 1.6 GB stride-0 view of a 4-byte storage.
TEST_F(PythonFilesTest, HugeExpandedViewIsRefusedWithinItsBudget) {
  const std::string file = ReadFile(Path("expand_huge"));
  ASSERT_LT(file.size(), 4096u);
  PeakRss peak;
  absl::StatusOr<PyValuePtr> v = ReadTorchFile(Path("expand_huge"));
  const int64_t growth = peak.Growth();
  std::cout << "expand_huge.pt (" << file.size() << " bytes): peak RSS +" << MiB(growth) << ", "
            << v.status() << "\n";
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(v.status().code(), absl::StatusCode::kResourceExhausted) << v.status();
  EXPECT_NE(v.status().message().find(Path("expand_huge") + ": "), std::string::npos);
  EXPECT_NE(v.status().message().find("size [20000, 20000] stride [0, 0]"), std::string::npos)
      << v.status();
  EXPECT_NE(v.status().message().find("memory budget"), std::string::npos) << v.status();
  if (peak.reset()) EXPECT_LT(growth, PeakRss::Bound(file.size()));
  // With a budget that allows it, the copy is made (the reader's tensors are
  // contiguous and own their memory); a smaller expand reads with the defaults.
  TorchReadLimits roomy;
  roomy.base_memory_bytes = int64_t{2} << 30;
  roomy.max_tensor_bytes = 1000;
  v = ReadTorchFile(Path("expand_huge"), roomy);
  ASSERT_FALSE(v.ok());
  EXPECT_NE(v.status().message().find("max_tensor_bytes (1000)"), std::string::npos) << v.status();
  ReadAndCompare("views");
}

TEST_F(PythonFilesTest, Limits) {
  TorchReadLimits small_file;
  small_file.max_file_bytes = 100;
  absl::StatusOr<PyValuePtr> v = ReadTorchFile(Path("sgd"), small_file);
  ASSERT_FALSE(v.ok());
  EXPECT_NE(v.status().message().find("max_file_bytes"), std::string::npos) << v.status();

  TorchReadLimits few_items;
  few_items.max_items = 50;
  v = ReadTorchFile(Path("adam"), few_items);
  ASSERT_FALSE(v.ok());
  EXPECT_NE(v.status().message().find("max_items"), std::string::npos) << v.status();

  TorchReadLimits shallow;
  shallow.max_depth = 4;  // {"param_groups": [{"betas": (0.9, ...)}]} is 5 deep
  v = ReadTorchFile(Path("adam"), shallow);
  ASSERT_FALSE(v.ok());
  EXPECT_NE(v.status().message().find("max_depth"), std::string::npos) << v.status();
  shallow.max_depth = 5;
  EXPECT_TRUE(ReadTorchFile(Path("adam"), shallow).ok());

  TorchReadLimits few_bytes;
  few_bytes.max_tensor_bytes = 64;  // the transposed 6x10 view alone is 240
  v = ReadTorchFile(Path("views"), few_bytes);
  ASSERT_FALSE(v.ok());
  EXPECT_NE(v.status().message().find("max_tensor_bytes"), std::string::npos) << v.status();

  // The memory budget: a multiple of the file's size plus a base.
  const size_t adam_bytes = ReadFile(Path("adam")).size();
  TorchReadLimits no_base;
  no_base.base_memory_bytes = 0;
  no_base.memory_per_file_byte = 1;
  v = ReadTorchFile(Path("adam"), no_base);
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(v.status().code(), absl::StatusCode::kResourceExhausted) << v.status();
  EXPECT_NE(v.status().message().find(Path("adam") + ": data.pkl byte "), std::string::npos)
      << v.status();
  EXPECT_NE(v.status().message().find(absl::StrCat("memory budget of ", adam_bytes,
                                                   " bytes (TorchReadLimits: "
                                                   "memory_per_file_byte 1 x ",
                                                   adam_bytes, " bytes of file")),
            std::string::npos)
      << v.status();
  // A small file of small tensors needs ~20 bytes a byte (the base covers it).
  no_base.memory_per_file_byte = 40;
  EXPECT_TRUE(ReadTorchFile(Path("adam"), no_base).ok());
  TorchReadLimits capped;
  capped.max_memory_bytes = 10000;
  v = ReadTorchFile(Path("adam"), capped);
  ASSERT_FALSE(v.ok());
  EXPECT_NE(v.status().message().find("max_memory_bytes 10000"), std::string::npos) << v.status();
  TorchReadLimits few_per_byte;
  few_per_byte.items_per_pickle_byte = 0;
  v = ReadTorchFile(Path("adam"), few_per_byte);
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(v.status().code(), absl::StatusCode::kResourceExhausted) << v.status();
  EXPECT_NE(v.status().message().find("items_per_pickle_byte 0"), std::string::npos) << v.status();
}

// ---------------------------------------------------------------------------
// LibTorch's torch::pickle_save (our own export format)

TEST(LibTorchFileTest, PickleSaveOfAGenericDict) {
  const at::Tensor exp_avg = at::arange(6, at::kFloat).reshape({2, 3}) / 7;
  const at::Tensor bf = at::randn({3, 2}).to(at::kBFloat16);
  c10::Dict<int64_t, c10::Dict<std::string, at::Tensor>> state;
  c10::Dict<std::string, at::Tensor> st;
  st.insert("step", at::tensor(3.0));
  st.insert("exp_avg", exp_avg);
  state.insert(0, st);
  c10::impl::GenericDict group(c10::StringType::get(), c10::AnyType::get());
  group.insert("lr", 0.5);
  group.insert("foreach", c10::IValue());
  group.insert("nesterov", true);
  group.insert("betas", c10::ivalue::Tuple::create({0.9, 0.99}));
  c10::List<int64_t> params;
  params.push_back(0);
  params.push_back(7000000000LL);
  group.insert("params", params);
  c10::impl::GenericList groups(c10::AnyType::get());
  groups.push_back(group);
  c10::List<std::string> names;
  names.push_back("w");
  c10::Dict<std::string, at::Tensor> named;
  named.insert("w", bf);
  named.insert("w_t", exp_avg.t());
  c10::impl::GenericDict top(c10::StringType::get(), c10::AnyType::get());
  top.insert("state", state);
  top.insert("param_groups", groups);
  top.insert("param_names", names);
  top.insert("params", named);
  const std::vector<char> saved = torch::pickle_save(top);
  const std::string path = TmpDir() + "/pickle_save.pt";
  WriteFile(path, std::string(saved.begin(), saved.end()));

  absl::StatusOr<PyValuePtr> read = ReadTorchFile(path);
  ASSERT_TRUE(read.ok()) << read.status();
  const PyValue& v = **read;
  const PyValue* s0 = v.Find("state")->Find(int64_t{0});
  ASSERT_NE(s0, nullptr);
  EXPECT_EQ(s0->Find("step")->AsDouble(), 3.0);
  EXPECT_TRUE(at::equal(s0->Find("exp_avg")->tensor, exp_avg));
  const PyValue& g = *v.Find("param_groups")->items.at(0);
  EXPECT_EQ(g.Find("lr")->f, 0.5);
  EXPECT_EQ(g.Find("foreach")->kind, Kind::kNone);
  EXPECT_TRUE(g.Find("nesterov")->b);
  EXPECT_EQ(g.Find("betas")->items.at(1)->f, 0.99);
  ASSERT_EQ(g.Find("params")->items.size(), 2u);
  EXPECT_EQ(g.Find("params")->items[1]->i, 7000000000LL);
  EXPECT_EQ(v.Find("param_names")->items.at(0)->s, "w");
  const at::Tensor& w = v.Find("params")->Find("w")->tensor;
  EXPECT_EQ(w.scalar_type(), at::kBFloat16);
  EXPECT_EQ(std::memcmp(w.data_ptr(), bf.data_ptr(), 12), 0);
  EXPECT_TRUE(at::equal(v.Find("params")->Find("w_t")->tensor, exp_avg.t()));
  EXPECT_TRUE(v.Find("params")->Find("w_t")->tensor.is_contiguous());

  const std::string bytes(saved.begin(), saved.end());
  for (size_t n = 0; n < bytes.size(); ++n)
    ASSERT_FALSE(ReadTorchBytes(bytes.substr(0, n), "cut").ok()) << n;
}

// ---------------------------------------------------------------------------
// Hand-made pickles. (Literals with a NUL or a hex escape need the s suffix
// and care: "\x01" "a" is two bytes, "\x01a" one.)

std::string U(const std::string& s) {  // BINUNICODE
  const uint32_t n = static_cast<uint32_t>(s.size());
  return "X" + std::string(reinterpret_cast<const char*>(&n), 4) + s;
}
std::string I8(int64_t v) {
  return "\x8a\x08"s + std::string(reinterpret_cast<const char*>(&v), 8);
}
std::string Le4(int32_t v) { return std::string(reinterpret_cast<const char*>(&v), 4); }
std::string Ints(const std::vector<int64_t>& v) {
  std::string out = "(";
  for (int64_t x : v) out += I8(x);
  return out + "t";
}
std::string Pid(const std::string& cls, const std::string& key, int64_t numel) {
  return "(" + U("storage") + "ctorch\n" + cls + "\n" + U(key) + U("cpu") + I8(numel) + "tQ";
}
std::string Rebuild(const std::string& pid, int64_t offset, const std::vector<int64_t>& sizes,
                    const std::vector<int64_t>& strides) {
  return "ctorch._utils\n_rebuild_tensor_v2\n(" + pid + I8(offset) + Ints(sizes) + Ints(strides) +
         "\x89"
         "ccollections\nOrderedDict\n)R"
         "tR";
}

// Storages are arange(numel); at most a million elements.
absl::StatusOr<at::Tensor> ArangeLoader(const std::string&, at::ScalarType dtype, int64_t numel) {
  if (numel > 1000000) return absl::DataLossError("storage too big for this test");
  return at::arange(numel, at::TensorOptions().dtype(at::kLong)).to(dtype);
}

absl::StatusOr<PyValuePtr> Parse(const std::string& body, const TorchReadLimits& limits = {}) {
  return ParsePickle("\x80\x02"s + body, ArangeLoader, "test.pt", limits);
}

void ExpectError(const std::string& body, const std::string& part,
                 const TorchReadLimits& limits = {}) {
  absl::StatusOr<PyValuePtr> v = Parse(body, limits);
  ASSERT_FALSE(v.ok()) << absl::CHexEscape(body.substr(0, 200));
  EXPECT_TRUE(v.status().code() == absl::StatusCode::kDataLoss ||
              v.status().code() == absl::StatusCode::kInvalidArgument ||
              v.status().code() == absl::StatusCode::kResourceExhausted)
      << v.status();
  EXPECT_NE(v.status().message().find("test.pt: data.pkl byte "), std::string::npos) << v.status();
  EXPECT_NE(v.status().message().find(part), std::string::npos) << v.status();
  EXPECT_EQ(v.status().message().find('\n'), std::string::npos) << v.status();
}

TEST(HandMadeTest, Tensors) {
  const std::string pid = Pid("FloatStorage", "0", 12);
  absl::StatusOr<PyValuePtr> v =
      Parse("(" + Rebuild(pid, 0, {3, 4}, {4, 1}) + Rebuild(pid, 0, {4, 3}, {1, 4}) +
            Rebuild(pid, 5, {2}, {3}) + Rebuild(pid, 2, {3, 2}, {0, 1}) +
            Rebuild(pid, 0, {3, 4}, {4, 1}) + Rebuild(pid, 12, {0}, {1}) + "l.");
  ASSERT_TRUE(v.ok()) << v.status();
  const auto& t = (*v)->items;
  ASSERT_EQ(t.size(), 6u);
  const at::Tensor base = at::arange(12, at::kFloat);
  EXPECT_TRUE(at::equal(t[0]->tensor, base.view({3, 4})));
  EXPECT_TRUE(at::equal(t[1]->tensor, base.view({3, 4}).t()));
  EXPECT_TRUE(at::equal(t[2]->tensor, at::tensor({5.f, 8.f})));
  EXPECT_TRUE(at::equal(t[3]->tensor, at::tensor({2.f, 3.f}).expand({3, 2})));
  EXPECT_EQ(t[5]->Describe(), "tensor float32 [0]");
  for (const auto& x : t) EXPECT_TRUE(x->tensor.is_contiguous());
  EXPECT_EQ(t[0]->tensor.data_ptr(), t[4]->tensor.data_ptr());  // whole storage: shared
  // A bare storage reads as a 1-D tensor.
  v = Parse(Pid("LongStorage", "0", 3) + ".");
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ((*v)->Describe(), "tensor int64 [3]");
  // Parameters are their data.
  v = Parse("ctorch._utils\n_rebuild_parameter\n(" + Rebuild(pid, 0, {12}, {1}) +
            "\x88"
            "}tR.");
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ((*v)->Describe(), "tensor float32 [12]");
  EXPECT_FALSE((*v)->IsNumber());  // 12 elements
  EXPECT_TRUE(std::isnan((*v)->AsDouble()));
}

TEST(HandMadeTest, BadTensors) {
  const std::string pid = Pid("FloatStorage", "0", 12);
  ExpectError(Rebuild(pid, 0, {13}, {1}) + ".", "reaches element 12 of a storage of 12");
  ExpectError(Rebuild(pid, 11, {2}, {1}) + ".", "reaches element 12");
  ExpectError(Rebuild(pid, 0, {3, 5}, {4, 1}) + ".", "reaches element");
  ExpectError(Rebuild(pid, 13, {0}, {1}) + ".", "outside a storage of 12");
  ExpectError(Rebuild(pid, 0, {int64_t{1} << 62, int64_t{1} << 62}, {1, 1}) + ".",
              "size overflows");
  ExpectError(Rebuild(pid, 0, {int64_t{1} << 40, 2}, {int64_t{1} << 40, 1}) + ".", "overflows");
  ExpectError(Rebuild(pid, 0, {2}, {-1}) + ".", "< 0");
  ExpectError(Rebuild(pid, -1, {2}, {1}) + ".", "storage offset");
  ExpectError(Rebuild(pid, 0, {2, 2}, {1}) + ".", "2 sizes but 1 strides");
  ExpectError(Rebuild(pid, 0, std::vector<int64_t>(65, 1), std::vector<int64_t>(65, 1)) + ".",
              "65 dimensions");
  ExpectError(Rebuild("K\x01", 0, {1}, {1}) + ".", "the storage is a int");
  ExpectError(Pid("FloatStorage", "0", 2000000) + ".", "storage too big for this test");
  ExpectError(Pid("FloatStorage", "../x", 2) + ".", "bad storage key");
  ExpectError("(" + Pid("FloatStorage", "0", 2) + Pid("LongStorage", "0", 2) + "t.",
              "referenced as");
  ExpectError(Pid("QInt8Storage", "0", 2) + ".", "storage type is a object of torch.QInt8Storage");
  ExpectError("(" + U("storage") + "K\x01" + U("0") + U("cpu") + "K\x01tQ.",
              "storage type is a int");
  ExpectError("K\x01Q.", "persistent id is a int");
  ExpectError("ctorch._utils\n_rebuild_tensor_v2\n)R.", "takes 6 or 7 arguments, got 0");
  ExpectError("ctorch._utils\n_rebuild_parameter\n(K\x01\x89}tR.", "the data is not a tensor");
  ExpectError("ctorch._utils\n_rebuild_parameter\n(" + Pid("FloatStorage", "0", 2) + "\x89}tR.",
              "the data is not a tensor");
}

TEST(HandMadeTest, Globals) {
  // Globals it does not know are opaque objects: named, never imported or
  // called (a call, a BUILD, items added: all dropped).
  for (const std::string& body :
       {"cos\nsystem\n."s, "\x8c\x02os\x8c\x06system\x93."s,
        "cos\nsystem\n(" + U("touch /tmp/shardopt-pwned") + "tR."s,
        "cos\nsystem\n)\x81}" + U("a") + "K\x01sb."s, "cos\nsystem\n)R(" + U("k") + "K\x01u."s,
        "cos\nsystem\n)R(K\x01"
        "e."s}) {
    absl::StatusOr<PyValuePtr> v = Parse(body);
    ASSERT_TRUE(v.ok()) << v.status() << " " << absl::CHexEscape(body);
    EXPECT_EQ((*v)->kind, PyValue::Kind::kObject);
    EXPECT_EQ((*v)->s, "os.system");
  }
  // As a dict key (by identity) and inside a dict beside data.
  absl::StatusOr<PyValuePtr> mixed =
      Parse("}(" + U("x") + "K\x07" + U("sched") + "cos\nsystem\n)Ru.");
  ASSERT_TRUE(mixed.ok()) << mixed.status();
  EXPECT_EQ((*mixed)->Find("x")->i, 7);
  EXPECT_EQ((*mixed)->Find("sched")->kind, PyValue::Kind::kObject);
  ExpectError("c__builtin__\nset\n.", "sets are not supported");
  ExpectError("cbuiltins\nfrozenset\n.", "sets are not supported");
  ExpectError("ctorch._utils\n_rebuild_tensor_v2\n.",
              "holds the global torch._utils._rebuild_tensor_v2 itself");
  ExpectError("ccollections\nOrderedDict\nK\x01R.", "are a int, not a tuple");
  ExpectError("ccollections\nOrderedDict\n(K\x01tR.", "expected no arguments");
  ExpectError("K\x01)R.", "call of a int");
  ExpectError("ctorch\ndevice\n(K\x01tR.", "expected (type[, index])");
  ExpectError("c_codecs\nencode\n" + U("\xe2\x9c\x93") + U("latin1") + "\x86R.", "not latin-1");
  ExpectError("ctorch\nFloatStorage\n)R.", "only used in persistent ids");
  ExpectError("c" + std::string(300, 'x') + "\nfoo\n.", "text argument too long");
  ExpectError("ccollections\nOrderedDict", "truncated: no end of line");
  ExpectError("ctorch._utils\n_rebuild_tensor_v2\n)\x81.",
              "NEWOBJ of torch._utils._rebuild_tensor_v2");
  ExpectError("K\x01K\x02\x93.", "STACK_GLOBAL of a non-string");
  absl::StatusOr<PyValuePtr> v =
      Parse("ccollections\nOrderedDict\n)\x81q\x00}"s + U("_metadata") + "}sb" +
            "ctorch.jit._pickle\nbuild_intlist\n]K\x07"
            "a\x85R" +
            "ctorch.jit._pickle\nrestore_type_tag\nK\x05" + U("int") + "\x86R" +
            "c_codecs\nencode\n" + U("\xc3\xbf") + U("latin1") + "\x86R" + "ctorch\nbfloat16\n" +
            "ctorch\ndevice\n" + U("cpu") + "\x85R" + "c__builtin__\nbytes\n)R" + "\x87\x87\x87.");
  ASSERT_TRUE(v.ok()) << v.status();
  const std::vector<std::string> want = {
      "\ttuple\t3",
      "/0\tdict\t0",
      "/1\tlist\t1",
      "/1/0\tint\t7",
      "/2\ttuple\t3",
      "/2/0\tint\t5",
      "/2/1\tbytes\tff",
      "/2/2\ttuple\t3",
      "/2/2/0\tstr\t" + absl::BytesToHexString("torch.bfloat16"),
      "/2/2/1\tstr\t" + absl::BytesToHexString("cpu"),
      "/2/2/2\tbytes\t",
  };
  EXPECT_EQ(Flatten(**v), want);
}

TEST(HandMadeTest, Scalars) {
  absl::StatusOr<PyValuePtr> v = Parse(
      "(K\xff"
      "M\xff\xff"
      "J\xff\xff\xff\xff"
      "\x8a\x00"
      "\x8a\x01\x80"
      "\x8a\x09\xff\xff\xff\xff\xff\xff\xff\x7f\x00"
      "\x8b\x02\x00\x00\x00\x00\x80"
      "I42\n"
      "I01\n"
      "L-7L\n"
      "G\x3f\xf0\x00\x00\x00\x00\x00\x00"
      "\x88\x89N"
      "U\x02hi"
      "C\x01\x00"
      "B\x01\x00\x00\x00\x01"
      "\x8c\x01"
      "a"
      "\x8d\x01\x00\x00\x00\x00\x00\x00\x00"
      "b"
      "\x8e\x00\x00\x00\x00\x00\x00\x00\x00"
      "T\x01\x00\x00\x00"
      "c"
      "l."s);
  ASSERT_TRUE(v.ok()) << v.status();
  const auto& x = (*v)->items;
  ASSERT_EQ(x.size(), 21u);
  EXPECT_EQ(x[0]->i, 255);
  EXPECT_EQ(x[1]->i, 65535);
  EXPECT_EQ(x[2]->i, -1);
  EXPECT_EQ(x[3]->i, 0);
  EXPECT_EQ(x[4]->i, -128);
  EXPECT_EQ(x[5]->i, INT64_MAX);
  EXPECT_EQ(x[6]->i, -32768);
  EXPECT_EQ(x[7]->i, 42);
  EXPECT_EQ(x[8]->kind, Kind::kBool);
  EXPECT_TRUE(x[8]->b);
  EXPECT_EQ(x[9]->i, -7);
  EXPECT_EQ(x[10]->f, 1.0);
  EXPECT_TRUE(x[11]->b);
  EXPECT_FALSE(x[12]->b);
  EXPECT_EQ(x[13]->kind, Kind::kNone);
  EXPECT_EQ(x[14]->s, "hi");
  EXPECT_EQ(x[15]->kind, Kind::kBytes);
  EXPECT_EQ(x[15]->s, "\x00"s);
  EXPECT_EQ(x[16]->s, "\x01");
  EXPECT_EQ(x[17]->kind, Kind::kString);
  EXPECT_EQ(x[17]->s, "a");
  EXPECT_EQ(x[18]->s, "b");
  EXPECT_EQ(x[19]->kind, Kind::kBytes);
  EXPECT_EQ(x[19]->s, "");
  EXPECT_EQ(x[20]->s, "c");
  for (const auto& item : x) {
    if (item->kind == Kind::kInt || item->kind == Kind::kFloat || item->kind == Kind::kBool) {
      EXPECT_TRUE(item->IsNumber());
    }
  }
  EXPECT_EQ(x[7]->AsDouble(), 42.0);
  ExpectError("\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x80\x00."s, "does not fit in 64 bits");
  ExpectError("\x8a\x09\xff\xff\xff\xff\xff\xff\xff\x7f\xff."s, "does not fit in 64 bits");
  ExpectError("\x8b\xff\xff\xff\xff."s, "negative LONG4 length");
  ExpectError("I99999999999999999999\n.", "bad or too large integer");
}

TEST(HandMadeTest, Dicts) {
  // Equal keys share an entry (1 == True), the later value wins, order is kept.
  absl::StatusOr<PyValuePtr> v =
      Parse("}(K\x02U\x01xK\x01K\x0a\x88K\x0bK\x02U\x01yu" + U("k") + "Ns.");
  ASSERT_TRUE(v.ok()) << v.status();
  ASSERT_EQ((*v)->entries.size(), 3u);
  EXPECT_EQ((*v)->Find(int64_t{2})->s, "y");
  EXPECT_EQ((*v)->Find(int64_t{1})->i, 11);
  EXPECT_EQ((*v)->entries[1].first->kind, Kind::kInt);
  EXPECT_EQ((*v)->Find("k")->kind, Kind::kNone);
  v = Parse(
      "(K\x01K\x02K\x03K\x04"
      "d.");
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ((*v)->Find(int64_t{3})->i, 4);
  ExpectError("}]K\x01s.", "unhashable list as a dict key");
  ExpectError(
      "(K\x01"
      "d.",
      "odd number");
  ExpectError("}K\x01u.", "no MARK");
  ExpectError("}(K\x01u.", "odd number");
  ExpectError("}K\x01K\x02K\x03s.", "SETITEM on a int");
  ExpectError("}}b.", "BUILD (setting the state) of a dict");
  ExpectError("]}b.", "BUILD (setting the state) of a list");
}

TEST(HandMadeTest, StackAndMemoMisuse) {
  ExpectError("", "truncated: the pickle ends before its STOP");
  ExpectError(".", "stack underflow");
  ExpectError("a.", "stack underflow");
  ExpectError("]K\x01(a.", "stack underflow");  // the list is below the MARK
  ExpectError("K\x01(e.", "APPENDS on a int");
  ExpectError(
      ")K\x01"
      "a.",
      "APPEND on a tuple");
  ExpectError("t.", "no MARK");
  ExpectError("1.", "no MARK");
  ExpectError("h\x05.", "memo entry 5 was never stored");
  ExpectError("j\x00\x00\x00\x80."s, "memo entry 2147483648");
  ExpectError("q\x00."s, "stack underflow");
  ExpectError("\x85.", "stack underflow");
  ExpectError("K\x01\x86.", "stack underflow");
  ExpectError("2.", "stack underflow");
  ExpectError("NN.", "STOP leaves 1 values");
  ExpectError("(N.", "MARKs on the stack");
  ExpectError("N.x", "1 bytes follow STOP");
  ExpectError(
      "X\x05\x00\x00\x00"
      "ab"s,
      "truncated: needs 5 bytes, 2 left");
  ExpectError("\x8d\xff\xff\xff\xff\xff\xff\xff\xff", "truncated");
  ExpectError("X\x02\x00\x00\x00\xff\xfe."s, "not valid UTF-8");
  ExpectError("X\x03\x00\x00\x00\xe0\x80\x80."s, "not valid UTF-8");  // overlong
  ExpectError("\xff", "byte 2 (opcode 0xff): unknown pickle opcode");
  ExpectError("P0\n.", "(PERSID): unsupported pickle opcode");
  ExpectError("\x8f.", "sets are not supported");
  ExpectError("\x80\x06.", "pickle protocol 6");
  ExpectError("\x95\xff\x00\x00\x00\x00\x00\x00\x00N."s, "frame runs past");
  // POP / POP_MARK / DUP / memo / FRAME / MEMOIZE as Python has them.
  absl::StatusOr<PyValuePtr> v = Parse(
      "\x95\x02\x00\x00\x00\x00\x00\x00\x00"
      "K\x01"
      "(K\x02K\x03"
      "1"
      "0"
      "(0"
      "(]\x94"
      "2"
      "h\x00"
      "r\x07\x00\x00\x00"
      "j\x07\x00\x00\x00"
      "t."s);
  ASSERT_TRUE(v.ok()) << v.status();
  ASSERT_EQ((*v)->items.size(), 4u);
  EXPECT_EQ((*v)->items[0], (*v)->items[3]);
}

std::string Repeat(const std::string& s, int n) {
  std::string out;
  out.reserve(s.size() * n);
  for (int k = 0; k < n; ++k) out += s;
  return out;
}

TEST(HandMadeTest, DeepNestingAndCycles) {
  constexpr int kN = 1000000;
  // A million lists from 2 MB of pickle are over the default memory budget
  // (~350 bytes a list against 8 a byte); with room for them, what follows
  // checks that depth, not the C++ stack, is the limit.
  ExpectError(Repeat("]", kN) + Repeat("a", kN - 1) + ".", "memory budget");
  TorchReadLimits roomy;
  roomy.memory_per_file_byte = 1024;
  // A million nested lists, built with APPEND (no MARK involved).
  ExpectError(Repeat("]", kN) + Repeat("a", kN - 1) + ".", "nested deeper than max_depth (1000)",
              roomy);
  // ... and with MARK + APPENDS / LIST.
  ExpectError(Repeat("(]", kN) + Repeat("e", kN) + ".", "nested MARKs");
  ExpectError(Repeat("(", kN) + Repeat("l", kN) + ".", "nested MARKs");
  // The same chain built and thrown away: freed without deep recursion.
  absl::StatusOr<PyValuePtr> v = Parse(Repeat("]", kN) + Repeat("a", kN - 1) + "0N.", roomy);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ((*v)->kind, Kind::kNone);
  // Nesting built inside-out through the memo (stale depths) is still caught.
  std::string inside_out;
  for (int k = 0; k < 5000; ++k) inside_out += "]r" + Le4(k) + "0";
  for (int k = 0; k + 1 < 5000; ++k) inside_out += "j" + Le4(k) + "j" + Le4(k + 1) + "a0";
  ExpectError(inside_out + "j" + Le4(0) + ".", "nested deeper than max_depth");
  // Cycles.
  ExpectError(
      "]q\x00h\x00"
      "a."s,
      "reference cycle");
  ExpectError("}q\x00K\x01h\x00s."s, "reference cycle");
  ExpectError(
      "]q\x00]q\x01h\x00"
      "a0h\x01"
      "a."s,
      "reference cycle");
  // Depth is counted exactly: [[1]] is 3 deep.
  TorchReadLimits three;
  three.max_depth = 3;
  EXPECT_TRUE(Parse("]]K\x01"
                    "aa.",
                    three)
                  .ok());
  EXPECT_FALSE(Parse("]]]K\x01"
                     "aaa.",
                     three)
                   .ok());
  // ... also through a shared value reached at two depths.
  EXPECT_FALSE(Parse("]q\x00K\x01"
                     "a]]h\x00"
                     "aa\x86."s,
                     three)
                   .ok());
  // A DAG with 2^60 paths is fine, and fast.
  std::string dag =
      "]K\x01"
      "a";
  for (int k = 0; k < 60; ++k) dag += "2\x86";
  EXPECT_TRUE(Parse(dag + ".").ok());
  TorchReadLimits few;
  few.max_items = 1000;
  v = Parse(Repeat("N", 2000) + ".", few);
  ASSERT_FALSE(v.ok());
  EXPECT_NE(v.status().message().find("max_items"), std::string::npos) << v.status();
}

// ---------------------------------------------------------------------------
// Hostile files: what reading one costs is bounded by what it holds. Each is
// a real zip (PyTorchStreamWriter, as torch.save writes them) read through
// ReadTorchBytes; the peak RSS growth must stay under
// max(64 MiB, 16 x the file's size).

// A torch.save archive holding data.pkl (PROTO 2 + body) and the storages.
std::string TorchZip(const std::string& body,
                     const std::vector<std::pair<std::string, std::string>>& storages = {}) {
  const std::string pkl = "\x80\x02"s + body;
  std::string out;
  {
    caffe2::serialize::PyTorchStreamWriter writer([&out](const void* p, size_t n) {
      out.append(static_cast<const char*>(p), n);
      return n;
    });
    writer.writeRecord("data.pkl", pkl.data(), pkl.size());
    for (const auto& [key, bytes] : storages) {
      writer.writeRecord("data/" + key, bytes.data(), bytes.size());
    }
    writer.writeEndOfFile();
  }
  return out;
}

std::string Floats(int n) {
  std::string out;
  for (int k = 0; k < n; ++k) {
    const float f = static_cast<float>(k);
    out.append(reinterpret_cast<const char*>(&f), 4);
  }
  return out;
}

// Reads `file` as NAME, prints what it cost, and checks that it is refused
// with an error naming the file and containing `part`, within the bound.
void ExpectRefusedWithinBound(const std::string& name, const std::string& file,
                              const std::string& part) {
  PeakRss peak;
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<PyValuePtr> v = ReadTorchBytes(file, name);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const int64_t growth = peak.Growth();
  std::cout << name << " (" << file.size() << " bytes): peak RSS +" << MiB(growth) << " (bound "
            << MiB(PeakRss::Bound(file.size())) << "), " << seconds << " s: " << v.status() << "\n";
  ASSERT_FALSE(v.ok()) << name;
  const absl::StatusCode code = v.status().code();
  EXPECT_TRUE(code == absl::StatusCode::kResourceExhausted ||
              code == absl::StatusCode::kInvalidArgument || code == absl::StatusCode::kDataLoss)
      << v.status();
  EXPECT_EQ(v.status().message().rfind(name + ": ", 0), 0u) << v.status();
  EXPECT_NE(v.status().message().find(part), std::string::npos) << v.status();
  EXPECT_EQ(v.status().message().find('\n'), std::string::npos) << v.status();
  if (peak.reset()) {
    EXPECT_LT(growth, PeakRss::Bound(file.size())) << name;
  }
  EXPECT_LT(seconds, 10.0) << name;
}

TEST(HostileFileTest, StrideZeroViews) {
  const std::string one = Pid("FloatStorage", "0", 1);
  // One 4-byte float seen as 20000 x 20000 (1.6 GB), from a ~1 KB file.
  ExpectRefusedWithinBound(
      "stride0.pt", TorchZip(Rebuild(one, 0, {20000, 20000}, {0, 0}) + ".", {{"0", Floats(1)}}),
      "a copy of the view size [20000, 20000] stride [0, 0] offset 0 of a "
      "storage of 1 float32 (1600000000 bytes) would take more than the "
      "memory budget");
  // 64 views of 16 MiB each: each alone fits the budget, together they do not.
  ExpectRefusedWithinBound(
      "stride0_many.pt",
      TorchZip("(" + Repeat(Rebuild(one, 0, {2048, 2048}, {0, 0}), 64) + "l.", {{"0", Floats(1)}}),
      "memory budget");
  // With a budget for them, such views are copied out (contiguous, owning).
  absl::StatusOr<PyValuePtr> v = ReadTorchBytes(
      TorchZip(Rebuild(one, 0, {512, 512}, {0, 0}) + ".", {{"0", Floats(1)}}), "small_expand.pt");
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ((*v)->Describe(), "tensor float32 [512, 512]");
  EXPECT_TRUE((*v)->tensor.is_contiguous());
}

TEST(HostileFileTest, HugeDeclaredSizeOfATinyStorage) {
  const std::string one = Pid("FloatStorage", "0", 1);
  const std::vector<std::pair<std::string, std::string>> record = {{"0", Floats(1)}};
  // A few hundred bytes asking for 16 GiB.
  ExpectRefusedWithinBound("size16g.pt",
                           TorchZip(Rebuild(one, 0, {int64_t{1} << 32}, {0}) + ".", record),
                           "(17179869184 bytes) would take more than the memory budget");
  ExpectRefusedWithinBound(
      "size2e62.pt",
      TorchZip(Rebuild(one, 0, {int64_t{1} << 31, int64_t{1} << 31}, {0, 0}) + ".", record),
      "max_tensor_bytes");
  // Sizes and strides must fit inside the storage's real length.
  ExpectRefusedWithinBound("stride1.pt",
                           TorchZip(Rebuild(one, 0, {int64_t{1} << 32}, {1}) + ".", record),
                           "reaches element 4294967295 of a storage of 1");
  ExpectRefusedWithinBound("offset.pt", TorchZip(Rebuild(one, 1, {1}, {1}) + ".", record),
                           "reaches element 1 of a storage of 1");
}

TEST(HostileFileTest, StorageDeclaredLargerThanItsRecord) {
  const std::vector<std::pair<std::string, std::string>> record = {{"0", Floats(1)}};
  for (const int64_t numel :
       {int64_t{2}, int64_t{1} << 22, int64_t{1} << 32, int64_t{1} << 40, INT64_MAX}) {
    ExpectRefusedWithinBound("storage.pt", TorchZip(Pid("FloatStorage", "0", numel) + ".", record),
                             absl::StrCat("record data/0 holds 4 bytes, not ", numel, " float32"));
  }
  // A record smaller than its declaration by a few bytes, or missing.
  ExpectRefusedWithinBound("storage.pt",
                           TorchZip(Pid("DoubleStorage", "0", 1) + ".", {{"0", Floats(3)}}),
                           "record data/0 holds 12 bytes, not 1 float64");
  ExpectRefusedWithinBound("storage.pt", TorchZip(Pid("FloatStorage", "1", 1) + ".", record),
                           "no record data/1");
}

TEST(HostileFileTest, ManyEmptyDicts) {
  // 20 MB of EMPTY_DICT: 20 million dicts (4.7 GB and 14 s before the budget).
  constexpr int kN = 20000000;
  ExpectRefusedWithinBound("dicts.pt", TorchZip("](" + std::string(kN, '}') + "e."),
                           "memory budget");
  // ... each appended as it is made, each memoized, each a dict's value.
  ExpectRefusedWithinBound("dicts_append.pt", TorchZip("]" + Repeat("}a", kN / 2) + "."),
                           "memory budget");
  ExpectRefusedWithinBound("dicts_memo.pt", TorchZip("](" + Repeat("}\x94", kN / 2) + "e."),
                           "memory budget");
  std::string keyed = "}(";
  for (int k = 0; k < kN / 8; ++k) keyed += "J" + Le4(k) + "}\x85";
  ExpectRefusedWithinBound("dicts_keyed.pt", TorchZip(keyed + "u."), "memory budget");
}

TEST(HostileFileTest, ManyItems) {
  constexpr int kN = 24000000;
  // Shared values (None, the memo, DUP) cost a slot each, no value.
  ExpectRefusedWithinBound("nones.pt", TorchZip("](" + std::string(kN, 'N') + "e."),
                           "memory budget");
  ExpectRefusedWithinBound("nones_append.pt", TorchZip("]" + Repeat("Na", kN / 2) + "."),
                           "memory budget");
  ExpectRefusedWithinBound("gets.pt", TorchZip("N\x94(" + Repeat("h\x00"s, kN / 2) + "l."),
                           "memory budget");
  ExpectRefusedWithinBound("dups.pt", TorchZip("(N" + std::string(kN, '2') + "l."),
                           "memory budget");
  // Distinct values: ints, floats, strings.
  std::string ints = "](";
  for (int k = 0; k < kN / 5; ++k) ints += "J" + Le4(k * 7 + 1000);
  ExpectRefusedWithinBound("ints.pt", TorchZip(ints + "e."), "memory budget");
  ExpectRefusedWithinBound(
      "floats.pt", TorchZip("](" + Repeat("G\x3f\xf0\x00\x00\x00\x00\x00\x00"s, kN / 9) + "e."),
      "memory budget");
  ExpectRefusedWithinBound(
      "strings.pt", TorchZip("](" + Repeat("\x8c\x10" + std::string(16, 's'), kN / 18) + "e."),
      "memory budget");
  // The memo: a new entry per byte.
  ExpectRefusedWithinBound("memo.pt", TorchZip("N" + std::string(kN, '\x94') + "."),
                           "memory budget");
  // Long global names through the memo (one value per name: only the
  // distinct ones cost), and opaque objects made from them.
  const std::string module = std::string(256, 'm');
  std::string globals = U(module) + "\x94(";
  for (int k = 0; k < 100000; ++k) {
    globals += "h\x00"s + U(absl::StrCat(std::string(240, 'n'), k)) + "\x93";
  }
  ExpectRefusedWithinBound("globals.pt", TorchZip(globals + "l."), "memory budget");
  ExpectRefusedWithinBound("objects.pt",
                           TorchZip("c" + module + "\n" + std::string(256, 'n') + "\n\x94(" +
                                    Repeat("h\x00)R"s, kN / 4) + "l."),
                           "memory budget");
  // A tensor per 20 bytes, all views of one storage.
  std::string tensors = "ctorch._utils\n_rebuild_tensor_v2\n\x94" + Pid("FloatStorage", "0", 4) +
                        "\x94" + Ints({2}) + "\x94" + Ints({1}) + "\x94" + "}\x94(";
  for (int k = 0; k < kN / 16; ++k) tensors += "h\x00(h\x01K\x01h\x02h\x03\x89h\x04tR"s;
  ExpectRefusedWithinBound("tensors.pt", TorchZip(tensors + "l.", {{"0", Floats(4)}}),
                           "memory budget");
}

TEST(HostileFileTest, DeepNesting) {
  constexpr int kN = 1000000;
  ExpectRefusedWithinBound("lists.pt", TorchZip(Repeat("]", kN) + Repeat("a", kN - 1) + "."),
                           "memory budget");
  ExpectRefusedWithinBound("marks.pt", TorchZip(Repeat("(", kN) + Repeat("l", kN) + "."),
                           "more than max_depth (1000) nested MARKs");
  ExpectRefusedWithinBound("tuples.pt", TorchZip("N" + std::string(kN, '\x85') + "."),
                           "memory budget");
  ExpectRefusedWithinBound(
      "dicts.pt", TorchZip(Repeat("}K\x00"s, kN / 3) + "N" + std::string(kN / 3, 's') + "."),
      "memory budget");
  // Within the budget, depth is the limit.
  ExpectRefusedWithinBound("lists2000.pt", TorchZip(Repeat("]", 2000) + Repeat("a", 1999) + "."),
                           "nested deeper than max_depth (1000)");
}

// A small valid file mutated a few hundred ways (bytes flipped, cut short,
// its pickle's sizes, strides, offsets and storage sizes changed, its zip
// sizes changed, its records resized): every read succeeds or fails cleanly,
// and none costs more than the bound.
TEST(HostileFileTest, MutationsOfAValidFileStayBounded) {
  const std::string w = Pid("FloatStorage", "0", 12);
  const std::string e = Pid("FloatStorage", "1", 2);
  const std::string body = "}(" + U("w") + Rebuild(w, 0, {3, 4}, {4, 1}) + U("t") +
                           Rebuild(w, 0, {4, 3}, {1, 4}) + U("row") + Rebuild(w, 4, {4}, {1}) +
                           U("e") + Rebuild(e, 0, {3, 2}, {0, 1}) + U("step") +
                           Rebuild(Pid("LongStorage", "2", 1), 0, {}, {}) + U("l") +
                           "(K\x01M\x2c\x01J\xfb\xff\xff\xffG\x40\x04\x00\x00\x00\x00\x00\x00l"s +
                           U("s") + U("state") + "u.";
  int64_t one = 7;
  const std::vector<std::pair<std::string, std::string>> records = {
      {"0", Floats(12)}, {"1", Floats(2)}, {"2", std::string(reinterpret_cast<char*>(&one), 8)}};
  const std::string valid = TorchZip(body, records);
  absl::StatusOr<PyValuePtr> v = ReadTorchBytes(valid, "valid.pt");
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ((*v)->entries.size(), 7u);
  EXPECT_EQ((*v)->Find("e")->Describe(), "tensor float32 [3, 2]");
  EXPECT_EQ((*v)->Find("step")->AsDouble(), 7.0);
  EXPECT_TRUE(at::equal((*v)->Find("t")->tensor, at::arange(12, at::kFloat).view({3, 4}).t()));

  std::vector<size_t> ints;  // where the pickle's 8-byte ints are (numels, offsets, sizes, strides)
  for (size_t p = body.find("\x8a\x08"); p != std::string::npos; p = body.find("\x8a\x08", p + 1)) {
    ints.push_back(p + 2 + 2);  // + PROTO
  }
  ASSERT_GE(ints.size(), 20u);
  const std::vector<int64_t> values = {0,
                                       1,
                                       2,
                                       3,
                                       5,
                                       11,
                                       12,
                                       13,
                                       4096,
                                       int64_t{1} << 20,
                                       int64_t{1} << 31,
                                       int64_t{1} << 32,
                                       int64_t{1} << 40,
                                       int64_t{1} << 62,
                                       -1,
                                       INT64_MIN,
                                       INT64_MAX};
  std::mt19937_64 rng(28);
  int ok = 0, errors = 0;
  int64_t worst = 0;
  PeakRss peak;
  for (int trial = 0; trial < 400; ++trial) {
    std::string m;
    switch (trial % 5) {
      case 0: {  // flipped bytes anywhere
        m = valid;
        for (int k = 1 + static_cast<int>(rng() % 4); k > 0; --k) {
          m[rng() % m.size()] = static_cast<char>(rng());
        }
        break;
      }
      case 1:  // cut short
        m = valid.substr(0, rng() % valid.size());
        break;
      case 2: {  // a size, stride, offset or numel of the pickle changed
        std::string pkl = "\x80\x02"s + body;
        const int64_t x = rng() % 4 ? values[rng() % values.size()] : static_cast<int64_t>(rng());
        std::memcpy(&pkl[ints[rng() % ints.size()]], &x, 8);
        m = TorchZip(pkl.substr(2), records);
        break;
      }
      case 3: {  // a size of the zip changed (local header or central directory)
        m = valid;
        std::vector<size_t> fields;
        for (size_t p = m.find("PK\x03\x04"); p != std::string::npos;
             p = m.find("PK\x03\x04", p + 1)) {
          if (p + 26 <= m.size()) fields.push_back(p + 18), fields.push_back(p + 22);
        }
        for (size_t p = m.find("PK\x01\x02"); p != std::string::npos;
             p = m.find("PK\x01\x02", p + 1)) {
          if (p + 28 <= m.size()) fields.push_back(p + 20), fields.push_back(p + 24);
        }
        const uint32_t sizes[] = {0,  1,  3,          4,          47,
                                  48, 49, 0x7FFFFFFF, 0xFFFFFFFF, static_cast<uint32_t>(rng())};
        const uint32_t x = sizes[rng() % 10];
        std::memcpy(&m[fields[rng() % fields.size()]], &x, 4);
        break;
      }
      default: {  // a storage record resized (shorter or longer)
        auto resized = records;
        std::string& r = resized[rng() % resized.size()].second;
        r.resize(rng() % 2 ? rng() % r.size() : r.size() + 1 + rng() % 64);
        m = TorchZip(body, resized);
        break;
      }
    }
    v = ReadTorchBytes(m, "mutant.pt");
    if (v.ok()) {
      ++ok;
      Flatten(**v);
    } else {
      ++errors;
      const absl::StatusCode code = v.status().code();
      EXPECT_TRUE(code == absl::StatusCode::kDataLoss ||
                  code == absl::StatusCode::kInvalidArgument ||
                  code == absl::StatusCode::kResourceExhausted)
          << v.status();
      EXPECT_EQ(v.status().message().rfind("mutant.pt: ", 0), 0u) << v.status();
      EXPECT_EQ(v.status().message().find('\n'), std::string::npos) << v.status();
    }
    v = absl::UnknownError("dropped");
    worst = std::max(worst, peak.Growth());
  }
  std::cout << "mutations: " << ok << " read, " << errors << " refused; peak RSS +" << MiB(worst)
            << "\n";
  EXPECT_GT(errors, 200);
  if (peak.reset()) EXPECT_LT(worst, PeakRss::Bound(valid.size()));
}

// ---------------------------------------------------------------------------
// Files that are not torch.save zips

TEST(ForeignFileTest, Refused) {
  const std::string dir = TmpDir();
  WriteFile(dir + "/text.pt", "hello, not a checkpoint\n");
  WriteFile(dir + "/empty.pt", "");
  WriteFile(dir + "/fakezip.pt", "PK\x03\x04" + std::string(200, 'z'));
  WriteFile(dir + "/pickle.pt", "\x80\x02}q\x00."s);
  mkdir((dir + "/adir.pt").c_str(), 0755);
  struct Case {
    std::string name;
    absl::StatusCode code;
    std::string part;
  };
  for (const Case& c : std::vector<Case>{
           {"text.pt", absl::StatusCode::kInvalidArgument, "not a zip archive"},
           {"empty.pt", absl::StatusCode::kInvalidArgument, "empty file"},
           {"fakezip.pt", absl::StatusCode::kDataLoss, "no zip end-of-central-directory record"},
           {"pickle.pt", absl::StatusCode::kInvalidArgument, "not a zip archive"},
           {"adir.pt", absl::StatusCode::kInvalidArgument, "not a regular file"},
           {"missing.pt", absl::StatusCode::kNotFound, "no such file"},
       }) {
    absl::StatusOr<PyValuePtr> v = ReadTorchFile(dir + "/" + c.name);
    ASSERT_FALSE(v.ok()) << c.name;
    EXPECT_EQ(v.status().code(), c.code) << v.status();
    EXPECT_NE(v.status().message().find(dir + "/" + c.name + ": "), std::string::npos)
        << v.status();
    EXPECT_NE(v.status().message().find(c.part), std::string::npos) << v.status();
  }
}

// A zip whose record is deflate-compressed (not what torch.save writes) is
// refused before miniz would allocate its declared size.
TEST(ForeignFileTest, CompressedRecordRefused) {
  std::string zip;
  auto le = [&](uint64_t v, int n) {
    for (int k = 0; k < n; ++k) zip.push_back(static_cast<char>(v >> (8 * k)));
  };
  const std::string name = "a/data.pkl";
  // Local header: sig, version, flags, method 8, time+date, crc, sizes 2 / ~4 GiB, name.
  le(0x04034b50, 4), le(20, 2), le(0, 2), le(8, 2), le(0, 4), le(0, 4), le(2, 4),
      le(0xFFFFFFF0u, 4);
  le(name.size(), 2), le(0, 2);
  zip += name + "\x03"s + "\x00"s;
  const uint64_t cd = zip.size();
  le(0x02014b50, 4), le(20, 2), le(20, 2), le(0, 2), le(8, 2), le(0, 4), le(0, 4), le(2, 4),
      le(0xFFFFFFF0u, 4);
  le(name.size(), 2), le(0, 2), le(0, 2), le(0, 2), le(0, 2), le(0, 4), le(0, 4);
  zip += name;
  const uint64_t cd_size = zip.size() - cd;
  le(0x06054b50, 4), le(0, 2), le(0, 2), le(1, 2), le(1, 2), le(cd_size, 4), le(cd, 4), le(0, 2);
  absl::StatusOr<PyValuePtr> v = ReadTorchBytes(zip, "deflated.pt");
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument) << v.status();
  EXPECT_NE(v.status().message().find("is compressed"), std::string::npos) << v.status();
}

}  // namespace
}  // namespace shardopt
