#include "client/checkpoint/manifest.h"

#include <algorithm>
#include <cmath>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/crc32c.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "common/optimizer_config.h"

namespace shardopt {

namespace {

using nlohmann::json;

constexpr int kMaxJsonDepth = 16;
constexpr char kCrcKey[] = "manifest_crc32c";

// Refuses documents nested deeper than `max_depth` before they are parsed, so
// that nothing downstream (dump, destruction) recurses on hostile input.
bool DepthAtMost(const std::string& text, int max_depth) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (char c : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth) return false;
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return true;
}

absl::StatusOr<json> ParseJson(const std::string& text, const std::string& where) {
  if (!DepthAtMost(text, kMaxJsonDepth)) {
    return absl::DataLossError(
        absl::StrCat("'", where, "' is corrupt: nested deeper than ", kMaxJsonDepth));
  }
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded())
    return absl::DataLossError(absl::StrCat("'", where, "' is corrupt: not valid JSON"));
  return j;
}

// Typed access that never throws: every error names the file and the field.
class Fields {
 public:
  explicit Fields(std::string where) : where_(std::move(where)) {}

  absl::Status Error(const std::string& field, const std::string& what) const {
    return absl::DataLossError(absl::StrCat("'", where_, "' is corrupt: ", field, " ", what));
  }
  absl::StatusOr<const json*> Member(const json& obj, const std::string& key,
                                     const std::string& ctx) const {
    if (!obj.is_object()) return Error(ctx, "is not an object");
    auto it = obj.find(key);
    if (it == obj.end()) return Error(Join(ctx, key), "is missing");
    return &*it;
  }
  absl::StatusOr<int64_t> Int(const json& v, const std::string& field, int64_t lo,
                              int64_t hi) const {
    int64_t x;
    if (v.is_number_unsigned()) {
      const uint64_t u = v.get<uint64_t>();
      if (u > static_cast<uint64_t>(INT64_MAX))
        return Error(field, absl::StrCat("is out of range [", lo, ", ", hi, "]"));
      x = static_cast<int64_t>(u);
    } else if (v.is_number_integer()) {
      x = v.get<int64_t>();
    } else {
      return Error(field, absl::StrCat("must be an integer, is ", v.type_name()));
    }
    if (x < lo || x > hi)
      return Error(field, absl::StrCat("is ", x, ", outside [", lo, ", ", hi, "]"));
    return x;
  }
  absl::StatusOr<int64_t> IntAt(const json& obj, const std::string& key, const std::string& ctx,
                                int64_t lo, int64_t hi) const {
    SHARDOPT_ASSIGN_OR_RETURN(const json* v, Member(obj, key, ctx));
    return Int(*v, Join(ctx, key), lo, hi);
  }
  absl::StatusOr<double> DoubleAt(const json& obj, const std::string& key,
                                  const std::string& ctx) const {
    SHARDOPT_ASSIGN_OR_RETURN(const json* v, Member(obj, key, ctx));
    if (!v->is_number())
      return Error(Join(ctx, key), absl::StrCat("must be a number, is ", v->type_name()));
    const double d = v->get<double>();
    if (!std::isfinite(d)) return Error(Join(ctx, key), "is not finite");
    return d;
  }
  absl::StatusOr<bool> BoolAt(const json& obj, const std::string& key,
                              const std::string& ctx) const {
    SHARDOPT_ASSIGN_OR_RETURN(const json* v, Member(obj, key, ctx));
    if (!v->is_boolean())
      return Error(Join(ctx, key), absl::StrCat("must be true or false, is ", v->type_name()));
    return v->get<bool>();
  }
  absl::StatusOr<std::string> StringAt(const json& obj, const std::string& key,
                                       const std::string& ctx, size_t max_len = 4096) const {
    SHARDOPT_ASSIGN_OR_RETURN(const json* v, Member(obj, key, ctx));
    if (!v->is_string())
      return Error(Join(ctx, key), absl::StrCat("must be a string, is ", v->type_name()));
    const std::string& s = v->get_ref<const std::string&>();
    if (s.size() > max_len) return Error(Join(ctx, key), "is too long");
    return s;
  }
  absl::StatusOr<const json*> ArrayAt(const json& obj, const std::string& key,
                                      const std::string& ctx) const {
    SHARDOPT_ASSIGN_OR_RETURN(const json* v, Member(obj, key, ctx));
    if (!v->is_array())
      return Error(Join(ctx, key), absl::StrCat("must be an array, is ", v->type_name()));
    return v;
  }
  absl::StatusOr<std::map<std::string, std::string>> StringMap(const json& v,
                                                               const std::string& field) const {
    std::map<std::string, std::string> out;
    if (v.is_null()) return out;
    if (!v.is_object()) return Error(field, "must be an object of strings");
    for (auto it = v.begin(); it != v.end(); ++it) {
      if (!it.value().is_string())
        return Error(absl::StrCat(field, ".", it.key()), "must be a string");
      out[it.key()] = it.value().get<std::string>();
    }
    return out;
  }
  static std::string Join(const std::string& ctx, const std::string& key) {
    return ctx.empty() ? key : absl::StrCat(ctx, ".", key);
  }

