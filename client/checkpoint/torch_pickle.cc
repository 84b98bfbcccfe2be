#include "client/checkpoint/torch_pickle.h"

#include <ATen/ATen.h>
#include <c10/core/Storage.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <unordered_map>
#include <unordered_set>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/checkpoint/zip_reader.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "torch.save writes little-endian storages, which this reader uses as they are");

#define TP_RETURN_IF_ERROR(expr)             \
  do {                                       \
    ::absl::Status tp_status_ = (expr);      \
    if (!tp_status_.ok()) return tp_status_; \
  } while (0)
#define TP_CONCAT_INNER_(a, b) a##b
#define TP_CONCAT_(a, b) TP_CONCAT_INNER_(a, b)
#define TP_ASSIGN_OR_RETURN(lhs, expr) \
  TP_ASSIGN_OR_RETURN_IMPL_(TP_CONCAT_(tp_statusor_, __LINE__), lhs, expr)
#define TP_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                              \
  if (!tmp.ok()) return tmp.status();             \
  lhs = std::move(tmp).value()

namespace shardopt {

// ---------------------------------------------------------------------------
// PyValue

namespace {

struct DtypeInfo {
  c10::ScalarType type;
  const char* name;     // as torch prints it: torch.float32
  const char* storage;  // the legacy typed storage class: torch.FloatStorage
};

constexpr DtypeInfo kDtypes[] = {
    {c10::ScalarType::Float, "float32", "FloatStorage"},
    {c10::ScalarType::Double, "float64", "DoubleStorage"},
    {c10::ScalarType::Half, "float16", "HalfStorage"},
    {c10::ScalarType::BFloat16, "bfloat16", "BFloat16Storage"},
    {c10::ScalarType::Long, "int64", "LongStorage"},
    {c10::ScalarType::Int, "int32", "IntStorage"},
    {c10::ScalarType::Short, "int16", "ShortStorage"},
    {c10::ScalarType::Char, "int8", "CharStorage"},
    {c10::ScalarType::Byte, "uint8", "ByteStorage"},
    {c10::ScalarType::Bool, "bool", "BoolStorage"},
    {c10::ScalarType::ComplexFloat, "complex64", "ComplexFloatStorage"},
    {c10::ScalarType::ComplexDouble, "complex128", "ComplexDoubleStorage"},
};

std::string DtypeName(c10::ScalarType t) {
  for (const DtypeInfo& d : kDtypes) {
    if (d.type == t) return d.name;
  }
  return c10::toString(t);
}

}  // namespace

const PyValue* PyValue::Find(const std::string& key) const {
  if (kind != Kind::kDict) return nullptr;
  for (const auto& [k, v] : entries) {
    if (k->kind == Kind::kString && k->s == key) return v.get();
  }
  return nullptr;
}

const PyValue* PyValue::Find(int64_t key) const {
  if (kind != Kind::kDict) return nullptr;
  for (const auto& [k, v] : entries) {
    if (k->kind == Kind::kInt && k->i == key) return v.get();
  }
  return nullptr;
}

bool PyValue::IsNumber() const {
  switch (kind) {
    case Kind::kBool:
    case Kind::kInt:
    case Kind::kFloat: return true;
    case Kind::kTensor: return tensor.defined() && tensor.numel() == 1 && !tensor.is_complex();
    default: return false;
  }
}

double PyValue::AsDouble() const {
  switch (kind) {
    case Kind::kBool: return b ? 1.0 : 0.0;
    case Kind::kInt: return static_cast<double>(i);
    case Kind::kFloat: return f;
    case Kind::kTensor:
      if (IsNumber()) return tensor.item<double>();
      break;
    default: break;
  }
  return std::numeric_limits<double>::quiet_NaN();
}

std::string PyValue::Describe() const {
  switch (kind) {
    case Kind::kNone: return "None";
    case Kind::kBool: return "bool";
    case Kind::kInt: return "int";
    case Kind::kFloat: return "float";
    case Kind::kString: return "str";
    case Kind::kBytes: return "bytes";
    case Kind::kList: return "list";
    case Kind::kTuple: return "tuple";
    case Kind::kDict: return "dict";
    case Kind::kObject: return absl::StrCat("object of ", s, " (not read)");
    case Kind::kTensor:
      if (!tensor.defined()) return "tensor (undefined)";
      return absl::StrCat("tensor ", DtypeName(tensor.scalar_type()), " [",
                          absl::StrJoin(tensor.sizes(), ", "), "]");
  }
  return "?";
}

// ---------------------------------------------------------------------------
// The unpickler

namespace {

using Kind = PyValue::Kind;

// UTF-8 as Python's unpickler accepts it (surrogates pass).
bool ValidUtf8(absl::string_view s) {
  size_t i = 0;
  const size_t n = s.size();
  while (i < n) {
    const auto c = static_cast<uint8_t>(s[i]);
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len;
    uint32_t cp;
    if ((c & 0xE0) == 0xC0) {
      len = 2, cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3, cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4, cp = c & 0x07;
    } else {
      return false;
    }
    if (n - i < len) return false;
    for (size_t k = 1; k < len; ++k) {
      const auto d = static_cast<uint8_t>(s[i + k]);
      if ((d & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (d & 0x3F);
    }
    if ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) ||
        (len == 4 && (cp < 0x10000 || cp > 0x10FFFF))) {
      return false;  // overlong or out of range
    }
    i += len;
  }
  return true;
}

// str.encode('latin1') of valid UTF-8; false if a code point is above 0xFF.
bool EncodeLatin1(absl::string_view s, std::string* out) {
  out->clear();
  out->reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<uint8_t>(s[i]);
    if (c < 0x80) {
      out->push_back(static_cast<char>(c));
      ++i;
    } else if ((c & 0xE0) == 0xC0 && i + 1 < s.size()) {
      const uint32_t cp = ((c & 0x1Fu) << 6) | (static_cast<uint8_t>(s[i + 1]) & 0x3Fu);
      if (cp > 0xFF) return false;
      out->push_back(static_cast<char>(cp));
      i += 2;
    } else {
      return false;
    }
  }
  return true;
}

// Python's pickle opcodes, by the names pickletools gives them (for messages).
struct OpNameEntry {
  int op;
  const char* name;
};

constexpr OpNameEntry kOpNames[] = {
    {'(', "MARK"},
    {'.', "STOP"},
    {'0', "POP"},
    {'1', "POP_MARK"},
    {'2', "DUP"},
    {'F', "FLOAT"},
    {'I', "INT"},
    {'J', "BININT"},
    {'K', "BININT1"},
    {'L', "LONG"},
    {'M', "BININT2"},
    {'N', "NONE"},
    {'P', "PERSID"},
    {'Q', "BINPERSID"},
    {'R', "REDUCE"},
    {'S', "STRING"},
    {'T', "BINSTRING"},
    {'U', "SHORT_BINSTRING"},
    {'V', "UNICODE"},
    {'X', "BINUNICODE"},
    {'a', "APPEND"},
    {'b', "BUILD"},
    {'c', "GLOBAL"},
    {'d', "DICT"},
    {'}', "EMPTY_DICT"},
    {'e', "APPENDS"},
    {'g', "GET"},
    {'h', "BINGET"},
    {'i', "INST"},
    {'j', "LONG_BINGET"},
    {'l', "LIST"},
    {']', "EMPTY_LIST"},
    {'o', "OBJ"},
    {'p', "PUT"},
    {'q', "BINPUT"},
    {'r', "LONG_BINPUT"},
    {'s', "SETITEM"},
    {'t', "TUPLE"},
    {')', "EMPTY_TUPLE"},
    {'u', "SETITEMS"},
    {'G', "BINFLOAT"},
    {'B', "BINBYTES"},
    {'C', "SHORT_BINBYTES"},
    {0x80, "PROTO"},
    {0x81, "NEWOBJ"},
    {0x82, "EXT1"},
    {0x83, "EXT2"},
    {0x84, "EXT4"},
    {0x85, "TUPLE1"},
    {0x86, "TUPLE2"},
    {0x87, "TUPLE3"},
    {0x88, "NEWTRUE"},
    {0x89, "NEWFALSE"},
    {0x8a, "LONG1"},
    {0x8b, "LONG4"},
    {0x8c, "SHORT_BINUNICODE"},
    {0x8d, "BINUNICODE8"},
    {0x8e, "BINBYTES8"},
    {0x8f, "EMPTY_SET"},
    {0x90, "ADDITEMS"},
    {0x91, "FROZENSET"},
    {0x92, "NEWOBJ_EX"},
    {0x93, "STACK_GLOBAL"},
    {0x94, "MEMOIZE"},
    {0x95, "FRAME"},
    {0x96, "BYTEARRAY8"},
    {0x97, "NEXT_BUFFER"},
    {0x98, "READONLY_BUFFER"},
};

const char* OpName(int op) {
  for (const OpNameEntry& e : kOpNames) {
    if (e.op == op) return e.name;
  }
  return nullptr;
}

// The whitelisted GLOBALs that can be called (REDUCE / NEWOBJ) or named.
enum class Fn {
  kOrderedDict,
  kRebuildTensorV2,
  kRebuildParameter,
  kRebuildParameterWithState,
  kStorageType,
  kRestoreTypeTag,
  kBuildIntList,
  kBuildDoubleList,
  kBuildBoolList,
  kBuildTensorList,
  kDevice,
  kCodecsEncode,
  kBytes,
};

struct Callable {
  Fn fn;
  std::string name;                                    // module.name, for messages
  c10::ScalarType dtype = c10::ScalarType::Undefined;  // kStorageType
};

constexpr size_t kMaxGlobalName = 256;
constexpr size_t kMaxDims = 64;

// What the memory budget charges (upper estimates, charged before allocating;
// measured with LibTorch 1.13: a value 144 bytes, a tensor ~530, a memo entry
// ~62): a value (make_shared's control block and malloc's rounding included),
// an entry of a hash map or set, a tensor's TensorImpl and StorageImpl, a
// string's heap buffer (none up to 15 characters).
constexpr uint64_t kValueBytes = sizeof(PyValue) + 48;
constexpr uint64_t kNodeBytes = 64;
constexpr uint64_t kTensorBytes = 768;
uint64_t StringBytes(uint64_t n) { return n < 16 ? 0 : n + 33; }

uint64_t NonNegative(int64_t v) { return v < 0 ? 0 : static_cast<uint64_t>(v); }
uint64_t SaturatingMul(uint64_t a, uint64_t b) {
  uint64_t r;
  return __builtin_mul_overflow(a, b, &r) ? std::numeric_limits<uint64_t>::max() : r;
}
uint64_t SaturatingAdd(uint64_t a, uint64_t b) {
  uint64_t r;
  return __builtin_add_overflow(a, b, &r) ? std::numeric_limits<uint64_t>::max() : r;
}

// Whether a view of `numel` elements with these sizes and strides is
// contiguous, as torch defines it: strides of size-1 dims don't matter.
bool IsContiguous(const std::vector<int64_t>& sizes, const std::vector<int64_t>& strides,
                  int64_t numel) {
  bool contiguous = true;
  if (numel > 0) {
    int64_t expected = 1;
    for (size_t d = sizes.size(); d-- > 0;) {
      if (sizes[d] == 1) continue;
      if (strides[d] != expected) contiguous = false;
      expected *= sizes[d];  // <= numel: no overflow
    }
  }
  return contiguous;
}

bool IsContainer(Kind kind) {
  return kind == Kind::kList || kind == Kind::kTuple || kind == Kind::kDict;
}

struct PairHash {
  size_t operator()(const std::pair<const PyValue*, uint64_t>& p) const {
    const uint64_t h = reinterpret_cast<uintptr_t>(p.first) * 0x9E3779B97F4A7C15ull;
    return static_cast<size_t>(h ^ (p.second + 0x632BE59BD9B4E019ull + (h << 6) + (h >> 2)));
  }
};

class Unpickler {
 public:
  // file_bytes: the size of the file the pickle came from (the memory budget's
  // basis); 0 when unknown (ParsePickle): the pickle's and storages' bytes.
  Unpickler(absl::string_view data, const StorageLoader& loader, const std::string& name,
            const TorchReadLimits& limits, uint64_t file_bytes)
      : data_(data),
        loader_(loader),
        name_(name),
        limits_(limits),
        basis_grows_(file_bytes == 0),
        basis_(file_bytes == 0 ? data.size() : file_bytes) {
    max_items_ = std::min(NonNegative(limits_.max_items),
                          SaturatingMul(NonNegative(limits_.items_per_pickle_byte), data_.size()));
    SetBudget();
  }
  ~Unpickler() { Dismantle(); }

