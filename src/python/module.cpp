// moeinfer._core: the engine as the Python package (python/moeinfer) sees it. Conversions only:
// what to run is decided in session.h (the LLM's engine loop and chat), cli/run.h (the command
// line: `python -m moeinfer`, moeinfer.serve) and the library's report functions; this file turns
// their values into Python objects. The GIL is released wherever the engine computes, and a
// generate() checks for signals (Ctrl-C) between engine steps.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "cli/run.h"
#include "cli/usage_error.h"
#include "core/error.h"
#include "core/version.h"
#include "offload/cache_summary.h"
#include "profile/profiler.h"
#include "python/reports.h"
#include "python/session.h"
#include "runtime/sampler.h"
#include "server/openai_api.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace moeinfer::python {
namespace {

using Json = nlohmann::ordered_json;

// Text from the engine as a Python str; bytes that are not UTF-8 (a token cut inside a
// character) become U+FFFD instead of failing the call.
nb::str to_str(const std::string& text) {
  PyObject* s = PyUnicode_DecodeUTF8(text.data(), static_cast<Py_ssize_t>(text.size()), "replace");
  if (s == nullptr) throw nb::python_error();
  return nb::steal<nb::str>(s);
}

Json parse_json_arg(const std::string& text, const char* what) {
  try {
    return Json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    MOE_FAIL(what, " is not JSON: ", e.what());
  }
}

// A NumPy array that owns `values` (moved to the heap; freed when the array is collected).
template <typename T>
nb::ndarray<nb::numpy, T> to_numpy(std::vector<T>&& values, std::initializer_list<size_t> shape) {
  auto* owned = new std::vector<T>(std::move(values));
  nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nb::ndarray<nb::numpy, T>(owned->data(), shape, owner);
}

GenerationParams make_params(float temperature, float top_p, int64_t top_k, float min_p,
                             float repetition_penalty, float presence_penalty,
                             float frequency_penalty, std::optional<uint64_t> seed,
                             int64_t max_tokens, std::vector<std::string> stop,
                             std::vector<int32_t> stop_token_ids, bool ignore_eos,
                             bool include_stop_str_in_output, bool skip_special_tokens,
                             std::optional<int64_t> logprobs,
                             std::optional<int64_t> prompt_logprobs, int64_t n,
                             std::vector<std::pair<int32_t, float>> logit_bias) {
  GenerationParams p;
  p.sampling = SamplingParams{.temperature = temperature,
                              .top_k = top_k,
                              .top_p = top_p,
                              .min_p = min_p,
                              .repetition_penalty = repetition_penalty,
                              .presence_penalty = presence_penalty,
                              .frequency_penalty = frequency_penalty,
                              .logit_bias = std::move(logit_bias),
                              .seed = seed.value_or(0)};
  p.has_seed = seed.has_value();
  p.max_tokens = max_tokens;
  p.stop = std::move(stop);
  p.stop_token_ids = std::move(stop_token_ids);
  p.ignore_eos = ignore_eos;
  p.include_stop_str_in_output = include_stop_str_in_output;
  p.skip_special_tokens = skip_special_tokens;
  p.logprobs = logprobs.value_or(-1);
  p.prompt_logprobs = prompt_logprobs.value_or(-1);
  p.num_sequences = n;
  p.score_sequences = n > 1;
  // The engine's own checks, at construction as vLLM's SamplingParams makes them: ValueError
  // with the engine's message.
  try {
    Sampler::validate(p.sampling);
    MOE_CHECK(max_tokens >= 1 || (max_tokens == 0 && p.prompt_logprobs >= 0),
              "max_tokens must be >= 1 (0 only with prompt_logprobs), got ", max_tokens);
    MOE_CHECK(p.logprobs >= -1 && p.logprobs <= 20, "logprobs must be in [0, 20], got ",
              p.logprobs);
    MOE_CHECK(p.prompt_logprobs >= -1 && p.prompt_logprobs <= 20,
              "prompt_logprobs must be in [0, 20], got ", p.prompt_logprobs);
    MOE_CHECK(n >= 1 && n <= kMaxSequencesPerRequest, "n must be in [1, ", kMaxSequencesPerRequest,
              "], got ", n);
    for (const std::string& s : p.stop) MOE_CHECK(!s.empty(), "stop strings must not be empty");
  } catch (const Error& e) {
    throw nb::value_error(e.what());
  }
  return p;
}

nb::dict stats_dict(const EngineStats& s) {
  nb::dict d;
  d["num_steps"] = s.num_steps;
  d["num_running"] = s.num_running;
  d["num_waiting"] = s.num_waiting;
  d["num_preemptions"] = s.num_preemptions;
  d["prompt_tokens"] = s.prompt_tokens;
  d["computed_tokens"] = s.computed_tokens;
  d["generation_tokens"] = s.generation_tokens;
  d["schedule_seconds"] = s.schedule_seconds;
  d["forward_seconds"] = s.forward_seconds;
  d["sample_seconds"] = s.sample_seconds;
  nb::dict kv;
  kv["num_blocks"] = s.kv.num_blocks;
  kv["num_used"] = s.kv.num_used;
  kv["num_cached"] = s.kv.num_cached;
  kv["prefix_queries"] = s.kv.prefix_queries;
  kv["prefix_hits"] = s.kv.prefix_hits;
  d["kv"] = kv;
  if (!s.stage_seconds.empty()) {
    nb::dict stages, estimated;
    const std::vector<double> estimate = s.estimated_stage_seconds();
    for (int i = 0; i < profile::kNumStages; ++i) {
      const std::string name(profile::stage_name(static_cast<profile::Stage>(i)));
      stages[name.c_str()] = s.stage_seconds[i];
      if (static_cast<size_t>(i) < estimate.size()) estimated[name.c_str()] = estimate[i];
    }
    d["stage_seconds"] = stages;
    d["estimated_stage_seconds"] = estimated;
    d["timed_steps"] = s.timed_steps;
    std::vector<int64_t> rows = s.expert_rows;
    d["expert_rows"] = to_numpy(
        std::move(rows), {static_cast<size_t>(s.num_layers), static_cast<size_t>(s.num_experts)});
  }
  if (s.expert_offload()) {
    const size_t L = s.expert_cache_bytes.size();
    nb::dict cache;
    nb::list names;
    for (int i = 0; i < offload::kNumCacheCounters; ++i) {
      names.append(offload::kCacheCounterNames[i]);
    }
    cache["counter_names"] = names;
    std::vector<int64_t> counters = s.expert_cache;
    cache["counters"] =
        to_numpy(std::move(counters), {L, static_cast<size_t>(offload::kNumCacheCounters)});
    std::vector<int64_t> bytes = s.expert_cache_bytes;
    cache["bytes_host_to_device"] = to_numpy(std::move(bytes), {L});
    std::vector<double> stall = s.expert_cache_stall_seconds;
    cache["stall_seconds"] = to_numpy(std::move(stall), {L});
    d["expert_cache"] = cache;
  }
  return d;
}

// Each rank's load as rank 0 last heard it: the requests it runs and waits on, the tokens it
// has queued, the requests sent to it since the start, and its counters.
nb::list rank_status_list(const std::vector<RankStatus>& ranks) {
  nb::list out;
  for (const RankStatus& status : ranks) {
    const RankLoad& l = status.load;
    nb::dict d;
    d["num_running"] = l.num_running;
    d["num_waiting"] = l.num_waiting;
    d["num_queued_tokens"] = l.num_queued_tokens;
    d["num_assigned"] = status.num_assigned;
    d["prompt_tokens"] = l.prompt_tokens;
    d["generation_tokens"] = l.generation_tokens;
    d["num_preemptions"] = l.num_preemptions;
    d["kv_blocks"] = l.kv_blocks;
    d["kv_used"] = l.kv_used;
    out.append(d);
  }
  return out;
}

// [(token, logprob, rank, [(token, logprob), ...]), ...]: Python builds vLLM's Logprob dicts.
nb::list logprobs_list(const std::vector<TokenLogprob>& logprobs) {
  nb::list out;
  for (const TokenLogprob& lp : logprobs) {
    nb::list top;
    for (const auto& [token, value] : lp.top) top.append(nb::make_tuple(token, value));
    out.append(nb::make_tuple(lp.token, lp.logprob, lp.rank, top));
  }
  return out;
}

// One request's result as a dict the Python layer turns into vLLM's RequestOutput.
nb::dict result_dict(RequestResult& r, const nb::list& tool_calls) {
  nb::dict d;
  d["prompt_token_ids"] = nb::cast(r.prompt_token_ids);
  d["prompt_logprobs"] = logprobs_list(r.prompt_logprobs);
  d["num_cached_tokens"] = r.num_cached_tokens;
  nb::list sequences;
  for (size_t i = 0; i < r.sequences.size(); ++i) {
    SequenceResult& s = r.sequences[i];
    nb::dict seq;
    seq["index"] = s.index;
    seq["text"] = to_str(s.text);
    seq["token_ids"] = nb::cast(s.token_ids);
    seq["logprobs"] = logprobs_list(s.logprobs);
    seq["cumulative_logprob"] = s.cumulative_logprob;
    const char* finish = finish_reason_name(s.finish);
    seq["finish_reason"] = *finish ? nb::object(nb::str(finish)) : nb::none();
    seq["tool_calls"] = i < tool_calls.size() ? nb::object(tool_calls[i]) : nb::none();
    sequences.append(seq);
  }
  d["outputs"] = sequences;
  return d;
}

// Runs the session's requests with the GIL released, asking for signals between steps; a
// KeyboardInterrupt (or whatever a signal handler raised) is re-raised once every request has
// been aborted.
std::vector<RequestResult> run_released(Session& session,
                                        const std::vector<std::vector<int32_t>>& prompts,
                                        const std::vector<GenerationParams>& params) {
  try {
    nb::gil_scoped_release release;
    return session.run(prompts, params, [] {
      nb::gil_scoped_acquire acquire;
      return PyErr_CheckSignals() != 0;
    });
  } catch (const Stopped&) {
    throw nb::python_error();  // the exception PyErr_CheckSignals left set
  }
}

}  // namespace
}  // namespace moeinfer::python