 private:
  std::string where_;
};

absl::StatusOr<SavedOptimizer> ParseOptimizerJson(const json& o, const Fields& f,
                                                  const std::string& ctx) {
  SavedOptimizer s;
  SHARDOPT_ASSIGN_OR_RETURN(s.kind, f.StringAt(o, "kind", ctx, 16));
  SHARDOPT_ASSIGN_OR_RETURN(s.lr, f.DoubleAt(o, "lr", ctx));
  SHARDOPT_ASSIGN_OR_RETURN(s.weight_decay, f.DoubleAt(o, "weight_decay", ctx));
  absl::Status valid;
  if (s.kind == "adam" || s.kind == "adamw") {
    SHARDOPT_ASSIGN_OR_RETURN(const json* betas, f.ArrayAt(o, "betas", ctx));
    if (betas->size() != 2) return f.Error(ctx + ".betas", "must hold two numbers");
    for (int i = 0; i < 2; ++i) {
      if (!(*betas)[i].is_number()) return f.Error(ctx + ".betas", "must hold two numbers");
    }
    s.beta1 = (*betas)[0].get<double>();
    s.beta2 = (*betas)[1].get<double>();
    SHARDOPT_ASSIGN_OR_RETURN(s.eps, f.DoubleAt(o, "eps", ctx));
    AdamConfig c;
    c.lr = s.lr;
    c.beta1 = s.beta1;
    c.beta2 = s.beta2;
    c.eps = s.eps;
    c.weight_decay = s.weight_decay;
    valid = ValidateAdamConfig(c);
  } else if (s.kind == "sgd") {
    SHARDOPT_ASSIGN_OR_RETURN(s.momentum, f.DoubleAt(o, "momentum", ctx));
    SHARDOPT_ASSIGN_OR_RETURN(s.dampening, f.DoubleAt(o, "dampening", ctx));
    SHARDOPT_ASSIGN_OR_RETURN(s.nesterov, f.BoolAt(o, "nesterov", ctx));
    SgdConfig c;
    c.lr = s.lr;
    c.momentum = s.momentum;
    c.dampening = s.dampening;
    c.weight_decay = s.weight_decay;
    c.nesterov = s.nesterov;
    valid = ValidateSgdConfig(c);
  } else {
    return f.Error(ctx + ".kind", absl::StrCat("is '", s.kind, "', not adam, adamw or sgd"));
  }
  if (!valid.ok()) return f.Error(ctx, std::string(valid.message()));
  return s;
}

json OptimizerToJson(const SavedOptimizer& o) {
  json j;
  j["kind"] = o.kind;
  j["lr"] = o.lr;
  j["weight_decay"] = o.weight_decay;
  if (o.kind == "sgd") {
    j["momentum"] = o.momentum;
    j["dampening"] = o.dampening;
    j["nesterov"] = o.nesterov;
  } else {
    j["betas"] = {o.beta1, o.beta2};
    j["eps"] = o.eps;
  }
  return j;
}

std::vector<std::string> ExpectedStates(const SavedOptimizer& o) {
  if (o.kind == "sgd") {
    if (o.momentum != 0) return {"param", "momentum_buffer"};
    return {"param"};
  }
  return {"param", "exp_avg", "exp_avg_sq"};
}