  absl::StatusOr<PyValuePtr> Run() {
    while (true) {
      op_pos_ = pos_;
      if (pos_ >= data_.size()) {
        op_ = -1;
        return Corrupt("truncated: the pickle ends before its STOP opcode");
      }
      op_ = static_cast<uint8_t>(data_[pos_++]);
      if (op_ == '.') return Finish();
      TP_RETURN_IF_ERROR(Step());
    }
  }

 private:
  // ---- errors

  absl::Status Error(absl::StatusCode code, absl::string_view what) const {
    std::string where;
    if (op_ < 0) {
      where = absl::StrCat("byte ", op_pos_);
    } else if (const char* name = OpName(op_)) {
      where = absl::StrCat("byte ", op_pos_, " (", name, ")");
    } else {
      where = absl::StrCat("byte ", op_pos_, " (opcode 0x", absl::Hex(op_, absl::kZeroPad2), ")");
    }
    return absl::Status(code, absl::StrCat(name_, ": data.pkl ", where, ": ", what));
  }
  absl::Status Corrupt(absl::string_view what) const {
    return Error(absl::StatusCode::kDataLoss, what);
  }
  absl::Status Unsupported(absl::string_view what) const {
    return Error(absl::StatusCode::kInvalidArgument, what);
  }

  // ---- input

  absl::StatusOr<absl::string_view> Take(uint64_t n) {
    const uint64_t left = data_.size() - pos_;
    if (n > left) return Corrupt(absl::StrCat("truncated: needs ", n, " bytes, ", left, " left"));
    absl::string_view out = data_.substr(pos_, n);
    pos_ += n;
    return out;
  }

  absl::StatusOr<uint64_t> TakeLE(int n) {
    TP_ASSIGN_OR_RETURN(absl::string_view b, Take(n));
    return LoadLE(b.data(), n);
  }

  // A text argument ending in '\n' (GLOBAL, INT, LONG).
  absl::StatusOr<absl::string_view> TakeLine(size_t max_len) {
    const size_t limit = std::min<size_t>(data_.size() - pos_, max_len + 1);
    const size_t nl = data_.substr(pos_, limit).find('\n');
    if (nl == absl::string_view::npos) {
      return Corrupt(limit <= max_len ? "truncated: no end of line" : "text argument too long");
    }
    absl::string_view out = data_.substr(pos_, nl);
    pos_ += nl + 1;
    return out;
  }

  // ---- values

  // ---- limits: items, and the memory budget

  // Items: values pushed, memo entries stored, container insertions.
  absl::Status Count(uint64_t n) {
    items_ += n;
    if (items_ > max_items_) {
      return Error(
          absl::StatusCode::kResourceExhausted,
          absl::StrCat("more than ", max_items_,
                       " items (values pushed, memo entries, container insertions; "
                       "TorchReadLimits: max_items ",
                       limits_.max_items, ", items_per_pickle_byte ", limits_.items_per_pickle_byte,
                       " x ", data_.size(), " bytes of data.pkl)"));
    }
    return absl::OkStatus();
  }

  void SetBudget() {
    budget_ =
        std::min(NonNegative(limits_.max_memory_bytes),
                 SaturatingAdd(SaturatingMul(NonNegative(limits_.memory_per_file_byte), basis_),
                               NonNegative(limits_.base_memory_bytes)));
  }

  // Charges `bytes` about to be allocated (`what`: for the message).
  absl::Status Charge(uint64_t bytes, absl::string_view what = "the values read") {
    if (bytes > budget_ - std::min(used_, budget_)) {
      return Error(absl::StatusCode::kResourceExhausted,
                   absl::StrCat(what, " would take more than the memory budget of ", budget_,
                                " bytes (TorchReadLimits: memory_per_file_byte ",
                                limits_.memory_per_file_byte, " x ", basis_,
                                " bytes of file + base_memory_bytes ", limits_.base_memory_bytes,
                                ", at most max_memory_bytes ", limits_.max_memory_bytes, ")"));
    }
    used_ += bytes;
    return absl::OkStatus();
  }
  void Refund(uint64_t bytes) { used_ -= std::min(used_, bytes); }

  // Makes room for `extra` more elements in `v`, growing it geometrically
  // (as push_back would) after charging the new capacity.
  template <typename T>
  absl::Status Reserve(std::vector<T>& v, size_t extra) {
    const size_t need = v.size() + extra;
    if (need <= v.capacity()) return absl::OkStatus();
    const size_t capacity = std::max(need, 2 * v.capacity());
    TP_RETURN_IF_ERROR(Charge((capacity - v.capacity()) * sizeof(T)));
    v.reserve(capacity);
    return absl::OkStatus();
  }

  // ---- values

  // A new value, charged: a container also for its arena slot and for what
  // Finish keeps per container (its height, its place on the walk).
  absl::StatusOr<PyValuePtr> New(Kind kind) {
    const bool container = IsContainer(kind);
    TP_RETURN_IF_ERROR(Charge(kValueBytes + (container ? 2 * kNodeBytes : 0)));
    if (container) TP_RETURN_IF_ERROR(Reserve(arena_, 1));
    auto v = std::make_shared<PyValue>();
    v->kind = kind;
    if (container) arena_.push_back(v);
    return v;
  }

  // The one value of an immutable constant (None, True, False, a small int,
  // the empty tuple), made the first time.
  absl::StatusOr<PyValuePtr> Shared(PyValuePtr* slot, Kind kind) {
    if (*slot == nullptr) {
      TP_ASSIGN_OR_RETURN(*slot, New(kind));
    }
    return *slot;
  }

  absl::Status Push(PyValuePtr v) {
    TP_RETURN_IF_ERROR(Count(1));
    TP_RETURN_IF_ERROR(Reserve(stack_, 1));
    stack_.push_back(std::move(v));
    return absl::OkStatus();
  }

  absl::Status PushNone() {
    TP_ASSIGN_OR_RETURN(PyValuePtr v, Shared(&none_, Kind::kNone));
    return Push(std::move(v));
  }