NB_MODULE(_core, m) {
  using namespace moeinfer;
  using namespace moeinfer::python;
  m.doc() = "moeinfer's engine: the compiled half of the moeinfer package (use moeinfer.LLM)";
  m.attr("__version__") = kVersion;
#if MOE_HAVE_CUDA
  m.attr("built_with_cuda") = true;
#else
  m.attr("built_with_cuda") = false;
#endif

  // Errors: the engine's moeinfer::Error (and the HTTP layer's ApiError, which chat's tool
  // checks throw) as EngineError; a bad command line as UsageError, a kind of EngineError.
  static nb::exception<Error> engine_error(m, "EngineError", PyExc_RuntimeError);
  static nb::exception<cli::UsageError> usage_error(m, "UsageError", engine_error);
  nb::register_exception_translator(
      [](const std::exception_ptr& p, void* type) {
        try {
          std::rethrow_exception(p);
        } catch (const server::ApiError& e) {
          PyErr_SetString(static_cast<PyObject*>(type), e.what());
        }
      },
      engine_error.ptr());

  nb::class_<GenerationParams>(m, "GenerationParams",
                               "One request's sampling and stopping parameters, checked (built "
                               "by moeinfer.SamplingParams)");
  m.def("make_params", &make_params, "temperature"_a, "top_p"_a, "top_k"_a, "min_p"_a,
        "repetition_penalty"_a, "presence_penalty"_a, "frequency_penalty"_a, "seed"_a.none(),
        "max_tokens"_a, "stop"_a, "stop_token_ids"_a, "ignore_eos"_a,
        "include_stop_str_in_output"_a, "skip_special_tokens"_a, "logprobs"_a.none(),
        "prompt_logprobs"_a.none(), "n"_a, "logit_bias"_a,
        "The engine's GenerationParams; raises ValueError with the engine's message for a "
        "value out of range");

  nb::class_<SessionOptions>(m, "EngineOptions",
                             "LLM(...)'s engine arguments (moeinfer.LLM documents each)")
      .def(nb::init<>())
      .def_rw("device", &SessionOptions::device)
      .def_rw("dtype", &SessionOptions::dtype)
      .def_rw("weights", &SessionOptions::weights)
      .def_rw("weights_scope", &SessionOptions::weights_scope)
      .def_rw("gpu_memory_fraction", &SessionOptions::gpu_memory_fraction)
      .def_rw("max_model_len", &SessionOptions::max_model_len)
      .def_rw("max_num_seqs", &SessionOptions::max_num_seqs)
      .def_rw("max_num_batched_tokens", &SessionOptions::max_num_batched_tokens)
      .def_rw("kv_cache_mb", &SessionOptions::kv_cache_mb)
      .def_rw("kv_dtype", &SessionOptions::kv_dtype)
      .def_rw("block_size", &SessionOptions::block_size)
      .def_rw("enable_prefix_caching", &SessionOptions::enable_prefix_caching)
      .def_rw("enforce_eager", &SessionOptions::enforce_eager)
      .def_rw("expert_budget", &SessionOptions::expert_budget)
      .def_rw("expert_cache", &SessionOptions::expert_cache)
      .def_rw("cold_experts", &SessionOptions::cold_experts)
      .def_rw("expert_prefetch", &SessionOptions::expert_prefetch)
      .def_rw("deterministic", &SessionOptions::deterministic)
      .def_rw("generation_config", &SessionOptions::generation_config)
      .def_rw("profile_stages", &SessionOptions::profile_stages)
      .def_rw("profile_time_every", &SessionOptions::profile_time_every)
      .def_rw("tool_call_parser", &SessionOptions::tool_call_parser)
      .def_rw("ep", &SessionOptions::ep)
      .def_rw("placement", &SessionOptions::placement)
      .def_rw("overlap", &SessionOptions::overlap)
      .def_rw("dispatch_dtype", &SessionOptions::dispatch_dtype)
      .def_rw("micro_batches", &SessionOptions::micro_batches)
      .def_rw("active_experts", &SessionOptions::active_experts)
      .def_rw("renorm", &SessionOptions::renorm)
      .def_rw("drop_below", &SessionOptions::drop_below)
      .def_rw("expert_capacity", &SessionOptions::expert_capacity)
      .def_rw("overflow", &SessionOptions::overflow)
      .def_rw("router_temperature", &SessionOptions::router_temperature);

  nb::class_<Session>(m, "Engine", "An engine over one checkpoint (use moeinfer.LLM)")
      .def_static(
          "load",
          [](const std::string& model, const SessionOptions& options) {
            nb::gil_scoped_release release;
            return Session::load(model, options);
          },
          "model"_a, "options"_a)
      .def_prop_ro("vocab_size",
                   [](const Session& s) { return s.engine().model_config().vocab_size; })
      .def_prop_ro("max_model_len", [](const Session& s) { return s.engine().max_model_len(); })
      .def_prop_ro("model_type",
                   [](const Session& s) { return s.engine().model_config().model_type; })
      .def_prop_ro("device", [](const Session& s) { return s.engine().config().device; })
      .def_prop_ro("tool_call_parser",
                   [](const Session& s) {
                     return std::string(server::tool_call_format_name(s.tool_format()));
                   })
      .def_prop_ro("has_chat_template", &Session::has_chat_template)
      .def("generation_defaults",
           [](const Session& s) {
             const GenerationDefaults& g = s.engine().generation_defaults();
             nb::dict d;
             if (g.temperature) d["temperature"] = *g.temperature;
             if (g.top_p) d["top_p"] = *g.top_p;
             if (g.top_k) d["top_k"] = *g.top_k;
             if (g.min_p) d["min_p"] = *g.min_p;
             if (g.repetition_penalty) d["repetition_penalty"] = *g.repetition_penalty;
             if (g.max_tokens) d["max_tokens"] = *g.max_tokens;
             return d;
           })
      .def(
          "encode",
          [](const Session& s, const std::string& text, bool add_special_tokens) {
            return s.engine().tokenizer().encode(text, add_special_tokens);
          },
          "text"_a, "add_special_tokens"_a)
      .def(
          "decode",
          [](const Session& s, const std::vector<int32_t>& ids, bool skip_special_tokens) {
            const int64_t V = s.engine().tokenizer().vocab_size();
            for (int32_t id : ids) {
              MOE_CHECK(id >= 0 && id < V, "token id ", id, " outside the vocabulary of ", V);
            }
            return to_str(s.engine().tokenizer().decode(ids, skip_special_tokens));
          },
          "ids"_a, "skip_special_tokens"_a)
      .def(
          "token_text",
          [](const Session& s, int32_t id) {
            return to_str(server::token_text(s.engine().tokenizer(), id));
          },
          "id"_a)
      .def(
          "generate",
          [](Session& s, const std::vector<std::vector<int32_t>>& prompts,
             const std::vector<GenerationParams>& params) {
            std::vector<RequestResult> results = run_released(s, prompts, params);
            nb::list out;
            for (RequestResult& r : results) out.append(result_dict(r, nb::list()));
            return out;
          },
          "prompts"_a, "params"_a)
      .def(
          "chat",
          [](Session& s, const std::vector<std::string>& conversations,
             const std::vector<GenerationParams>& params, const std::string& tools,
             const std::string& tool_choice, bool add_generation_prompt,
             const std::string& template_kwargs) {
            MOE_CHECK(conversations.size() == params.size(), "chat: ", conversations.size(),
                      " conversations but ", params.size(), " sampling parameter sets");
            const Json tools_json = parse_json_arg(tools, "tools");
            const Json choice_json = parse_json_arg(tool_choice, "tool_choice");
            const Json kwargs_json = parse_json_arg(template_kwargs, "chat_template_kwargs");
            std::vector<Session::ChatRequest> requests;
            std::vector<std::vector<int32_t>> prompts;
            std::vector<GenerationParams> run_params;
            for (size_t i = 0; i < conversations.size(); ++i) {
              requests.push_back(s.prepare_chat(parse_json_arg(conversations[i], "messages"),
                                                tools_json, choice_json, add_generation_prompt,
                                                kwargs_json, params[i]));
              prompts.push_back(requests.back().prompt);
              run_params.push_back(requests.back().params);
            }
            std::vector<RequestResult> results = run_released(s, prompts, run_params);
            server::ToolCallIds ids;
            nb::module_ json = nb::module_::import_("json");
            nb::list out;
            for (size_t i = 0; i < results.size(); ++i) {
              nb::list calls;
              if (requests[i].read_tool_calls) {
                for (const SequenceResult& seq : results[i].sequences) {
                  const Json read =
                      read_tool_calls(s.tool_format(), requests[i].tool_choice, seq.text, ids);
                  calls.append(json.attr("loads")(read.dump()));
                }
              }
              out.append(result_dict(results[i], calls));
            }
            return out;
          },
          "conversations"_a, "params"_a, "tools"_a, "tool_choice"_a, "add_generation_prompt"_a,
          "chat_template_kwargs"_a)
      .def(
          "score",
          [](Session& s, const std::vector<int32_t>& ids) {
            const size_t n = ids.size();
            const size_t V = static_cast<size_t>(s.engine().model_config().vocab_size);
            // The engine writes the logits into the array's own memory: no copy.
            std::unique_ptr<float[]> data(new float[n * V]);
            {
              nb::gil_scoped_release release;
              s.score(ids, std::span<float>(data.get(), n * V));
            }
            float* owned = data.release();
            nb::capsule owner(owned, [](void* p) noexcept { delete[] static_cast<float*>(p); });
            return nb::ndarray<nb::numpy, float, nb::ndim<2>>(owned, {n, V}, owner);
          },
          "ids"_a)
      .def("stats",
           [](const Session& s) {
             nb::dict d = stats_dict(s.stats());
             if (s.num_ranks() > 1) d["ranks"] = rank_status_list(s.rank_status());
             return d;
           })
      .def_prop_ro("rank", &Session::rank)
      .def_prop_ro("num_ranks", &Session::num_ranks)
      .def("follow_rank_zero", &Session::follow_rank_zero, nb::call_guard<nb::gil_scoped_release>(),
           "Ranks > 0: steps with rank 0 until rank 0 closes its engine")
      .def("close", &Session::close, nb::call_guard<nb::gil_scoped_release>(),
           "Rank 0 under ep > 1: the job's last round (the other ranks return); idempotent")
      .def("trace_routing", &Session::trace_routing, "path"_a,
           "Records every later forward's routing to a trace file (\"\": stop, close)");

  m.def(
      "main",
      [](const std::vector<std::string>& argv) {
        std::vector<std::string> words = argv;
        std::vector<char*> pointers;
        for (std::string& word : words) pointers.push_back(word.data());
        nb::gil_scoped_release release;
        return cli::run(static_cast<int>(pointers.size()), pointers.data());
      },
      "argv"_a,
      "Runs the moeinfer command line (argv[0]: the program's name); errors are printed; "
      "returns the exit status");
  m.def(
      "run_command",
      [](const std::vector<std::string>& args) {
        nb::gil_scoped_release release;
        cli::run_or_throw(args);
      },
      "args"_a,
      "Runs one moeinfer subcommand (args without the program's name); raises EngineError or "
      "UsageError with the command's message");

  bind_reports(m);
}