bool ParseDType(const std::string& s, DType* out) {
  for (DType d : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    if (s == DTypeName(d)) {
      *out = d;
      return true;
    }
  }
  return false;
}

std::string ShardFileName(int rank, int world) {
  return absl::StrCat("shard-", rank, "-of-", world, ".safetensors");
}

absl::Status ParseParams(const json& doc, const Fields& f, Manifest* m) {
  SHARDOPT_ASSIGN_OR_RETURN(const json* params, f.ArrayAt(doc, "params", ""));
  std::set<std::string> names;
  for (size_t i = 0; i < params->size(); ++i) {
    const json& pj = (*params)[i];
    const std::string ctx = absl::StrCat("params[", i, "]");
    ManifestParam p;
    SHARDOPT_ASSIGN_OR_RETURN(p.name, f.StringAt(pj, "name", ctx));
    if (p.name.empty() || !names.insert(p.name).second)
      return f.Error(ctx + ".name", "is empty or repeated");
    SHARDOPT_ASSIGN_OR_RETURN(const json* shape, f.ArrayAt(pj, "shape", ctx));
    if (shape->size() > 32) return f.Error(ctx + ".shape", "has too many dimensions");
    p.numel = 1;
    for (size_t d = 0; d < shape->size(); ++d) {
      SHARDOPT_ASSIGN_OR_RETURN(
          int64_t dim,
          f.Int((*shape)[d], absl::StrCat(ctx, ".shape[", d, "]"), 0, kMaxTensorElements));
      p.shape.push_back(dim);
      if (dim != 0 && p.numel > kMaxTensorElements / dim) {
        return f.Error(ctx + ".shape",
                       absl::StrCat("has more than ", kMaxTensorElements, " elements"));
      }
      p.numel *= dim;
    }
    SHARDOPT_ASSIGN_OR_RETURN(std::string dtype, f.StringAt(pj, "dtype", ctx, 32));
    if (!ParseDType(dtype, &p.dtype))
      return f.Error(ctx + ".dtype", absl::StrCat("'", dtype, "' is unknown"));
    SHARDOPT_ASSIGN_OR_RETURN(p.trainable, f.BoolAt(pj, "trainable", ctx));
    m->params.push_back(std::move(p));
  }
  return absl::OkStatus();
}

absl::Status ParseFiles(const json& doc, const Fields& f, Manifest* m) {
  SHARDOPT_ASSIGN_OR_RETURN(const json* files, f.ArrayAt(doc, "files", ""));
  if (files->size() != static_cast<size_t>(m->world_size)) {
    return f.Error("files",
                   absl::StrCat("lists ", files->size(), " shards for ", m->world_size, " ranks"));
  }
  for (size_t q = 0; q < files->size(); ++q) {
    const json& fj = (*files)[q];
    const std::string ctx = absl::StrCat("files[", q, "]");
    ManifestFile file;
    SHARDOPT_ASSIGN_OR_RETURN(file.name, f.StringAt(fj, "name", ctx, 255));
    // Names are fixed by the format, so nothing outside the step directory
    // (no '/', no '..', no other file) can ever be named.
    if (file.name != ShardFileName(static_cast<int>(q), m->world_size)) {
      return f.Error(ctx + ".name",
                     absl::StrCat("'", file.name, "' is not ",
                                  ShardFileName(static_cast<int>(q), m->world_size)));
    }
    SHARDOPT_ASSIGN_OR_RETURN(file.bytes, f.IntAt(fj, "bytes", ctx, 8, INT64_MAX / 4));
    SHARDOPT_ASSIGN_OR_RETURN(int64_t crc, f.IntAt(fj, "crc32c", ctx, 0, UINT32_MAX));
    file.crc32c = static_cast<uint32_t>(crc);
    m->files.push_back(std::move(file));
  }
  return absl::OkStatus();
}