  absl::Status PushBool(bool b) {
    TP_ASSIGN_OR_RETURN(PyValuePtr v, Shared(&bools_[b ? 1 : 0], Kind::kBool));
    v->b = b;
    return Push(std::move(v));
  }

  absl::Status PushEmptyTuple() {
    TP_ASSIGN_OR_RETURN(PyValuePtr v, Shared(&empty_tuple_, Kind::kTuple));
    return Push(std::move(v));
  }

  absl::Status PushInt(int64_t i) {
    PyValuePtr v;
    if (i >= 0 && i < static_cast<int64_t>(small_ints_.size())) {
      TP_ASSIGN_OR_RETURN(v, Shared(&small_ints_[i], Kind::kInt));
    } else {
      TP_ASSIGN_OR_RETURN(v, New(Kind::kInt));
    }
    v->i = i;
    return Push(std::move(v));
  }

  absl::StatusOr<PyValuePtr> NewString(Kind kind, absl::string_view s) {
    TP_ASSIGN_OR_RETURN(PyValuePtr v, New(kind));
    TP_RETURN_IF_ERROR(Charge(StringBytes(s.size())));
    v->s.assign(s.data(), s.size());
    return v;
  }

  absl::Status PushString(Kind kind, absl::string_view s) {
    if (kind == Kind::kString && !ValidUtf8(s)) return Corrupt("string is not valid UTF-8");
    TP_ASSIGN_OR_RETURN(PyValuePtr v, NewString(kind, s));
    return Push(std::move(v));
  }

  std::string DescribeNode(const PyValue* v) const {
    if (auto it = callables_.find(v); it != callables_.end())
      return absl::StrCat("global ", it->second.name);
    if (storage_nodes_.count(v)) {
      return absl::StrCat("storage ", DtypeName(v->tensor.scalar_type()), " of ",
                          v->tensor.numel());
    }
    return v->Describe();
  }

  // ---- the stack (Python's: MARK starts a new frame; below it is out of reach)

  size_t FrameBase() const { return marks_.empty() ? 0 : marks_.back(); }

  absl::StatusOr<PyValuePtr> Pop() {
    if (stack_.size() <= FrameBase()) return Corrupt("stack underflow");
    PyValuePtr v = std::move(stack_.back());
    stack_.pop_back();
    return v;
  }

  absl::StatusOr<PyValue*> Top() {
    if (stack_.size() <= FrameBase()) return Corrupt("stack underflow");
    return stack_.back().get();
  }

  // The values above the last MARK, in a new vector (charged; Refund it
  // when it is dropped rather than kept in a container).
  absl::StatusOr<std::vector<PyValuePtr>> PopMark() {
    if (marks_.empty()) return Corrupt("no MARK on the stack");
    const size_t base = marks_.back();
    TP_RETURN_IF_ERROR(Charge((stack_.size() - base) * sizeof(PyValuePtr)));
    marks_.pop_back();
    std::vector<PyValuePtr> items(std::make_move_iterator(stack_.begin() + base),
                                  std::make_move_iterator(stack_.end()));
    stack_.resize(base);
    return items;
  }
  static uint64_t Bytes(const std::vector<PyValuePtr>& items) {
    return items.capacity() * sizeof(PyValuePtr);
  }

  // ---- containers

  // Python dict semantics: equal keys (1 == True == 1.0) share an entry; a
  // later SETITEM replaces the value. Keys get an id once per key object, so
  // a long key reused through the memo costs its length only once.
  absl::StatusOr<uint64_t> KeyId(const PyValue* k) {
    if (auto it = key_ids_.find(k); it != key_ids_.end()) return it->second;
    TP_RETURN_IF_ERROR(Charge(3 * kNodeBytes + StringBytes(k->s.size() + 24)));
    std::string canon;
    if (callables_.count(k) || k->kind == Kind::kTuple || k->kind == Kind::kTensor ||
        k->kind == Kind::kObject) {
      canon = absl::StrCat("p", reinterpret_cast<uintptr_t>(k));  // by identity
    } else {
      switch (k->kind) {
        case Kind::kNone: canon = "N"; break;
        case Kind::kBool: canon = k->b ? "n1" : "n0"; break;
        case Kind::kInt: canon = absl::StrCat("n", k->i); break;
        case Kind::kFloat:
          if (std::isfinite(k->f) && std::trunc(k->f) == k->f && std::fabs(k->f) < 9.2e18) {
            canon = absl::StrCat("n", static_cast<int64_t>(k->f));
          } else {
            uint64_t bits;
            std::memcpy(&bits, &k->f, 8);
            canon = absl::StrCat("f", bits);
          }
          break;
        case Kind::kString: canon = absl::StrCat("s", k->s); break;
        case Kind::kBytes: canon = absl::StrCat("b", k->s); break;
        default: return Unsupported(absl::StrCat("unhashable ", DescribeNode(k), " as a dict key"));
      }
    }
    const uint64_t id = key_intern_.emplace(std::move(canon), key_intern_.size()).first->second;
    key_ids_.emplace(k, id);
    return id;
  }

  absl::Status SetItem(PyValue* dict, PyValuePtr key, PyValuePtr value) {
    TP_ASSIGN_OR_RETURN(const uint64_t id, KeyId(key.get()));
    if (auto it = dict_index_.find({dict, id}); it != dict_index_.end()) {
      dict->entries[it->second].second = std::move(value);
      return absl::OkStatus();
    }
    TP_RETURN_IF_ERROR(Count(1));
    TP_RETURN_IF_ERROR(Charge(kNodeBytes));
    TP_RETURN_IF_ERROR(Reserve(dict->entries, 1));
    dict_index_.emplace(std::make_pair(dict, id), dict->entries.size());
    dict->entries.emplace_back(std::move(key), std::move(value));
    return absl::OkStatus();
  }

  // The list or dict items are added to; nullptr for an opaque object (a
  // list or dict subclass this reader does not rebuild: the items are dropped).
  absl::StatusOr<PyValue*> TopOfKind(Kind kind, absl::string_view what) {
    TP_ASSIGN_OR_RETURN(PyValue * top, Top());
    if (top->kind == Kind::kObject) return nullptr;
    if (top->kind != kind || callables_.count(top) || storage_nodes_.count(top)) {
      return Unsupported(absl::StrCat(what, " on a ", DescribeNode(top)));
    }
    return top;
  }

  // ---- opcodes

  // Hands op_ to the handler of its family: the stack, scalars and strings
  // here, the others through StepStructure.
  absl::Status Step() {
    switch (op_) {
      case 0x80:  // PROTO
      case 0x95:  // FRAME
      case '(':   // MARK
      case '0':   // POP
      case '1':   // POP_MARK
      case '2':   // DUP
      case 'q':   // BINPUT
      case 'r':   // LONG_BINPUT
      case 0x94:  // MEMOIZE
      case 'h':   // BINGET
      case 'j':   // LONG_BINGET
        return StackOp();
      case 'N':   // NONE
      case 0x88:  // NEWTRUE
      case 0x89:  // NEWFALSE
      case 'J':   // BININT
      case 'K':   // BININT1
      case 'M':   // BININT2
      case 0x8a:  // LONG1
      case 0x8b:  // LONG4
      case 'I':   // INT
      case 'L':   // LONG
      case 'G':   // BINFLOAT
        return ScalarOp();
      case 'X':   // BINUNICODE
      case 0x8c:  // SHORT_BINUNICODE
      case 0x8d:  // BINUNICODE8
      case 'T':   // BINSTRING
      case 'U':   // SHORT_BINSTRING
      case 'B':   // BINBYTES
      case 'C':   // SHORT_BINBYTES
      case 0x8e:  // BINBYTES8
      case 0x96:  // BYTEARRAY8
        return StringOp();
      default: return StepStructure();
    }
  }

  // Step's second half: containers, objects, sets, and what no family handles.
  absl::Status StepStructure() {
    switch (op_) {
      case ']':   // EMPTY_LIST
      case '}':   // EMPTY_DICT
      case ')':   // EMPTY_TUPLE
      case 'l':   // LIST
      case 't':   // TUPLE
      case 0x85:  // TUPLE1
      case 0x86:  // TUPLE2
      case 0x87:  // TUPLE3
      case 'd':   // DICT
        return NewContainerOp();
      case 'a':  // APPEND
      case 'e':  // APPENDS
      case 's':  // SETITEM
      case 'u':  // SETITEMS
        return FillContainerOp();
      case 'c':   // GLOBAL
      case 0x93:  // STACK_GLOBAL
      case 'R':   // REDUCE
      case 0x81:  // NEWOBJ
      case 'b':   // BUILD
      case 'Q':   // BINPERSID
        return ObjectOp();
      case 0x8f:
      case 0x90:
      case 0x91: return Unsupported("sets are not supported");
      default: return UnhandledOp();
    }
  }

  // An opcode no family handles: one of Python's that this reader refuses, or
  // none at all.
  absl::Status UnhandledOp() const {
    if (OpName(op_) != nullptr) return Unsupported("unsupported pickle opcode");
    return Corrupt("unknown pickle opcode");
  }

