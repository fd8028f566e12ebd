#include "server/response_format.h"

#include <string>

#include "core/error.h"
#include "server/openai_api.h"

namespace moeinfer::server {
namespace {

using json = nlohmann::json;

[[noreturn]] void bad(const std::string& param, const std::string& message) {
  throw ApiError(400, message, "invalid_request_error", param);
}

std::shared_ptr<const JsonGrammar> compile(const json& schema, const std::string& param) {
  try {
    return JsonGrammar::from_schema(schema);
  } catch (const Error& e) {
    bad(param, std::string("'") + param + "': " + e.what());
  }
}

std::shared_ptr<const JsonGrammar> from_response_format(const json& format) {
  if (!format.is_object()) bad("response_format", "'response_format' must be an object");
  const auto type = format.find("type");
  if (type == format.end() || !type->is_string()) {
    bad("response_format.type", "'response_format.type' must be text, json_object or json_schema");
  }
  const std::string name = type->get<std::string>();
  const auto only = [&](std::initializer_list<const char*> keys) {
    for (const auto& [key, value] : format.items()) {
      bool known = false;
      for (const char* k : keys) known = known || key == k;
      if (!known) {
        bad("response_format." + key,
            "'response_format." + key + "' is not supported with type " + name);
      }
    }
  };
  if (name == "text") {
    only({"type"});
    return nullptr;
  }
  if (name == "json_object") {
    only({"type"});
    return JsonGrammar::any_object();
  }
  if (name != "json_schema") {
    bad("response_format.type",
        "'response_format.type' must be text, json_object or "
        "json_schema, got '" +
            name + "'");
  }
  only({"type", "json_schema"});
  const auto spec = format.find("json_schema");
  if (spec == format.end() || !spec->is_object()) {
    bad("response_format.json_schema",
        "'response_format.json_schema' must be an object with 'name' and 'schema'");
  }
  for (const auto& [key, value] : spec->items()) {
    const std::string param = "response_format.json_schema." + key;
    if (key == "name" || key == "description") {
      if (!value.is_string()) bad(param, "'" + param + "' must be a string");
    } else if (key == "strict") {
      // Every schema is followed strictly here; the flag changes nothing.
      if (!value.is_boolean() && !value.is_null()) bad(param, "'" + param + "' must be a boolean");
    } else if (key != "schema") {
      bad(param, "'" + param + "' is not supported");
    }
  }
  const auto schema = spec->find("schema");
  // OpenAI's schema is optional; without one any JSON value is allowed.
  if (schema == spec->end() || schema->is_null()) {
    return compile(json::object(), "response_format.json_schema.schema");
  }
  return compile(*schema, "response_format.json_schema.schema");
}

}  // namespace

std::shared_ptr<const JsonGrammar> parse_response_format(const json& body) {
  std::shared_ptr<const JsonGrammar> grammar;
  const auto format = body.find("response_format");
  if (format != body.end() && !format->is_null()) grammar = from_response_format(*format);
  const auto guided = body.find("guided_json");
  if (guided == body.end() || guided->is_null()) return grammar;
  if (grammar) bad("guided_json", "'guided_json' and a JSON 'response_format' cannot be combined");
  if (guided->is_string()) {
    json schema;
    try {
      schema = json::parse(guided->get<std::string>());
    } catch (const json::exception& e) {
      bad("guided_json", std::string("'guided_json' is not valid JSON: ") + e.what());
    }
    return compile(schema, "guided_json");
  }
  if (!guided->is_object() && !guided->is_boolean()) {
    bad("guided_json", "'guided_json' must be a JSON schema (an object, or its text)");
  }
  return compile(*guided, "guided_json");
}

}  // namespace moeinfer::server