absl::Status ParsePiece(const json& pj, const Fields& f, const std::string& ctx, const Manifest& m,
                        ManifestPiece* p) {
  SHARDOPT_ASSIGN_OR_RETURN(
      int64_t param, f.IntAt(pj, "param", ctx, 0, static_cast<int64_t>(m.params.size()) - 1));
  p->param = static_cast<int>(param);
  const ManifestParam& mp = m.params[p->param];
  if (!mp.trainable)
    return f.Error(ctx + ".param", absl::StrCat("names frozen parameter '", mp.name, "'"));
  SHARDOPT_ASSIGN_OR_RETURN(p->offset, f.IntAt(pj, "offset", ctx, 0, mp.numel - 1));
  SHARDOPT_ASSIGN_OR_RETURN(p->length, f.IntAt(pj, "length", ctx, 1, mp.numel - p->offset));
  SHARDOPT_ASSIGN_OR_RETURN(int64_t file, f.IntAt(pj, "file", ctx, 0, m.world_size - 1));
  p->file = static_cast<int>(file);
  const int64_t file_bytes = m.files[p->file].bytes;
  const int64_t bytes = p->length * 4;
  SHARDOPT_ASSIGN_OR_RETURN(const json* begin, f.ArrayAt(pj, "begin", ctx));
  SHARDOPT_ASSIGN_OR_RETURN(const json* crcs, f.ArrayAt(pj, "crc32c", ctx));
  if (begin->size() != m.states.size() || crcs->size() != m.states.size()) {
    return f.Error(
        ctx, absl::StrCat("needs one begin and one CRC list per state (", m.states.size(), ")"));
  }
  const int64_t blocks = (bytes + m.block_bytes - 1) / m.block_bytes;
  for (size_t s = 0; s < m.states.size(); ++s) {
    SHARDOPT_ASSIGN_OR_RETURN(
        int64_t b, f.Int((*begin)[s], absl::StrCat(ctx, ".begin[", s, "]"), 8, file_bytes - bytes));
    p->begin.push_back(b);
    const json& list = (*crcs)[s];
    if (!list.is_array() || static_cast<int64_t>(list.size()) != blocks) {
      return f.Error(absl::StrCat(ctx, ".crc32c[", s, "]"),
                     absl::StrCat("must list ", blocks, " block CRCs"));
    }
    std::vector<uint32_t> out;
    out.reserve(static_cast<size_t>(blocks));
    for (size_t k = 0; k < list.size(); ++k) {
      SHARDOPT_ASSIGN_OR_RETURN(
          int64_t c, f.Int(list[k], absl::StrCat(ctx, ".crc32c[", s, "]"), 0, UINT32_MAX));
      out.push_back(static_cast<uint32_t>(c));
    }
    p->crc32c.push_back(std::move(out));
  }
  return absl::OkStatus();
}