  // The protocol, framing, the stack and the memo.
  absl::Status StackOp() {
    switch (op_) {
      case 0x80: {  // PROTO
        TP_ASSIGN_OR_RETURN(const uint64_t proto, TakeLE(1));
        if (proto > 5) return Unsupported(absl::StrCat("pickle protocol ", proto));
        return absl::OkStatus();
      }
      case 0x95: {  // FRAME: only a length prefix for buffering
        TP_ASSIGN_OR_RETURN(const uint64_t len, TakeLE(8));
        if (len > data_.size() - pos_) return Corrupt("frame runs past the end of the pickle");
        return absl::OkStatus();
      }
      case '(':
        if (static_cast<int64_t>(marks_.size()) >= limits_.max_depth) {
          return Unsupported(
              absl::StrCat("more than max_depth (", limits_.max_depth, ") nested MARKs"));
        }
        TP_RETURN_IF_ERROR(Reserve(marks_, 1));
        marks_.push_back(stack_.size());
        return absl::OkStatus();
      case '0':  // POP
        if (stack_.size() > FrameBase()) {
          stack_.pop_back();
          return absl::OkStatus();
        }
        return DropMark();
      case '1':  // POP_MARK
        return DropMark();
      case '2': {  // DUP
        TP_ASSIGN_OR_RETURN(PyValue * top, Top());
        (void)top;
        return Push(stack_.back());
      }
      case 'q': {  // BINPUT
        TP_ASSIGN_OR_RETURN(const uint64_t k, TakeLE(1));
        return Memoize(k);
      }
      case 'r': {  // LONG_BINPUT
        TP_ASSIGN_OR_RETURN(const uint64_t k, TakeLE(4));
        return Memoize(k);
      }
      case 0x94:  // MEMOIZE
        return Memoize(memo_.size());
      case 'h': {  // BINGET
        TP_ASSIGN_OR_RETURN(const uint64_t k, TakeLE(1));
        return MemoGet(k);
      }
      case 'j': {  // LONG_BINGET
        TP_ASSIGN_OR_RETURN(const uint64_t k, TakeLE(4));
        return MemoGet(k);
      }
      default: return UnhandledOp();
    }
  }

  // None, booleans, integers and floats.
  absl::Status ScalarOp() {
    switch (op_) {
      case 'N': return PushNone();
      case 0x88:
      case 0x89:  // NEWTRUE, NEWFALSE
        return PushBool(op_ == 0x88);
      case 'J': {  // BININT
        TP_ASSIGN_OR_RETURN(const uint64_t v, TakeLE(4));
        return PushInt(static_cast<int32_t>(static_cast<uint32_t>(v)));
      }
      case 'K': {  // BININT1
        TP_ASSIGN_OR_RETURN(const uint64_t v, TakeLE(1));
        return PushInt(static_cast<int64_t>(v));
      }
      case 'M': {  // BININT2
        TP_ASSIGN_OR_RETURN(const uint64_t v, TakeLE(2));
        return PushInt(static_cast<int64_t>(v));
      }
      case 0x8a: {  // LONG1
        TP_ASSIGN_OR_RETURN(const uint64_t n, TakeLE(1));
        return PushLong(n);
      }
      case 0x8b: {  // LONG4
        TP_ASSIGN_OR_RETURN(const uint64_t n, TakeLE(4));
        if (n & 0x80000000u) return Corrupt("negative LONG4 length");
        return PushLong(n);
      }
      case 'I':
      case 'L': {  // INT, LONG (text)
        TP_ASSIGN_OR_RETURN(absl::string_view text, TakeLine(64));
        if (op_ == 'I' && (text == "00" || text == "01")) return PushBool(text == "01");
        if (op_ == 'L' && !text.empty() && text.back() == 'L') text.remove_suffix(1);
        int64_t i;
        if (!absl::SimpleAtoi(text, &i))
          return Corrupt(absl::StrCat("bad or too large integer ", QuoteForError(text)));
        return PushInt(i);
      }
      case 'G': {  // BINFLOAT: big-endian
        TP_ASSIGN_OR_RETURN(absl::string_view b, Take(8));
        uint64_t bits = 0;
        for (int k = 0; k < 8; ++k) bits = (bits << 8) | static_cast<uint8_t>(b[k]);
        TP_ASSIGN_OR_RETURN(PyValuePtr v, New(Kind::kFloat));
        std::memcpy(&v->f, &bits, 8);
        return Push(std::move(v));
      }
      default: return UnhandledOp();
    }
  }

  // Strings and bytes.
  absl::Status StringOp() {
    switch (op_) {
      case 'X':  // BINUNICODE
        return PushSized(4, Kind::kString);
      case 0x8c:  // SHORT_BINUNICODE
        return PushSized(1, Kind::kString);
      case 0x8d:  // BINUNICODE8
        return PushSized(8, Kind::kString);
      case 'T': {  // BINSTRING (a Python 2 str; Python 3 decodes it as ASCII)
        TP_ASSIGN_OR_RETURN(const uint64_t n, TakeLE(4));
        if (n & 0x80000000u) return Corrupt("negative BINSTRING length");
        TP_ASSIGN_OR_RETURN(absl::string_view s, Take(n));
        return PushString(Kind::kString, s);
      }
      case 'U':  // SHORT_BINSTRING
        return PushSized(1, Kind::kString);
      case 'B':  // BINBYTES
        return PushSized(4, Kind::kBytes);
      case 'C':  // SHORT_BINBYTES
        return PushSized(1, Kind::kBytes);
      case 0x8e:  // BINBYTES8
      case 0x96:  // BYTEARRAY8
        return PushSized(8, Kind::kBytes);
      default: return UnhandledOp();
    }
  }

  // New lists, tuples and dicts.
  absl::Status NewContainerOp() {
    switch (op_) {
      case ']': {
        TP_ASSIGN_OR_RETURN(PyValuePtr v, New(Kind::kList));
        return Push(std::move(v));
      }
      case '}': {
        TP_ASSIGN_OR_RETURN(PyValuePtr v, New(Kind::kDict));
        return Push(std::move(v));
      }
      case ')': return PushEmptyTuple();
      case 'l':
      case 't': {  // LIST, TUPLE
        TP_ASSIGN_OR_RETURN(std::vector<PyValuePtr> items, PopMark());
        TP_RETURN_IF_ERROR(Count(items.size()));
        if (op_ == 't' && items.empty()) return PushEmptyTuple();
        TP_ASSIGN_OR_RETURN(PyValuePtr v, New(op_ == 'l' ? Kind::kList : Kind::kTuple));
        v->items = std::move(items);  // its charge moves with it
        return Push(std::move(v));
      }
      case 0x85:
      case 0x86:
      case 0x87: {  // TUPLE1, TUPLE2, TUPLE3
        const size_t n = op_ - 0x84;
        if (stack_.size() < FrameBase() + n) return Corrupt("stack underflow");
        TP_RETURN_IF_ERROR(Count(n));
        TP_ASSIGN_OR_RETURN(PyValuePtr v, New(Kind::kTuple));
        TP_RETURN_IF_ERROR(Charge(n * sizeof(PyValuePtr)));
        v->items.assign(std::make_move_iterator(stack_.end() - n),
                        std::make_move_iterator(stack_.end()));
        stack_.resize(stack_.size() - n);
        return Push(std::move(v));
      }
      case 'd': {  // DICT
        TP_ASSIGN_OR_RETURN(std::vector<PyValuePtr> items, PopMark());
        if (items.size() % 2) return Corrupt("DICT with an odd number of items");
        TP_ASSIGN_OR_RETURN(PyValuePtr v, New(Kind::kDict));
        for (size_t k = 0; k < items.size(); k += 2) {
          TP_RETURN_IF_ERROR(SetItem(v.get(), std::move(items[k]), std::move(items[k + 1])));
        }
        Refund(Bytes(items));
        return Push(std::move(v));
      }
      default: return UnhandledOp();
    }
  }

  // Items added to the list or dict on top of the stack.
  absl::Status FillContainerOp() {
    switch (op_) {
      case 'a': {  // APPEND
        TP_ASSIGN_OR_RETURN(PyValuePtr item, Pop());
        TP_ASSIGN_OR_RETURN(PyValue * list, TopOfKind(Kind::kList, "APPEND"));
        TP_RETURN_IF_ERROR(Count(1));
        if (list == nullptr) return absl::OkStatus();
        TP_RETURN_IF_ERROR(Reserve(list->items, 1));
        list->items.push_back(std::move(item));
        return absl::OkStatus();
      }
      case 'e': {  // APPENDS
        TP_ASSIGN_OR_RETURN(std::vector<PyValuePtr> items, PopMark());
        TP_ASSIGN_OR_RETURN(PyValue * list, TopOfKind(Kind::kList, "APPENDS"));
        TP_RETURN_IF_ERROR(Count(items.size()));
        if (list != nullptr) {
          TP_RETURN_IF_ERROR(Reserve(list->items, items.size()));
          list->items.insert(list->items.end(), std::make_move_iterator(items.begin()),
                             std::make_move_iterator(items.end()));
        }
        Refund(Bytes(items));
        return absl::OkStatus();
      }
      case 's': {  // SETITEM
        TP_ASSIGN_OR_RETURN(PyValuePtr value, Pop());
        TP_ASSIGN_OR_RETURN(PyValuePtr key, Pop());
        TP_ASSIGN_OR_RETURN(PyValue * dict, TopOfKind(Kind::kDict, "SETITEM"));
        if (dict == nullptr) return Count(1);
        return SetItem(dict, std::move(key), std::move(value));
      }
      case 'u': {  // SETITEMS
        TP_ASSIGN_OR_RETURN(std::vector<PyValuePtr> items, PopMark());
        if (items.size() % 2) return Corrupt("SETITEMS with an odd number of items");
        TP_ASSIGN_OR_RETURN(PyValue * dict, TopOfKind(Kind::kDict, "SETITEMS"));
        if (dict == nullptr) {
          TP_RETURN_IF_ERROR(Count(items.size() / 2));
        } else {
          for (size_t k = 0; k < items.size(); k += 2) {
            TP_RETURN_IF_ERROR(SetItem(dict, std::move(items[k]), std::move(items[k + 1])));
          }
        }
        Refund(Bytes(items));
        return absl::OkStatus();
      }
      default: return UnhandledOp();
    }
  }

