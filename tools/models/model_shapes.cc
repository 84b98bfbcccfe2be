#include "tools/models/model_shapes.h"

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace shardopt {

namespace {

absl::Status ReadList(const nlohmann::json& list, bool trainable, std::vector<ParamSpec>* out) {
  for (const auto& item : list) {
    ParamSpec spec;
    spec.name = item.at("name").get<std::string>();
    spec.shape = item.at("shape").get<std::vector<int64_t>>();
    spec.trainable = trainable;
    out->push_back(std::move(spec));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ModelShapes> LoadModelShapes(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open fixture '", path, "'"));
  std::stringstream text;
  text << in.rdbuf();
  ModelShapes shapes;
  try {
    const nlohmann::json doc = nlohmann::json::parse(text.str());
    shapes.model = doc.at("model").get<std::string>();
    shapes.total_parameters = doc.at("total_parameters").get<int64_t>();
    if (absl::Status s = ReadList(doc.at("parameters"), true, &shapes.params); !s.ok()) return s;
    if (doc.contains("buffers")) {
      if (absl::Status s = ReadList(doc.at("buffers"), false, &shapes.buffers); !s.ok()) return s;
    }
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("fixture '", path, "': ", e.what()));
  }
  return shapes;
}

}  // namespace shardopt