// Every trainable parameter is tiled exactly by its pieces; frozen ones have
// none; no two byte ranges in a file overlap.
absl::Status CheckCoverage(const Fields& f, Manifest* m) {
  m->pieces_of_param.assign(m->params.size(), {});
  for (size_t k = 0; k < m->pieces.size(); ++k)
    m->pieces_of_param[m->pieces[k].param].push_back(static_cast<int>(k));
  for (size_t i = 0; i < m->params.size(); ++i) {
    auto& v = m->pieces_of_param[i];
    std::sort(v.begin(), v.end(),
              [&](int a, int b) { return m->pieces[a].offset < m->pieces[b].offset; });
    if (!m->params[i].trainable) continue;
    int64_t next = 0;
    for (int k : v) {
      const ManifestPiece& p = m->pieces[k];
      if (p.offset != next) {
        return f.Error("pieces", absl::StrCat("of parameter '", m->params[i].name, "' ",
                                              p.offset < next ? "overlap" : "leave a gap",
                                              " at element ", std::min(p.offset, next)));
      }
      next = p.offset + p.length;
    }
    if (next != m->params[i].numel) {
      return f.Error("pieces", absl::StrCat("cover ", next, " of the ", m->params[i].numel,
                                            " elements of '", m->params[i].name, "'"));
    }
  }
  std::vector<std::vector<std::pair<int64_t, int64_t>>> ranges(m->files.size());
  for (const ManifestPiece& p : m->pieces) {
    for (int64_t b : p.begin) ranges[p.file].push_back({b, b + p.length * 4});
  }
  for (size_t q = 0; q < ranges.size(); ++q) {
    auto& r = ranges[q];
    std::sort(r.begin(), r.end());
    for (size_t k = 1; k < r.size(); ++k) {
      if (r[k].first < r[k - 1].second) {
        return f.Error("pieces",
                       absl::StrCat("overlap inside ", m->files[q].name, " at byte ", r[k].first));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status ParseBody(const json& doc, const Fields& f, Manifest* m) {
  SHARDOPT_ASSIGN_OR_RETURN(m->step, f.IntAt(doc, "step", "", 0, int64_t{1} << 62));
  SHARDOPT_ASSIGN_OR_RETURN(int64_t world, f.IntAt(doc, "world_size", "", 1, kMaxWorldSize));
  m->world_size = static_cast<int>(world);
  SHARDOPT_ASSIGN_OR_RETURN(const json* opt, f.Member(doc, "optimizer", ""));
  SHARDOPT_ASSIGN_OR_RETURN(m->optimizer, ParseOptimizerJson(*opt, f, "optimizer"));
  SHARDOPT_ASSIGN_OR_RETURN(const json* plan, f.Member(doc, "plan", ""));
  SHARDOPT_ASSIGN_OR_RETURN(m->plan_bucket_cap_elements,
                            f.IntAt(*plan, "bucket_cap_elements", "plan", 1, kMaxTensorElements));
  SHARDOPT_ASSIGN_OR_RETURN(m->plan_alignment_elements,
                            f.IntAt(*plan, "alignment_elements", "plan", 1, 1 << 20));
  SHARDOPT_ASSIGN_OR_RETURN(m->plan_allow_cut, f.BoolAt(*plan, "allow_cut", "plan"));
  SHARDOPT_ASSIGN_OR_RETURN(m->layout_hash, f.StringAt(doc, "layout_hash", "", 64));
  SHARDOPT_ASSIGN_OR_RETURN(const json* states, f.ArrayAt(doc, "states", ""));
  for (const json& s : *states) {
    if (!s.is_string()) return f.Error("states", "must be strings");
    m->states.push_back(s.get<std::string>());
  }
  if (m->states != ExpectedStates(m->optimizer)) {
    return f.Error("states", absl::StrCat("are ", states->dump(), ", ", m->optimizer.kind,
                                          " needs ", json(ExpectedStates(m->optimizer)).dump()));
  }
  SHARDOPT_ASSIGN_OR_RETURN(m->block_bytes, f.IntAt(doc, "block_bytes", "", 4, 64 << 20));
  if (m->block_bytes % 4 != 0) return f.Error("block_bytes", "must be a multiple of 4");
  SHARDOPT_RETURN_IF_ERROR(ParseParams(doc, f, m));
  SHARDOPT_RETURN_IF_ERROR(ParseFiles(doc, f, m));
  SHARDOPT_ASSIGN_OR_RETURN(const json* pieces, f.ArrayAt(doc, "pieces", ""));
  for (size_t k = 0; k < pieces->size(); ++k) {
    ManifestPiece p;
    SHARDOPT_RETURN_IF_ERROR(ParsePiece((*pieces)[k], f, absl::StrCat("pieces[", k, "]"), *m, &p));
    m->pieces.push_back(std::move(p));
  }
  SHARDOPT_RETURN_IF_ERROR(CheckCoverage(f, m));
  auto um = doc.find("user_metadata");
  if (um != doc.end()) {
    SHARDOPT_ASSIGN_OR_RETURN(m->user_metadata, f.StringMap(*um, "user_metadata"));
  }
  return absl::OkStatus();
}

uint32_t DocumentCrc(const json& doc_without_crc) {
  const std::string canonical = doc_without_crc.dump(1);
  return Crc32c(canonical.data(), canonical.size());
}

}  // namespace

int64_t Manifest::total_file_bytes() const {
  int64_t t = 0;
  for (const ManifestFile& f : files) t += f.bytes;
  return t;
}

absl::StatusOr<Manifest> ParseManifest(const std::string& text, const std::string& where) {
  if (static_cast<int64_t>(text.size()) > kMaxManifestBytes) {
    return absl::DataLossError(
        absl::StrCat("'", where, "' is larger than ", kMaxManifestBytes, " bytes"));
  }
  SHARDOPT_ASSIGN_OR_RETURN(json doc, ParseJson(text, where));
  Fields f(where);
  if (!doc.is_object()) return f.Error("the document", "is not a JSON object");
  SHARDOPT_ASSIGN_OR_RETURN(std::string format, f.StringAt(doc, "format", "", 64));
  Manifest m;
  m.format = format;
  if (format == kManifestFormat) {
    SHARDOPT_ASSIGN_OR_RETURN(int64_t crc, f.IntAt(doc, kCrcKey, "", 0, UINT32_MAX));
    doc.erase(kCrcKey);
    if (DocumentCrc(doc) != static_cast<uint32_t>(crc)) {
      return absl::DataLossError(
          absl::StrCat("'", where, "' fails its CRC32C check (edited or corrupt)"));
    }
  } else if (format == kManifestFormatV1) {
    m.self_checked = false;
  } else {
    return f.Error("format", absl::StrCat("'", format, "' is not ", kManifestFormat));
  }
  SHARDOPT_RETURN_IF_ERROR(ParseBody(doc, f, &m));
  return m;
}

std::string SerializeManifest(const Manifest& m) {
  json doc;
  doc["format"] = kManifestFormat;
  doc["step"] = m.step;
  doc["world_size"] = m.world_size;
  doc["optimizer"] = OptimizerToJson(m.optimizer);
  doc["plan"] = {{"bucket_cap_elements", m.plan_bucket_cap_elements},
                 {"alignment_elements", m.plan_alignment_elements},
                 {"allow_cut", m.plan_allow_cut}};
  doc["layout_hash"] = m.layout_hash;
  doc["states"] = m.states;
  doc["block_bytes"] = m.block_bytes;
  doc["params"] = json::array();
  for (const ManifestParam& p : m.params) {
    doc["params"].push_back({{"name", p.name},
                             {"shape", p.shape},
                             {"dtype", DTypeName(p.dtype)},
                             {"trainable", p.trainable}});
  }
  doc["files"] = json::array();
  for (const ManifestFile& f : m.files) {
    doc["files"].push_back({{"name", f.name}, {"bytes", f.bytes}, {"crc32c", f.crc32c}});
  }
  doc["pieces"] = json::array();
  for (const ManifestPiece& p : m.pieces) {
    doc["pieces"].push_back({{"param", p.param},
                             {"offset", p.offset},
                             {"length", p.length},
                             {"file", p.file},
                             {"begin", p.begin},
                             {"crc32c", p.crc32c}});
  }
  doc["user_metadata"] = json::object();
  for (const auto& [k, v] : m.user_metadata) doc["user_metadata"][k] = v;
  doc[kCrcKey] = DocumentCrc(doc);
  return doc.dump(1);
}

std::string ResealManifestForTesting(const std::string& text) {
  json doc = json::parse(text, nullptr, false);
  if (!doc.is_object()) return text;
  doc.erase(kCrcKey);
  doc[kCrcKey] = DocumentCrc(doc);
  return doc.dump(1);
}

std::string SavedOptimizerJson(const SavedOptimizer& o) { return OptimizerToJson(o).dump(); }

absl::StatusOr<SavedOptimizer> ParseSavedOptimizer(const std::string& text,
                                                   const std::string& where) {
  SHARDOPT_ASSIGN_OR_RETURN(json doc, ParseJson(text, where));
  Fields f(where);
  return ParseOptimizerJson(doc, f, "optimizer");
}

absl::Status CheckBlockCrc(const Manifest& m, const ManifestPiece& p, size_t state, int64_t block,
                           const char* data, size_t n, const std::string& file) {
  if (Crc32c(data, n) != p.crc32c[state][static_cast<size_t>(block)]) {
    return absl::DataLossError(absl::StrCat("shard '", file, "' is corrupt: CRC32C mismatch in ",
                                            m.states[state], " of parameter '",
                                            m.params[p.param].name, "'"));
  }
  return absl::OkStatus();
}

absl::Status CheckPieceCrcs(const Manifest& m, const ManifestPiece& p, size_t state,
                            const char* data, const std::string& file) {
  const int64_t bytes = p.length * 4;
  for (int64_t b = 0; b * m.block_bytes < bytes; ++b) {
    const int64_t n = std::min(m.block_bytes, bytes - b * m.block_bytes);
    SHARDOPT_RETURN_IF_ERROR(
        CheckBlockCrc(m, p, state, b, data + b * m.block_bytes, static_cast<size_t>(n), file));
  }
  return absl::OkStatus();
}

absl::StatusOr<Manifest> ReadManifest(FileSystem* fs, const std::string& dir) {
  const std::string path = dir + "/manifest.json";
  SHARDOPT_ASSIGN_OR_RETURN(std::string text, ReadWholeFile(fs, path, kMaxManifestBytes));
  SHARDOPT_ASSIGN_OR_RETURN(Manifest m, ParseManifest(text, path));
  for (const ManifestFile& f : m.files) {
    const std::string fp = dir + "/" + f.name;
    auto size = fs->FileSize(fp);
    if (!size.ok()) {
      return absl::NotFoundError(
          absl::StrCat("shard '", fp, "' is missing or unreadable: ", size.status().message()));
    }
    if (static_cast<int64_t>(*size) != f.bytes) {
      return absl::DataLossError(absl::StrCat(
          "shard '", fp, "' has ", *size, " bytes, the manifest says ", f.bytes, " (truncated?)"));
    }
  }
  return m;
}

// ---- safetensors ----

int SafetensorsDTypeSize(const std::string& d) {
  if (d == "F64" || d == "I64" || d == "U64") return 8;
  if (d == "F32" || d == "I32" || d == "U32") return 4;
  if (d == "F16" || d == "BF16" || d == "I16" || d == "U16") return 2;
  if (d == "I8" || d == "U8" || d == "BOOL") return 1;
  return 0;
}

const SafetensorsEntry* SafetensorsHeader::Find(const std::string& name) const {
  for (const SafetensorsEntry& e : tensors) {
    if (e.name == name) return &e;
  }
  return nullptr;
}

namespace {

// The refusal of `where`, which is not a valid safetensors file: `what` is wrong.
absl::Status NotSafetensors(const std::string& where, const std::string& what) {
  return absl::DataLossError(absl::StrCat("'", where, "' is not a valid safetensors file: ", what));
}

// The header's __metadata__: an object of strings.
absl::Status ParseSafetensorsMetadata(const json& v, const std::string& where,
                                      std::map<std::string, std::string>* metadata) {
  if (!v.is_object()) return NotSafetensors(where, "__metadata__ is not an object");
  for (auto m = v.begin(); m != v.end(); ++m) {
    if (!m.value().is_string())
      return NotSafetensors(where, absl::StrCat("__metadata__.", m.key(), " is not a string"));
    (*metadata)[m.key()] = m.value().get<std::string>();
  }
  return absl::OkStatus();
}

// One tensor's entry of the header: dtype, shape and data_offsets (relative
// to `data_start`, within the `data_bytes` after the header).
absl::StatusOr<SafetensorsEntry> ParseSafetensorsEntry(const std::string& name, const json& v,
                                                       int64_t data_start, int64_t data_bytes,
                                                       const std::string& where) {
  auto bad = [&](const std::string& what) { return NotSafetensors(where, what); };
  const std::string ctx = absl::StrCat("tensor '", name, "'");
  if (!v.is_object()) return bad(ctx + " is not an object");
  SafetensorsEntry e;
  e.name = name;
  auto dt = v.find("dtype");
  if (dt == v.end() || !dt->is_string()) return bad(ctx + " has no dtype");
  e.dtype = dt->get<std::string>();
  const int esize = SafetensorsDTypeSize(e.dtype);
  if (esize == 0) return bad(absl::StrCat(ctx, " has unknown dtype '", e.dtype, "'"));
  auto shape = v.find("shape");
  if (shape == v.end() || !shape->is_array() || shape->size() > 32)
    return bad(ctx + " has no valid shape");
  int64_t numel = 1;
  for (const json& d : *shape) {
    if (!d.is_number_integer() || d.get<int64_t>() < 0 || d.get<int64_t>() > kMaxTensorElements) {
      return bad(ctx + " has a bad dimension");
    }
    const int64_t dim = d.get<int64_t>();
    if (dim != 0 && numel > kMaxTensorElements / dim) return bad(ctx + " is too large");
    numel *= dim;
    e.shape.push_back(dim);
  }
  auto offs = v.find("data_offsets");
  if (offs == v.end() || !offs->is_array() || offs->size() != 2 ||
      !(*offs)[0].is_number_integer() || !(*offs)[1].is_number_integer()) {
    return bad(ctx + " has no valid data_offsets");
  }
  const int64_t a = (*offs)[0].get<int64_t>(), b = (*offs)[1].get<int64_t>();
  if (a < 0 || b < a || b > data_bytes) return bad(ctx + " lies outside the file");
  if (b - a != numel * esize)
    return bad(absl::StrCat(ctx, " has ", b - a, " bytes for ", numel, " elements"));
  e.begin = data_start + a;
  e.end = data_start + b;
  return e;
}

// Sorts the tensors by position and checks that they tile the data exactly.
absl::Status SortAndCheckTiling(int64_t file_bytes, const std::string& where,
                                SafetensorsHeader* out) {
  std::sort(out->tensors.begin(), out->tensors.end(),
            [](const SafetensorsEntry& x, const SafetensorsEntry& y) {
              return x.begin != y.begin ? x.begin < y.begin : x.end < y.end;
            });
  int64_t next = out->data_start;
  for (const SafetensorsEntry& e : out->tensors) {
    if (e.begin != next)
      return NotSafetensors(
          where, absl::StrCat("tensor '", e.name, "' overlaps another or leaves a hole"));
    next = e.end;
  }
  if (next != file_bytes)
    return NotSafetensors(
        where, absl::StrCat("the data ends at byte ", next, ", the file at ", file_bytes));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(const std::string& prefix,
                                                         int64_t file_bytes,
                                                         const std::string& where) {
  auto bad = [&](const std::string& what) { return NotSafetensors(where, what); };
  if (prefix.size() < 8 || file_bytes < 8) return bad("shorter than 8 bytes");
  uint64_t hlen = 0;
  for (int i = 0; i < 8; ++i)
    hlen |= static_cast<uint64_t>(static_cast<unsigned char>(prefix[i])) << (8 * i);
  if (hlen < 2 || hlen > static_cast<uint64_t>(kMaxSafetensorsHeaderBytes) ||
      hlen > static_cast<uint64_t>(file_bytes - 8)) {
    return bad(
        absl::StrCat("header length ", hlen, " does not fit the file (", file_bytes, " bytes)"));
  }
  if (prefix.size() < 8 + hlen) return bad("header truncated");
  SafetensorsHeader out;
  out.data_start = 8 + static_cast<int64_t>(hlen);
  auto doc = ParseJson(prefix.substr(8, hlen), where);
  if (!doc.ok()) return bad("header is not valid JSON");
  if (!doc->is_object()) return bad("header is not a JSON object");
  const int64_t data_bytes = file_bytes - out.data_start;
  for (auto it = doc->begin(); it != doc->end(); ++it) {
    const std::string& name = it.key();
    const json& v = it.value();
    if (name == "__metadata__") {
      SHARDOPT_RETURN_IF_ERROR(ParseSafetensorsMetadata(v, where, &out.metadata));
      continue;
    }
    SHARDOPT_ASSIGN_OR_RETURN(SafetensorsEntry e,
                              ParseSafetensorsEntry(name, v, out.data_start, data_bytes, where));
    out.tensors.push_back(std::move(e));
  }
  SHARDOPT_RETURN_IF_ERROR(SortAndCheckTiling(file_bytes, where, &out));
  return out;
}

absl::StatusOr<SafetensorsHeader> ReadSafetensorsHeader(FileSystem* fs, const std::string& path) {
  SHARDOPT_ASSIGN_OR_RETURN(uint64_t size, fs->FileSize(path));
  std::string prefix(8, '\0');
  if (size < 8) return ParseSafetensorsHeader("", static_cast<int64_t>(size), path);
  SHARDOPT_RETURN_IF_ERROR(fs->ReadAt(path, 0, 8, prefix.data()));
  uint64_t hlen = 0;
  for (int i = 0; i < 8; ++i)
    hlen |= static_cast<uint64_t>(static_cast<unsigned char>(prefix[i])) << (8 * i);
  if (hlen <= static_cast<uint64_t>(kMaxSafetensorsHeaderBytes) && hlen <= size - 8) {
    prefix.resize(8 + hlen);
    SHARDOPT_RETURN_IF_ERROR(fs->ReadAt(path, 8, hlen, prefix.data() + 8));
  }
  return ParseSafetensorsHeader(prefix, static_cast<int64_t>(size), path);
}

}  // namespace shardopt