  // Globals, calls of them, BUILD, and persistent ids (the storages).
  absl::Status ObjectOp() {
    switch (op_) {
      case 'c': {  // GLOBAL
        TP_ASSIGN_OR_RETURN(absl::string_view module, TakeLine(kMaxGlobalName));
        TP_ASSIGN_OR_RETURN(absl::string_view name, TakeLine(kMaxGlobalName));
        return PushGlobal(module, name);
      }
      case 0x93: {  // STACK_GLOBAL
        TP_ASSIGN_OR_RETURN(PyValuePtr name, Pop());
        TP_ASSIGN_OR_RETURN(PyValuePtr module, Pop());
        if (name->kind != Kind::kString || module->kind != Kind::kString) {
          return Unsupported("STACK_GLOBAL of a non-string");
        }
        if (name->s.size() > kMaxGlobalName || module->s.size() > kMaxGlobalName) {
          return Unsupported("STACK_GLOBAL name too long");
        }
        return PushGlobal(module->s, name->s);
      }
      case 'R':     // REDUCE
      case 0x81: {  // NEWOBJ: cls.__new__(cls, *args); only OrderedDict is a class here
        TP_ASSIGN_OR_RETURN(PyValuePtr args, Pop());
        TP_ASSIGN_OR_RETURN(PyValuePtr fn, Pop());
        if (fn->kind == Kind::kObject) {  // a call of an opaque global: opaque, never run
          return PushObject(fn->s);
        }
        auto it = callables_.find(fn.get());
        if (it == callables_.end()) {
          return Unsupported(
              absl::StrCat("call of a ", DescribeNode(fn.get()), ", not of a whitelisted global"));
        }
        if (args->kind != Kind::kTuple) {
          return Corrupt(absl::StrCat("the arguments of ", it->second.name, " are a ",
                                      DescribeNode(args.get()), ", not a tuple"));
        }
        if (op_ == 0x81 && it->second.fn != Fn::kOrderedDict) {
          return Unsupported(absl::StrCat("NEWOBJ of ", it->second.name));
        }
        TP_ASSIGN_OR_RETURN(PyValuePtr result, Call(it->second, args->items));
        return Push(std::move(result));
      }
      case 'b': {  // BUILD: obj.__setstate__(state)
        TP_ASSIGN_OR_RETURN(PyValuePtr state, Pop());
        TP_ASSIGN_OR_RETURN(PyValue * obj, Top());
        if (obj->kind == Kind::kObject) return absl::OkStatus();  // its state is dropped
        if (!ordered_dicts_.count(obj)) {
          return Unsupported(absl::StrCat("BUILD (setting the state) of a ", DescribeNode(obj),
                                          "; only an OrderedDict's (e.g. _metadata) is accepted"));
        }
        return absl::OkStatus();  // the attributes (_metadata) are dropped
      }
      case 'Q': {  // BINPERSID
        TP_ASSIGN_OR_RETURN(PyValuePtr pid, Pop());
        TP_ASSIGN_OR_RETURN(PyValuePtr storage, LoadStorage(*pid));
        return Push(std::move(storage));
      }
      default: return UnhandledOp();
    }
  }

  absl::Status PushSized(int len_bytes, Kind kind) {
    TP_ASSIGN_OR_RETURN(const uint64_t n, TakeLE(len_bytes));
    TP_ASSIGN_OR_RETURN(absl::string_view s, Take(n));
    return PushString(kind, s);
  }

  // Little-endian two's complement of n bytes; must fit in 64 bits.
  absl::Status PushLong(uint64_t n) {
    TP_ASSIGN_OR_RETURN(absl::string_view b, Take(n));
    if (n == 0) return PushInt(0);
    const size_t low = std::min<size_t>(n, 8);
    const bool negative = static_cast<uint8_t>(b[n - 1]) & 0x80;
    for (size_t k = 8; k < n; ++k) {
      if (static_cast<uint8_t>(b[k]) != (negative ? 0xFF : 0x00)) {
        return Unsupported("integer does not fit in 64 bits");
      }
    }
    uint64_t v = LoadLE(b.data(), static_cast<int>(low));
    if (low < 8 && negative) v |= ~uint64_t{0} << (8 * low);
    if (n > 8 && (static_cast<int64_t>(v) < 0) != negative)
      return Unsupported("integer does not fit in 64 bits");
    return PushInt(static_cast<int64_t>(v));
  }

  absl::Status DropMark() {
    TP_ASSIGN_OR_RETURN(std::vector<PyValuePtr> items, PopMark());
    Refund(Bytes(items));
    return absl::OkStatus();
  }

  absl::Status Memoize(uint64_t key) {
    TP_ASSIGN_OR_RETURN(PyValue * top, Top());
    (void)top;
    TP_RETURN_IF_ERROR(Count(1));
    if (auto it = memo_.find(key); it != memo_.end()) {
      it->second = stack_.back();
      return absl::OkStatus();
    }
    TP_RETURN_IF_ERROR(Charge(kNodeBytes));
    memo_.emplace(key, stack_.back());
    return absl::OkStatus();
  }

  absl::Status MemoGet(uint64_t key) {
    auto it = memo_.find(key);
    if (it == memo_.end()) return Corrupt(absl::StrCat("memo entry ", key, " was never stored"));
    return Push(it->second);
  }

  // ---- globals

  // A global this reader does not rebuild: an opaque object. Calling it,
  // setting its state or filling it yields the same opaque object; nothing
  // is imported or executed (it never imports code), and what it was given
  // is dropped.
  absl::Status PushObject(const std::string& name) {
    TP_ASSIGN_OR_RETURN(PyValuePtr v, NewString(Kind::kObject, name));
    return Push(std::move(v));
  }

  // One value per global name, as Python's classes and functions are one
  // object each.
  absl::Status PushGlobal(absl::string_view module, absl::string_view name) {
    const std::string full = absl::StrCat(module, ".", name);
    if (auto it = globals_.find(full); it != globals_.end()) return Push(it->second);
    TP_ASSIGN_OR_RETURN(PyValuePtr v, NewGlobal(module, name, full));
    TP_RETURN_IF_ERROR(Charge(2 * kNodeBytes + 2 * StringBytes(full.size())));
    globals_.emplace(full, v);
    return Push(std::move(v));
  }

  absl::StatusOr<PyValuePtr> NewGlobal(absl::string_view module, absl::string_view name,
                                       const std::string& full) {
    Callable c;
    c.name = full;
    if (module == "collections" && name == "OrderedDict") {
      c.fn = Fn::kOrderedDict;
    } else if (module == "torch._utils" && name == "_rebuild_tensor_v2") {
      c.fn = Fn::kRebuildTensorV2;
    } else if (module == "torch._utils" && name == "_rebuild_parameter") {
      c.fn = Fn::kRebuildParameter;
    } else if (module == "torch._utils" && name == "_rebuild_parameter_with_state") {
      c.fn = Fn::kRebuildParameterWithState;
    } else if (module == "torch.jit._pickle" && name == "restore_type_tag") {
      c.fn = Fn::kRestoreTypeTag;
    } else if (module == "torch.jit._pickle" && name == "build_intlist") {
      c.fn = Fn::kBuildIntList;
    } else if (module == "torch.jit._pickle" && name == "build_doublelist") {
      c.fn = Fn::kBuildDoubleList;
    } else if (module == "torch.jit._pickle" && name == "build_boollist") {
      c.fn = Fn::kBuildBoolList;
    } else if (module == "torch.jit._pickle" && name == "build_tensorlist") {
      c.fn = Fn::kBuildTensorList;
    } else if (module == "torch" && name == "device") {
      c.fn = Fn::kDevice;
    } else if (module == "_codecs" && name == "encode") {
      c.fn = Fn::kCodecsEncode;
    } else if ((module == "builtins" || module == "__builtin__") && name == "bytes") {
      c.fn = Fn::kBytes;
    } else if ((module == "builtins" || module == "__builtin__") &&
               (name == "set" || name == "frozenset")) {
      return Unsupported(absl::StrCat("global ", QuoteForError(full), ": sets are not supported"));
    } else {
      bool found = false;
      if (module == "torch") {
        for (const DtypeInfo& d : kDtypes) {
          if (name == d.storage) {
            c.fn = Fn::kStorageType;
            c.dtype = d.type;
            found = true;
            break;
          }
          if (name == d.name) {  // a torch.dtype: reads as the string "torch.float32"
            return NewString(Kind::kString, full);
          }
        }
      }
      if (!found) return NewString(Kind::kObject, full);
    }
    TP_ASSIGN_OR_RETURN(PyValuePtr v, New(Kind::kNone));
    callables_.emplace(v.get(), std::move(c));
    return v;
  }

