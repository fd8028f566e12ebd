// OpenAI's response_format and vLLM's guided_json extra field, read into the grammar the
// engine's constrained decoding follows (runtime/json_schema_grammar.h).
#pragma once

#include <memory>
#include <nlohmann/json.hpp>

#include "runtime/json_schema_grammar.h"

namespace moeinfer::server {

// Null for no constraint (fields absent, or {"type": "text"}); {"type": "json_object"}: any JSON
// object; {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}
// or guided_json (a schema, or its JSON text): the schema. Throws ApiError 400 naming the field:
// wrong shapes, an unknown type, both fields at once, a schema keyword the grammar does not
// support (never ignored).
std::shared_ptr<const JsonGrammar> parse_response_format(const nlohmann::json& body);

}  // namespace moeinfer::server