  bool IsPlain(const PyValuePtr& v, Kind kind) const {
    return v->kind == kind && !callables_.count(v.get()) && !storage_nodes_.count(v.get());
  }

  // A call of `c` with arguments it does not take.
  absl::Status BadArgs(const Callable& c, const std::vector<PyValuePtr>& args,
                       absl::string_view why) const {
    std::vector<std::string> kinds;
    for (const auto& a : args) kinds.push_back(DescribeNode(a.get()));
    return Unsupported(absl::StrCat(c.name, "(", absl::StrJoin(kinds, ", "), "): ", why));
  }

  absl::StatusOr<PyValuePtr> Call(const Callable& c, const std::vector<PyValuePtr>& args) {
    auto bad_args = [&](absl::string_view why) { return BadArgs(c, args, why); };
    switch (c.fn) {
      case Fn::kOrderedDict: {
        if (!args.empty()) return bad_args("expected no arguments");
        TP_ASSIGN_OR_RETURN(PyValuePtr d, New(Kind::kDict));
        TP_RETURN_IF_ERROR(Charge(kNodeBytes));
        ordered_dicts_.insert(d.get());
        return d;
      }
      case Fn::kRebuildTensorV2: return RebuildTensor(c, args);
      case Fn::kRebuildParameter:
      case Fn::kRebuildParameterWithState: {
        const size_t want = c.fn == Fn::kRebuildParameter ? 3 : 4;
        if (args.size() != want) return bad_args(absl::StrCat("expected ", want, " arguments"));
        if (!IsPlain(args[0], Kind::kTensor)) return bad_args("the data is not a tensor");
        if (!IsPlain(args[1], Kind::kBool)) return bad_args("requires_grad is not a bool");
        return args[0];  // requires_grad, hooks and state are dropped
      }
      case Fn::kStorageType: return bad_args("a storage class is only used in persistent ids");
      case Fn::kRestoreTypeTag:
        if (args.size() != 2 || !IsPlain(args[1], Kind::kString))
          return bad_args("expected (value, type string)");
        return args[0];
      case Fn::kBuildIntList:
      case Fn::kBuildDoubleList:
      case Fn::kBuildBoolList:
      case Fn::kBuildTensorList:
        if (args.size() != 1 || !IsPlain(args[0], Kind::kList))
          return bad_args("expected one list");
        return args[0];
      case Fn::kDevice: return CallDevice(c, args);
      case Fn::kCodecsEncode: return CallCodecsEncode(c, args);
      case Fn::kBytes:
        if (!args.empty()) return bad_args("expected no arguments");
        return New(Kind::kBytes);
    }
    return bad_args("not callable");
  }

  // torch.device(type[, index]): reads as the string "type[:index]".
  absl::StatusOr<PyValuePtr> CallDevice(const Callable& c, const std::vector<PyValuePtr>& args) {
    if (args.empty() || args.size() > 2 || !IsPlain(args[0], Kind::kString) ||
        args[0]->s.size() > 32) {
      return BadArgs(c, args, "expected (type[, index])");
    }
    std::string device = args[0]->s;
    if (args.size() == 2) {
      if (IsPlain(args[1], Kind::kInt)) {
        absl::StrAppend(&device, ":", args[1]->i);
      } else if (!IsPlain(args[1], Kind::kNone)) {
        return BadArgs(c, args, "the index is not an int");
      }
    }
    return NewString(Kind::kString, device);
  }

  // Protocol 2's bytes: _codecs.encode(str, 'latin1').
  absl::StatusOr<PyValuePtr> CallCodecsEncode(const Callable& c,
                                              const std::vector<PyValuePtr>& args) {
    if (args.size() != 2 || !IsPlain(args[0], Kind::kString) || !IsPlain(args[1], Kind::kString) ||
        (args[1]->s != "latin1" && args[1]->s != "latin-1")) {
      return BadArgs(c, args, "expected (str, 'latin1')");
    }
    // Once per string object: a memoized string encoded again and again
    // would otherwise cost its length each time.
    if (auto it = encoded_.find(args[0].get()); it != encoded_.end()) return it->second;
    std::string bytes;
    if (!EncodeLatin1(args[0]->s, &bytes)) return BadArgs(c, args, "the string is not latin-1");
    TP_ASSIGN_OR_RETURN(PyValuePtr v, NewString(Kind::kBytes, bytes));
    TP_RETURN_IF_ERROR(Charge(kNodeBytes));
    encoded_.emplace(args[0].get(), v);
    return v;
  }

  absl::StatusOr<std::vector<int64_t>> IntTuple(const PyValuePtr& v, absl::string_view what) {
    if (!IsPlain(v, Kind::kTuple) && !IsPlain(v, Kind::kList)) {
      return Unsupported(
          absl::StrCat("_rebuild_tensor_v2: ", what, " is a ", DescribeNode(v.get())));
    }
    if (v->items.size() > kMaxDims) {
      return Unsupported(absl::StrCat("_rebuild_tensor_v2: ", v->items.size(), " dimensions"));
    }
    std::vector<int64_t> out;
    for (const auto& item : v->items) {
      if (!IsPlain(item, Kind::kInt) || item->i < 0) {
        return Unsupported(absl::StrCat("_rebuild_tensor_v2: ", what, " holds a ",
                                        DescribeNode(item.get()),
                                        item->kind == Kind::kInt ? " < 0" : ""));
      }
      out.push_back(item->i);
    }
    return out;
  }

  // torch._utils._rebuild_tensor_v2(storage, storage_offset, size, stride,
  // requires_grad, backward_hooks[, metadata])
  absl::StatusOr<PyValuePtr> RebuildTensor(const Callable& c, const std::vector<PyValuePtr>& args) {
    if (args.size() != 6 && args.size() != 7) {
      return Unsupported(absl::StrCat(c.name, " takes 6 or 7 arguments, got ", args.size()));
    }
    if (!storage_nodes_.count(args[0].get())) {
      return Unsupported(absl::StrCat(c.name, ": the storage is a ", DescribeNode(args[0].get())));
    }
    if (!IsPlain(args[1], Kind::kInt) || args[1]->i < 0) {
      return Unsupported(
          absl::StrCat(c.name, ": the storage offset is a ", DescribeNode(args[1].get())));
    }
    TP_ASSIGN_OR_RETURN(const std::vector<int64_t> sizes, IntTuple(args[2], "the size"));
    TP_ASSIGN_OR_RETURN(const std::vector<int64_t> strides, IntTuple(args[3], "the stride"));
    if (sizes.size() != strides.size()) {
      return Unsupported(
          absl::StrCat(c.name, ": ", sizes.size(), " sizes but ", strides.size(), " strides"));
    }
    if (!IsPlain(args[4], Kind::kBool)) {
      return Unsupported(
          absl::StrCat(c.name, ": requires_grad is a ", DescribeNode(args[4].get())));
    }
    if (!IsPlain(args[5], Kind::kDict) && !IsPlain(args[5], Kind::kNone)) {
      return Unsupported(
          absl::StrCat(c.name, ": backward_hooks is a ", DescribeNode(args[5].get())));
    }
    const at::Tensor& base = args[0]->tensor;
    const int64_t storage_numel = base.numel();
    const int64_t offset = args[1]->i;
    int64_t numel = 1;
    for (int64_t s : sizes) {
      if (__builtin_mul_overflow(numel, s, &numel))
        return Unsupported(absl::StrCat(c.name, ": size overflows"));
    }
    const std::string shape = absl::StrCat("size [", absl::StrJoin(sizes, ", "), "] stride [",
                                           absl::StrJoin(strides, ", "), "] offset ", offset);
    TP_RETURN_IF_ERROR(CheckInStorage(c, shape, sizes, strides, offset, numel, storage_numel));
    return NewTensorView(base, sizes, strides, offset, numel, shape);
  }

  // That the elements of the view `shape` of `numel` elements lie inside a
  // storage of `storage_numel`.
  absl::Status CheckInStorage(const Callable& c, const std::string& shape,
                              const std::vector<int64_t>& sizes,
                              const std::vector<int64_t>& strides, int64_t offset, int64_t numel,
                              int64_t storage_numel) const {
    if (numel == 0) {
      if (offset > storage_numel) {
        return Corrupt(
            absl::StrCat(c.name, ": ", shape, " is outside a storage of ", storage_numel));
      }
    } else {
      int64_t last = offset;
      for (size_t d = 0; d < sizes.size(); ++d) {
        int64_t span;
        if (__builtin_mul_overflow(sizes[d] - 1, strides[d], &span) ||
            __builtin_add_overflow(last, span, &last)) {
          return Unsupported(absl::StrCat(c.name, ": ", shape, " overflows"));
        }
      }
      if (last >= storage_numel) {
        return Corrupt(absl::StrCat(c.name, ": ", shape, " reaches element ", last,
                                    " of a storage of ", storage_numel));
      }
    }
    return absl::OkStatus();
  }

  // The tensor of a checked view of the storage `base`: the storage itself
  // when the view spans it, else a copy (charged, and counted against
  // max_tensor_bytes).
  absl::StatusOr<PyValuePtr> NewTensorView(const at::Tensor& base,
                                           const std::vector<int64_t>& sizes,
                                           const std::vector<int64_t>& strides, int64_t offset,
                                           int64_t numel, const std::string& shape) {
    const int64_t storage_numel = base.numel();
    TP_ASSIGN_OR_RETURN(PyValuePtr v, New(Kind::kTensor));
    if (offset == 0 && numel == storage_numel &&
        (IsContiguous(sizes, strides, numel) || numel == 0)) {
      TP_RETURN_IF_ERROR(Charge(kTensorBytes));
      v->tensor = base.view(sizes);  // the whole storage: shared, like torch.load's
      return v;
    }
    // Part of a storage, or strided, or expanded (larger than the storage):
    // copied out, charged before it is allocated.
    int64_t bytes;
    if (__builtin_mul_overflow(numel, static_cast<int64_t>(base.element_size()), &bytes) ||
        __builtin_add_overflow(tensor_bytes_, bytes, &tensor_bytes_) ||
        tensor_bytes_ > limits_.max_tensor_bytes) {
      return Error(absl::StatusCode::kResourceExhausted,
                   absl::StrCat("tensor views add up to more than max_tensor_bytes (",
                                limits_.max_tensor_bytes, ")"));
    }
    TP_RETURN_IF_ERROR(
        Charge(kTensorBytes + static_cast<uint64_t>(bytes),
               absl::StrCat("a copy of the view ", shape, " of a storage of ", storage_numel, " ",
                            DtypeName(base.scalar_type()), " (", bytes, " bytes)")));
    v->tensor = base.as_strided(sizes, strides, base.storage_offset() + offset)
                    .clone(at::MemoryFormat::Contiguous);
    return v;
  }

  // Checks the persistent id ('storage', storage_type, key, location, numel)
  // and returns the storage type's dtype.
  absl::StatusOr<c10::ScalarType> CheckPersistentId(const PyValue& pid) const {
    const auto& t = pid.items;
    if (pid.kind != Kind::kTuple || t.size() != 5 || !IsPlain(t[0], Kind::kString) ||
        t[0]->s != "storage") {
      return Unsupported(absl::StrCat("persistent id is a ", DescribeNode(&pid),
                                      ", not ('storage', type, key, location, numel)"));
    }
    auto type = callables_.find(t[1].get());
    if (type == callables_.end() || type->second.fn != Fn::kStorageType) {
      return Unsupported(absl::StrCat("storage type is a ", DescribeNode(t[1].get())));
    }
    if (!IsPlain(t[2], Kind::kString) || t[2]->s.empty() || t[2]->s.size() > 64 ||
        !std::all_of(t[2]->s.begin(), t[2]->s.end(), [](char ch) {
          return absl::ascii_isalnum(ch) || ch == '_' || ch == '.' || ch == '-';
        })) {
      return Unsupported(absl::StrCat("bad storage key ", IsPlain(t[2], Kind::kString)
                                                              ? QuoteForError(t[2]->s)
                                                              : DescribeNode(t[2].get())));
    }
    if (!IsPlain(t[3], Kind::kString)) return Unsupported("storage location is not a string");
    if (!IsPlain(t[4], Kind::kInt) || t[4]->i < 0) {
      return Unsupported(absl::StrCat("storage size is a ", DescribeNode(t[4].get())));
    }
    return type->second.dtype;
  }

  // Persistent id ('storage', storage_type, key, location, numel).
  absl::StatusOr<PyValuePtr> LoadStorage(const PyValue& pid) {
    TP_ASSIGN_OR_RETURN(const c10::ScalarType dtype, CheckPersistentId(pid));
    const std::string& key = pid.items[2]->s;
    const int64_t numel = pid.items[4]->i;
    if (auto it = storages_by_key_.find(key); it != storages_by_key_.end()) {
      const at::Tensor& have = it->second->tensor;
      if (have.scalar_type() != dtype || have.numel() != numel) {
        return Corrupt(absl::StrCat("storage ", QuoteForError(key), " is referenced as ",
                                    DtypeName(dtype), " x ", numel, " and as ",
                                    DtypeName(have.scalar_type()), " x ", have.numel()));
      }
      return it->second;
    }
    // Location ("cpu", "cuda:0", ...) is ignored: everything loads on the CPU.
    // The storage's bytes are the file's (the loader checks its record's size
    // before reading it); what is charged is the tensor and the indexes.
    TP_RETURN_IF_ERROR(Charge(kTensorBytes + 3 * kNodeBytes + StringBytes(key.size())));
    absl::StatusOr<at::Tensor> loaded = loader_(key, dtype, numel);
    if (!loaded.ok()) return Error(loaded.status().code(), loaded.status().message());
    const at::Tensor& s = *loaded;
    if (!s.defined() || s.scalar_type() != dtype || s.dim() != 1 || s.numel() != numel ||
        !s.is_contiguous() || !s.device().is_cpu()) {
      PyValue got;
      got.kind = Kind::kTensor;
      got.tensor = s;
      return Corrupt(absl::StrCat("storage ", QuoteForError(key), " loaded as a ", got.Describe(),
                                  ", not as ", DtypeName(dtype), " x ", numel));
    }
    if (basis_grows_) {
      basis_ = SaturatingAdd(basis_, s.nbytes());
      SetBudget();
    }
    TP_ASSIGN_OR_RETURN(PyValuePtr v, New(Kind::kTensor));
    v->tensor = s;
    storage_nodes_.insert(v.get());
    storages_by_key_.emplace(key, v);
    return v;
  }

  // ---- the end

  // The result must be acyclic, at most max_depth deep, and hold no bare
  // globals. Marks what is reachable so that Dismantle keeps exactly that.
  absl::StatusOr<PyValuePtr> Finish() {
    TP_ASSIGN_OR_RETURN(PyValuePtr result, Pop());
    if (!stack_.empty() || !marks_.empty()) {
      return Corrupt(absl::StrCat("STOP leaves ", stack_.size(), " values and ", marks_.size(),
                                  " MARKs on the stack"));
    }
    if (pos_ != data_.size())
      return Corrupt(absl::StrCat(data_.size() - pos_, " bytes follow STOP"));
    TP_RETURN_IF_ERROR(CheckGraph(result.get()));
    succeeded_ = true;
    return result;
  }

  // Walks what `root` reaches, depth first: no bare global, no cycle, at most
  // max_depth deep; records each container's height in height_. Iterative:
  // neither the input nor a cycle can exhaust the C++ stack.
  absl::Status CheckGraph(const PyValue* root) {
    const int64_t max_depth = std::max<int64_t>(limits_.max_depth, 1);
    // height_: finished containers -> height (a leaf's is 0); on_path:
    // containers being visited. (Both charged when the containers were made.)
    struct Frame {
      const PyValue* node;
      size_t next;
      int64_t height;
    };
    std::unordered_set<const PyValue*> on_path;
    std::vector<Frame> path;
    auto enter = [&](const PyValue* v) -> absl::Status {
      if (auto it = callables_.find(v); it != callables_.end()) {
        return Unsupported(absl::StrCat("the data holds the global ", it->second.name,
                                        " itself, not a call of it"));
      }
      if (static_cast<int64_t>(path.size()) + 1 > max_depth) {
        return Unsupported(absl::StrCat("nested deeper than max_depth (", limits_.max_depth, ")"));
      }
      if (!IsContainer(v->kind)) return absl::OkStatus();  // a leaf: nothing to walk or keep
      on_path.insert(v);
      path.push_back({v, 0, 0});
      return absl::OkStatus();
    };
    TP_RETURN_IF_ERROR(enter(root));
    while (!path.empty()) {
      Frame& f = path.back();
      const PyValue* child = nullptr;
      const size_t n_items = f.node->items.size();
      if (f.next < n_items) {
        child = f.node->items[f.next].get();
      } else if (f.next < n_items + 2 * f.node->entries.size()) {
        const auto& e = f.node->entries[(f.next - n_items) / 2];
        child = ((f.next - n_items) % 2 == 0 ? e.first : e.second).get();
      }
      if (child != nullptr) {
        ++f.next;
        if (auto it = height_.find(child); it != height_.end()) {
          if (static_cast<int64_t>(path.size()) + 1 + it->second > max_depth) {
            return Unsupported(
                absl::StrCat("nested deeper than max_depth (", limits_.max_depth, ")"));
          }
          f.height = std::max(f.height, it->second + 1);
          continue;
        }
        if (on_path.count(child)) return Unsupported("the data contains a reference cycle");
        TP_RETURN_IF_ERROR(enter(child));
        if (!IsContainer(child->kind)) f.height = std::max<int64_t>(f.height, 1);
        continue;
      }
      const int64_t h = f.height;
      height_.emplace(f.node, h);
      on_path.erase(f.node);
      path.pop_back();
      if (!path.empty()) path.back().height = std::max(path.back().height, h + 1);
    }
    return absl::OkStatus();
  }

  // Cuts every node the result does not reach loose from its children, so
  // that dropping the arena frees them one by one (no deep recursion, no
  // leaked cycles) whatever the pickle built.
  void Dismantle() {
    stack_.clear();
    memo_.clear();
    storages_by_key_.clear();
    encoded_.clear();
    for (const PyValuePtr& v : arena_) {
      if (succeeded_ && height_.count(v.get())) continue;
      v->items.clear();
      v->entries.clear();
    }
    arena_.clear();
  }

  const absl::string_view data_;
  const StorageLoader& loader_;
  const std::string& name_;
  const TorchReadLimits limits_;

  size_t pos_ = 0;
  size_t op_pos_ = 0;
  int op_ = -1;
  uint64_t max_items_ = 0;
  uint64_t items_ = 0;
  const bool basis_grows_;  // ParsePickle: the storages loaded add to the basis
  uint64_t basis_;          // the file's bytes, which the memory budget is a multiple of
  uint64_t budget_ = 0;
  uint64_t used_ = 0;  // of budget_
  int64_t tensor_bytes_ = 0;
  bool succeeded_ = false;

  // The shared constants.
  PyValuePtr none_;
  PyValuePtr bools_[2];
  PyValuePtr empty_tuple_;
  std::array<PyValuePtr, 256> small_ints_;

  std::vector<PyValuePtr> arena_;  // every container created (leaves hold no values)
  std::vector<PyValuePtr> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint64_t, PyValuePtr> memo_;
  std::unordered_map<std::string, PyValuePtr> globals_;  // by module.name
  std::unordered_map<const PyValue*, Callable> callables_;
  std::unordered_set<const PyValue*> storage_nodes_;
  std::unordered_map<std::string, PyValuePtr> storages_by_key_;
  std::unordered_set<const PyValue*> ordered_dicts_;
  std::unordered_map<const PyValue*, PyValuePtr> encoded_;
  std::unordered_map<const PyValue*, uint64_t> key_ids_;
  std::unordered_map<std::string, uint64_t> key_intern_;
  // (dict, key id) -> index in the dict's entries.
  std::unordered_map<std::pair<const PyValue*, uint64_t>, size_t, PairHash> dict_index_;
  std::unordered_map<const PyValue*, int64_t> height_;
};

absl::StatusOr<PyValuePtr> ParsePickleOf(absl::string_view pickle,
                                         const StorageLoader& load_storage,
                                         const std::string& name_for_errors,
                                         const TorchReadLimits& limits, uint64_t file_bytes) {
  try {
    Unpickler unpickler(pickle, load_storage, name_for_errors, limits, file_bytes);
    return unpickler.Run();
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(
        absl::StrCat(name_for_errors, ": out of memory reading data.pkl"));
  } catch (const std::exception& e) {
    return absl::DataLossError(absl::StrCat(name_for_errors, ": data.pkl: ", ExceptionOneLine(e)));
  }
}

// What ReadArchive checks before the zip directory: the file's size and
// that it is a torch.save zip archive (not the legacy format).
absl::Status CheckFileHead(const BoundedReadAdapter& in, const std::string& name,
                           const TorchReadLimits& limits) {
  const uint64_t size = in.size();
  if (size > static_cast<uint64_t>(std::max<int64_t>(limits.max_file_bytes, 0))) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ": ", size, " bytes, more than max_file_bytes (", limits.max_file_bytes, ")"));
  }
  if (size == 0)
    return absl::InvalidArgumentError(absl::StrCat(name, ": empty file, not a torch.save file"));
  char head[14];
  in.read(0, head, sizeof(head));
  // The legacy format starts with the pickled magic number 0x1950a86a20f9469cfc6c.
  static constexpr char kLegacy[14] = {'\x80', '\x02', '\x8a', '\x0a', '\x6c', '\xfc', '\x9c',
                                       '\x46', '\xf9', '\x20', '\x6a', '\xa8', '\x50', '\x19'};
  if (size >= sizeof(head) && std::memcmp(head, kLegacy, sizeof(head)) == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        name,
        ": a torch.save file in the legacy format (written with "
        "_use_new_zipfile_serialization=False); re-save it with a current torch.save"));
  }
  if (size < 4 || std::memcmp(head, "PK\x03\x04", 4) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": not a torch.save file (not a zip archive; starts with ",
                     QuoteForError(absl::string_view(head, std::min<uint64_t>(size, 8))), ")"));
  }
  return absl::OkStatus();
}

// The StorageLoader of an archive: storage `key` (record "data/<key>") of
// `numel` elements of `dtype`, read once its size in the checked zip
// directory matches and it fits in what is left of the file besides the
// *loaded bytes taken out of the archive so far (which it adds to).
absl::StatusOr<at::Tensor> LoadStorageRecord(TorchZipReader& zip, uint64_t* loaded,
                                             const std::string& key, c10::ScalarType dtype,
                                             int64_t numel) {
  const uint64_t size = zip.file_size();
  const std::string record = "data/" + key;
  try {
    // The record's size, from the checked zip directory, before anything
    // is allocated: a storage costs what the file holds, no more.
    const std::optional<uint64_t> entry = zip.RecordSize(record);
    if (!entry.has_value() || !zip.HasRecord(record)) {
      return absl::DataLossError(absl::StrCat("no record ", record));
    }
    const uint64_t element = c10::elementSize(dtype);
    const uint64_t have = *entry;
    if (have % element != 0 || have / element != static_cast<uint64_t>(numel)) {
      return absl::DataLossError(absl::StrCat("record ", record, " holds ", have, " bytes, not ",
                                              numel, " ", DtypeName(dtype)));
    }
    const uint64_t bytes = have;
    if (bytes > size - *loaded) {
      return absl::DataLossError(absl::StrCat("storage ", record, " of ", numel, " ",
                                              DtypeName(dtype),
                                              " does not fit in what is left of the file"));
    }
    auto [ptr, len] = zip.GetRecord(record);
    if (len != bytes) {
      return absl::DataLossError(absl::StrCat("record ", record, " holds ", len, " bytes, not ",
                                              numel, " ", DtypeName(dtype), " (", bytes,
                                              " bytes)"));
    }
    *loaded += bytes;
    if (dtype == c10::ScalarType::Bool) {  // any byte but 0/1 is undefined behaviour for a bool
      auto* b = static_cast<uint8_t*>(ptr.get());
      for (uint64_t k = 0; k < bytes; ++k) b[k] = b[k] != 0;
    }
    c10::Storage storage(c10::Storage::use_byte_size_t(), bytes, std::move(ptr), nullptr, false);
    return at::empty({0}, at::TensorOptions().dtype(dtype)).set_(storage, 0, {numel}, {1});
  } catch (const std::exception& e) {
    return absl::DataLossError(absl::StrCat("reading ", record, ": ", ExceptionOneLine(e)));
  }
}

absl::StatusOr<PyValuePtr> ReadArchive(const std::shared_ptr<BoundedReadAdapter>& in,
                                       const std::string& name, const TorchReadLimits& limits) {
  TP_RETURN_IF_ERROR(CheckFileHead(*in, name, limits));
  TP_ASSIGN_OR_RETURN(std::unique_ptr<TorchZipReader> zip, TorchZipReader::Open(in, name));
  try {
    if (zip->HasRecord("byteorder")) {
      auto [ptr, len] = zip->GetRecord("byteorder");
      const std::string order(static_cast<const char*>(ptr.get()), len);
      if (order != "little") {
        return absl::InvalidArgumentError(absl::StrCat(name, ": storages are stored ",
                                                       QuoteForError(order),
                                                       "-endian; only little-endian is supported"));
      }
    }
    if (!zip->HasRecord("data.pkl")) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": a zip archive without data.pkl, not a torch.save file"));
    }
    auto [pkl_ptr, pkl_len] = zip->GetRecord("data.pkl");
    uint64_t loaded = pkl_len;  // bytes taken out of the archive so far
    StorageLoader loader = [&](const std::string& key, c10::ScalarType dtype,
                               int64_t numel) -> absl::StatusOr<at::Tensor> {
      return LoadStorageRecord(*zip, &loaded, key, dtype, numel);
    };
    return ParsePickleOf(absl::string_view(static_cast<const char*>(pkl_ptr.get()), pkl_len),
                         loader, name, limits, in->size());
  } catch (const std::exception& e) {
    return absl::DataLossError(
        absl::StrCat(name, ": not a readable torch.save archive: ", ExceptionOneLine(e)));
  }
}

}  // namespace

absl::StatusOr<PyValuePtr> ParsePickle(absl::string_view pickle, const StorageLoader& load_storage,
                                       const std::string& name_for_errors,
                                       const TorchReadLimits& limits) {
  return ParsePickleOf(pickle, load_storage, name_for_errors, limits, 0);
}

absl::StatusOr<PyValuePtr> ReadTorchBytes(const std::string& bytes,
                                          const std::string& name_for_errors,
                                          const TorchReadLimits& limits) {
  try {
    return ReadArchive(std::make_shared<BoundedReadAdapter>(bytes.data(), bytes.size()),
                       name_for_errors, limits);
  } catch (const std::exception& e) {
    return absl::DataLossError(absl::StrCat(name_for_errors, ": ", ExceptionOneLine(e)));
  }
}

absl::StatusOr<PyValuePtr> ReadTorchFile(const std::string& path, const TorchReadLimits& limits) {
  // O_NONBLOCK: opening a FIFO must not wait for a writer.
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT) return absl::NotFoundError(absl::StrCat(path, ": no such file"));
    return absl::InvalidArgumentError(absl::StrCat(path, ": cannot open: ", std::strerror(err)));
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file"));
  }
  try {
    return ReadArchive(std::make_shared<BoundedReadAdapter>(fd, static_cast<uint64_t>(st.st_size)),
                       path, limits);
  } catch (const std::exception& e) {
    return absl::DataLossError(absl::StrCat(path, ": ", ExceptionOneLine(e)));
  }
}

}  // namespace shardopt
