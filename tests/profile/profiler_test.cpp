// The stage profiler: scopes add their time to the right (layer, stage) slot and nowhere else,
// nothing is recorded while no profiler is installed, routing counts and bytes read match a
// hand-built routing, the MoE layer's six stages and the decoder's stages all report, and
// switching the profiler on leaves the model's logits bit for bit unchanged.
#include "profile/profiler.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <numeric>
#include <random>
#include <regex>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "model/model.h"
#include "moe/moe_block.h"
#include "profile/report.h"

namespace moeinfer::profile {
namespace {

const std::filesystem::path kDemo =
    std::filesystem::path(MOE_FIXTURES_DIR) / ".." / ".." / "models" / "demo";

// Work the compiler cannot drop, so that a scope spans more than zero nanoseconds of real work.
float busy_work(int n) {
  volatile float acc = 0.0f;
  for (int i = 0; i < n; ++i) acc = acc + static_cast<float>(i) * 0.5f;
  return acc;
}

int64_t sum_row(const StepRecord& step, int64_t row) {
  int64_t total = 0;
  for (int s = 0; s < kNumStages; ++s) total += step.ns(row, static_cast<Stage>(s));
  return total;
}

TEST(Profiler, StageNamesAreDistinct) {
  std::vector<std::string_view> names;
  for (int s = 0; s < kNumStages; ++s) names.push_back(stage_name(static_cast<Stage>(s)));
  for (size_t i = 0; i < names.size(); ++i) {
    for (size_t j = i + 1; j < names.size(); ++j) EXPECT_NE(names[i], names[j]);
  }
  EXPECT_EQ(stage_name(Stage::kRoute), "route");
  EXPECT_TRUE(is_layer_stage(Stage::kDenseMlp));
  EXPECT_FALSE(is_layer_stage(Stage::kLmHead));
}

TEST(Profiler, OffByDefaultRecordsNothing) {
  ASSERT_EQ(active(), nullptr);
  Profiler profiler(ProfilerOptions{.num_layers = 2, .num_experts = 4});
  profiler.begin_step(3);
  {
    MOE_PROFILE_LAYER(1);
    MOE_PROFILE_SCOPE(Stage::kExperts);
    busy_work(1000);
  }
  {
    MOE_PROFILE_SCOPE(Stage::kSample);
    busy_work(1000);
  }
  profiler.end_step();
  ASSERT_EQ(profiler.steps().size(), 1u);
  const StepRecord& step = profiler.steps()[0];
  for (int64_t row = 0; row <= 2; ++row) EXPECT_EQ(sum_row(step, row), 0) << "row " << row;
  EXPECT_EQ(profiler.current_layer(), -1);
}

TEST(Profiler, ScopesAccumulateInTheirLayerAndStage) {
  Profiler profiler(ProfilerOptions{.num_layers = 3, .num_experts = 4});
  ActiveProfiler on(&profiler);
  ASSERT_EQ(active(), &profiler);
  profiler.begin_step(5);
  for (int repeat = 0; repeat < 3; ++repeat) {
    MOE_PROFILE_LAYER(1);
    EXPECT_EQ(profiler.current_layer(), 1);
    MOE_PROFILE_SCOPE(Stage::kPlan);
    busy_work(2000);
  }
  EXPECT_EQ(profiler.current_layer(), -1);
  {
    MOE_PROFILE_SCOPE(Stage::kLmHead);
    busy_work(2000);
  }
  profiler.end_step();
  profiler.begin_step(1);
  profiler.end_step();

  ASSERT_EQ(profiler.steps().size(), 2u);
  const StepRecord& first = profiler.steps()[0];
  EXPECT_EQ(first.num_tokens, 5);
  EXPECT_GT(first.ns(1, Stage::kPlan), 0);
  EXPECT_EQ(first.calls(1, Stage::kPlan), 3);
  EXPECT_EQ(first.calls(3, Stage::kLmHead), 1);
  EXPECT_EQ(first.calls(0, Stage::kPlan), 0);
  EXPECT_EQ(sum_row(first, 1), first.ns(1, Stage::kPlan)) << "only the plan stage ran";
  EXPECT_EQ(sum_row(first, 0), 0);
  EXPECT_EQ(sum_row(first, 2), 0);
  EXPECT_GT(first.ns(3, Stage::kLmHead), 0) << "outside a layer: the step-level row";
  EXPECT_EQ(sum_row(first, 3), first.ns(3, Stage::kLmHead));
  EXPECT_GE(first.wall_ns, sum_row(first, 1) + sum_row(first, 3));
  // A new step starts from zero.
  const StepRecord& second = profiler.steps()[1];
  EXPECT_EQ(second.num_tokens, 1);
  for (int64_t row = 0; row <= 3; ++row) EXPECT_EQ(sum_row(second, row), 0);
}

TEST(Profiler, GuardsNestAndRestore) {
  Profiler outer(ProfilerOptions{.num_layers = 4, .num_experts = 2});
  Profiler inner(ProfilerOptions{.num_layers = 4, .num_experts = 2});
  {
    ActiveProfiler a(&outer);
    {
      MOE_PROFILE_LAYER(2);
      {
        MOE_PROFILE_LAYER(3);
        EXPECT_EQ(outer.current_layer(), 3);
      }
      EXPECT_EQ(outer.current_layer(), 2);
      ActiveProfiler b(&inner);
      EXPECT_EQ(active(), &inner);
      {
        ActiveProfiler off(nullptr);
        EXPECT_EQ(active(), nullptr);
      }
      EXPECT_EQ(active(), &inner);
    }
    EXPECT_EQ(active(), &outer);
    EXPECT_EQ(outer.current_layer(), -1);
  }
  EXPECT_EQ(active(), nullptr);
}

TEST(Profiler, RoutingCountsAndBytesMatchAHandBuiltRouting) {
  // Layer 0: 3 tokens, top-2 of 4 experts; layer 1 has no experts (dense); layer 2: 2 tokens.
  Profiler profiler(
      ProfilerOptions{.num_layers = 3, .num_experts = 4, .expert_bytes = {100, 0, 1000}});
  profiler.begin_step(3);
  const std::vector<int32_t> layer0 = {0, 3, 3, 1, 0, 3};  // [T=3, K=2]
  const std::vector<int32_t> layer2 = {2, 2, 2, 2};        // [T=2, K=2] (ids may repeat)
  profiler.record_routing(0, layer0);
  profiler.record_routing(2, layer2);
  profiler.count_cache(5, 2);
  profiler.count_cache(1, 0);
  profiler.end_step();

  const StepRecord& step = profiler.steps().at(0);
  EXPECT_EQ(step.expert_rows, (std::vector<int32_t>{2, 1, 0, 3,  // layer 0
                                                    0, 0, 0, 0,  // layer 1
                                                    0, 0, 4, 0}));
  // Layer 0 touches experts {0, 1, 3}: 3 x 100; layer 2 touches {2}: 1 x 1000.
  EXPECT_EQ(step.expert_bytes_read, 3 * 100 + 1000);
  EXPECT_EQ(step.cache_hits, 6);
  EXPECT_EQ(step.cache_misses, 2);
  const std::vector<int32_t> bad = {4};
  EXPECT_THROW(profiler.record_routing(0, bad), Error);
  EXPECT_THROW(profiler.record_routing(3, layer0), Error);
}

TEST(Profiler, DeviceCountsAndLinkBytesAddUpPerStep) {
  Profiler profiler(ProfilerOptions{.num_layers = 2, .num_experts = 3});
  profiler.begin_step(4);
  const std::vector<int32_t> counts = {5, 0, 3};
  profiler.record_expert_counts(1, counts);
  profiler.record_expert_counts(1, counts);
  profiler.add_link_bytes(Link::kHostDevice, 64);
  profiler.add_link_bytes(Link::kOnDevice, 1000);
  profiler.add_link_bytes(Link::kHostDevice, 16);
  profiler.end_step();
  const StepRecord& step = profiler.steps().at(0);
  EXPECT_EQ(step.expert_rows, (std::vector<int32_t>{0, 0, 0, 10, 0, 6}));
  EXPECT_EQ(step.link_bytes[static_cast<int>(Link::kHostDevice)], 80);
  EXPECT_EQ(step.link_bytes[static_cast<int>(Link::kOnDevice)], 1000);
  EXPECT_EQ(step.link_bytes[static_cast<int>(Link::kPeerGpu)], 0);
  EXPECT_EQ(link_name(Link::kNetwork), "network");
  const std::vector<int32_t> short_counts = {1, 2};
  EXPECT_THROW(profiler.record_expert_counts(0, short_counts), Error);
  EXPECT_THROW(profiler.record_expert_counts(2, counts), Error);
  // A new step starts from zero.
  profiler.begin_step(1);
  profiler.end_step();
  EXPECT_EQ(profiler.steps().at(1).link_bytes[static_cast<int>(Link::kHostDevice)], 0);
}

TEST(Profiler, RowsPerRankFollowTheExpertPlacement) {
  // Experts 0 and 2 on rank 0, experts 1 and 3 on rank 1; two layers.
  Profiler profiler(ProfilerOptions{.num_layers = 2, .num_experts = 4, .expert_rank = {0, 1, 0, 1}});
  profiler.begin_step(3);
  const std::vector<int32_t> layer0 = {0, 1, 3, 3, 2, 0};  // rank rows: 0:3, 1:3
  const std::vector<int32_t> layer1 = {1, 1, 1, 1, 2, 2};  // rank rows: 0:2, 1:4
  profiler.record_routing(0, layer0);
  profiler.record_routing(1, layer1);
  profiler.end_step();
  EXPECT_EQ(profiler.steps().at(0).rank_rows, (std::vector<int64_t>{5, 7}));
  // Without a placement one rank holds everything.
  Profiler single(ProfilerOptions{.num_layers = 1, .num_experts = 4});
  single.begin_step(3);
  single.record_routing(0, layer0);
  single.end_step();
  EXPECT_EQ(single.steps().at(0).rank_rows, (std::vector<int64_t>{6}));
  EXPECT_THROW(Profiler(ProfilerOptions{.num_layers = 1, .num_experts = 2, .expert_rank = {0}}),
               Error);
}

// time_every 3: steps 0, 3, 6, ... time their stages (scopes and add_time), the others record
// nothing but their counters; clear() does not restart the count (the engine clears each step).
TEST(Profiler, SampledTimingTimesOneStepInN) {
  Profiler profiler(ProfilerOptions{.num_layers = 2, .num_experts = 4, .time_every = 3});
  ActiveProfiler on(&profiler);
  const std::vector<int32_t> routing = {0, 3};
  for (int step = 0; step < 7; ++step) {
    profiler.begin_step(1);
    EXPECT_EQ(profiler.timing(), step % 3 == 0) << "step " << step;
    {
      MOE_PROFILE_LAYER(1);
      MOE_PROFILE_SCOPE(Stage::kExperts);
      busy_work(2000);
    }
    profiler.add_time(Stage::kSample, 500);
    profiler.record_routing(1, routing);
    profiler.add_link_bytes(Link::kOnDevice, 10);
    profiler.end_step();
    const StepRecord& r = profiler.steps().back();
    EXPECT_EQ(r.timed, step % 3 == 0) << "step " << step;
    if (r.timed) {
      EXPECT_GT(r.ns(1, Stage::kExperts), 0) << "step " << step;
      EXPECT_EQ(r.ns(2, Stage::kSample), 500) << "step " << step;
    } else {
      for (int64_t row = 0; row <= 2; ++row) EXPECT_EQ(sum_row(r, row), 0) << "step " << step;
      EXPECT_EQ(r.calls(1, Stage::kExperts), 0);
    }
    EXPECT_EQ(r.expert_rows[1 * 4 + 0], 1) << "step " << step;
    EXPECT_EQ(r.expert_rows[1 * 4 + 3], 1) << "step " << step;
    EXPECT_EQ(r.link_bytes[static_cast<int>(Link::kOnDevice)], 10) << "step " << step;
    if (step == 4) profiler.clear();
  }
  EXPECT_THROW(Profiler(ProfilerOptions{.num_layers = 1, .time_every = 0}), Error);
}

TEST(Profiler, OptionsAreValidated) {
  EXPECT_THROW(Profiler(ProfilerOptions{.num_layers = 0}), Error);
  EXPECT_THROW(Profiler(ProfilerOptions{.num_layers = 2, .num_experts = 4, .expert_bytes = {1}}),
               Error);
  EXPECT_THROW(Profiler(ProfilerOptions{.num_layers = 1, .num_experts = -1}), Error);
}

// A random float32 MoE layer: T=19 tokens, H=8, I=4, E=5, K=2.
TEST(Profiler, MoeLayerReportsEveryStage) {
  constexpr int64_t T = 19, H = 8, I = 4, E = 5, K = 2;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  auto random = [&](int64_t n) {
    std::vector<float> v(n);
    for (float& x : v) x = normal(rng);
    return v;
  };
  std::vector<std::vector<float>> storage;
  auto view = [&](int64_t rows, int64_t cols) {
    storage.push_back(random(rows * cols));
    return TensorView{.dtype = DType::kF32, .shape = {rows, cols}, .data = storage.back().data()};
  };
  storage.reserve(1 + 3 * E);
  moe::RoutedExperts weights{.router = view(E, H)};
  for (int64_t e = 0; e < E; ++e) {
    weights.experts.push_back({.gate = view(I, H), .up = view(I, H), .down = view(H, I)});
  }
  const moe::MoeBlockOptions options{.router = {.num_experts = E, .top_k = K, .renormalize = true},
                                     .hidden_size = H,
                                     .expert_width = I};
  const std::vector<float> hidden = random(T * H);
  std::vector<float> off(T * H), on(T * H);
  moe::MoeBlock block = moe::single_layer_block(options, weights);
  block.forward(0, hidden.data(), T, weights.router, nullptr, nullptr, off.data());

  Profiler profiler(ProfilerOptions{.num_layers = 2, .num_experts = E});
  {
    ActiveProfiler guard(&profiler);
    profiler.begin_step(T);
    MOE_PROFILE_LAYER(1);
    block.forward(0, hidden.data(), T, weights.router, nullptr, nullptr, on.data());
    profiler.end_step();
  }
  EXPECT_EQ(on, off);
  const StepRecord& step = profiler.steps().at(0);
  for (Stage s :
       {Stage::kRoute, Stage::kPlan, Stage::kDispatch, Stage::kExperts, Stage::kUnpermute}) {
    EXPECT_GT(step.ns(1, s), 0) << stage_name(s);
  }
  EXPECT_GE(step.ns(1, Stage::kCombine), 0);
  for (int s = static_cast<int>(Stage::kRoute); s <= static_cast<int>(Stage::kUnpermute); ++s) {
    EXPECT_EQ(step.calls(1, static_cast<Stage>(s)), 1) << stage_name(static_cast<Stage>(s));
  }
  EXPECT_EQ(step.ns(1, Stage::kAttention), 0);
  EXPECT_EQ(sum_row(step, 0), 0);
  EXPECT_EQ(sum_row(step, 2), 0);
}

// The demo model (5 MoE layers, 16 experts, top-2) through the batched forward: every layer
// reports attention and the routed stages, the LM head reports, each layer's counts add up to
// tokens x K, and the logits are the same bits with the profiler on and off.
TEST(Profiler, DecoderStepOnTheDemoModel) {
  auto model = Model::load(kDemo, LoadOptions{.prefault = false});
  Decoder& decoder = model->decoder();
  const ModelConfig& config = decoder.config();
  const int64_t L = config.num_layers, E = config.num_experts, K = config.num_experts_per_tok;
  const std::vector<int32_t> a = {4093, 17, 230, 99, 1000, 5, 42};
  const std::vector<int32_t> b = {4093, 300, 12};
  // Two sequences in one batch over one pool, one block each.
  const std::vector<int32_t> table_a = {0}, table_b = {1};
  auto run = [&](std::vector<float>* logits) {
    KvBlockPool pool(L, config.kv_dim(), config.kv_dim(), /*block_size=*/16, /*num_blocks=*/2);
    const ForwardBatch batch{.sequences = {{.tokens = a, .block_table = table_a},
                                           {.tokens = b, .block_table = table_b}}};
    logits->assign(Decoder::num_logit_rows(batch) * config.vocab_size, 0.0f);
    decoder.forward(batch, pool, *logits);
  };
  std::vector<float> off, on;
  run(&off);

  std::vector<int64_t> bytes(L, 1);
  Profiler profiler(ProfilerOptions{.num_layers = L, .num_experts = E, .expert_bytes = bytes});
  {
    ActiveProfiler guard(&profiler);
    profiler.begin_step(static_cast<int64_t>(a.size() + b.size()));
    run(&on);
    profiler.end_step();
  }
  EXPECT_EQ(on, off) << "the profiler changed the numerics";

  const StepRecord& step = profiler.steps().at(0);
  const int64_t tokens = static_cast<int64_t>(a.size() + b.size());
  int64_t touched = 0;
  for (int64_t l = 0; l < L; ++l) {
    EXPECT_GT(step.ns(l, Stage::kAttention), 0) << "layer " << l;
    EXPECT_GT(step.ns(l, Stage::kRoute), 0) << "layer " << l;
    EXPECT_GT(step.ns(l, Stage::kExperts), 0) << "layer " << l;
    EXPECT_EQ(step.ns(l, Stage::kDenseMlp), 0) << "layer " << l;
    const auto begin = step.expert_rows.begin() + l * E;
    EXPECT_EQ(std::accumulate(begin, begin + E, int64_t{0}), tokens * K) << "layer " << l;
    touched += std::count_if(begin, begin + E, [](int32_t n) { return n > 0; });
  }
  EXPECT_GT(step.ns(L, Stage::kLmHead), 0);
  EXPECT_EQ(step.expert_bytes_read, touched);
}

int count(const std::string& text, const std::string& needle) {
  int n = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}

// What a hand-made profile ran: one sequence, top-2, H 8, one prefill step.
RunInfo hand_run(int64_t input_len, int64_t output_len, std::vector<bool> layer_is_moe) {
  return RunInfo{.model = "hand",
                 .model_type = "test",
                 .batch = 1,
                 .input_len = input_len,
                 .output_len = output_len,
                 .token_source = "random",
                 .num_threads = 1,
                 .top_k = 2,
                 .hidden_size = 8,
                 .layer_is_moe = std::move(layer_is_moe)};
}

// The report built from a hand-made profile: 3 layers (layer 1 dense), 4 experts, top-2, one
// prefill step of 3 tokens and two decode steps of 1 token.
TEST(ProfileReport, BuiltFromAHandMadeProfile) {
  Profiler profiler(
      ProfilerOptions{.num_layers = 3, .num_experts = 4, .expert_bytes = {10, 0, 10}});
  const std::vector<std::vector<int32_t>> routing = {{0, 1, 0, 2, 0, 3}, {1, 2}, {3, 0}};
  for (int step = 0; step < 3; ++step) {
    const int64_t tokens = step == 0 ? 3 : 1;
    profiler.begin_step(tokens);
    for (int64_t l = 0; l < 3; ++l) {
      profiler.set_current_layer(l);
      profiler.add_time(Stage::kAttention, 1000);
      if (l == 1) {
        profiler.add_time(Stage::kDenseMlp, 500);
        continue;
      }
      profiler.add_time(Stage::kExperts, 2000);
      profiler.record_routing(l, routing[step]);
    }
    profiler.set_current_layer(-1);
    profiler.add_time(Stage::kSample, 100);
    profiler.end_step();
  }
  const RunInfo run = hand_run(/*input_len=*/3, /*output_len=*/2, {true, false, true});
  const nlohmann::ordered_json report = build_report(run, profiler, {}, OverheadInfo{});

  ASSERT_EQ(report["steps"].size(), 3u);
  EXPECT_EQ(report["steps"][0]["phase"], "prefill");
  EXPECT_EQ(report["steps"][1]["phase"], "decode");
  EXPECT_EQ(report["layers"][0]["load"], (std::vector<int64_t>{4, 2, 2, 2}));
  EXPECT_EQ(report["layers"][2]["load"], (std::vector<int64_t>{4, 2, 2, 2}));
  EXPECT_EQ(report["layers"][1]["load"], (std::vector<int64_t>{0, 0, 0, 0}));
  EXPECT_TRUE(report["steps"][0]["imbalance"][1].is_null());
  // Step 0, layer 0: rows {3, 1, 1, 1}, mean 1.5 -> 2.0. Step 1: {0, 1, 1, 0} -> 2.0.
  EXPECT_DOUBLE_EQ(report["steps"][0]["imbalance"][0].get<double>(), 2.0);
  EXPECT_DOUBLE_EQ(report["steps"][1]["imbalance_max"].get<double>(), 2.0);
  EXPECT_EQ(report["steps"][0]["expert_bytes_read"], 2 * 4 * 10);
  EXPECT_EQ(report["steps"][1]["expert_bytes_read"], 2 * 2 * 10);
  EXPECT_DOUBLE_EQ(report["layers"][1]["stage_ms"]["dense_mlp"].get<double>(), 3 * 500e-6);
  double shares = 0.0;
  for (const auto& t : report["totals"]) shares += t["share"].get<double>();
  EXPECT_NEAR(shares, 1.0, 1e-9);
  const auto& experts = report["totals"][static_cast<int>(Stage::kExperts)];
  EXPECT_EQ(experts["stage"], "experts");
  EXPECT_EQ(experts["calls"], 6);

  const std::string text = render_text_report(report);
  EXPECT_NE(text.find("experts"), std::string::npos);
  EXPECT_NE(text.find("dense_mlp"), std::string::npos);
  EXPECT_NE(text.find("not run by this model: route"), std::string::npos) << text;

  const std::string html = render_html_report(report);
  EXPECT_EQ(count(html, "<script"), 0);
  EXPECT_EQ(count(html, "http://") + count(html, "https://"), 0);
  EXPECT_EQ(count(html, "class=\"layer-bar\""), 3);
  EXPECT_EQ(count(html, "class=\"cell\""), 2 * 4) << "one cell per MoE layer and expert";
  EXPECT_EQ(count(html, "class=\"series\""), 2);
  const std::regex points_attr("class=\"series\"[^>]*points=\"([^\"]*)\"");
  for (auto it = std::sregex_iterator(html.begin(), html.end(), points_attr);
       it != std::sregex_iterator(); ++it) {
    const std::string points = (*it)[1];
    EXPECT_EQ(count(points, ","), 3) << "one point per step: " << points;
  }
}

// A sampled profile (time_every 2, four steps: one prefill, three decode): stage figures come
// from steps 0 and 2, each phase's timed steps standing for all of its steps (the decode step
// counts three times), shares are of the wall time so estimated, and the untimed steps carry no
// stage figures but their rows. With time_every 8 no decode step is timed and the decode phase
// is left out of the stage figures.
Profiler sampled_profile(int64_t time_every) {
  Profiler profiler(ProfilerOptions{.num_layers = 1, .num_experts = 2, .time_every = time_every});
  const std::vector<int32_t> routing = {0, 1};
  for (int step = 0; step < 4; ++step) {
    profiler.begin_step(1);
    profiler.set_current_layer(0);
    profiler.add_time(Stage::kExperts, step == 0 ? 5000 : 1000);
    profiler.record_routing(0, routing);
    profiler.set_current_layer(-1);
    busy_work(20000);  // wall time > the stage times
    profiler.end_step();
  }
  return profiler;
}

TEST(ProfileReport, SampledTimingScalesEachPhaseFromItsTimedSteps) {
  const RunInfo run = hand_run(/*input_len=*/1, /*output_len=*/3, {true});
  const Profiler profiler = sampled_profile(2);
  const nlohmann::ordered_json report = build_report(run, profiler, {}, OverheadInfo{});
  const auto& summary = report["summary"];
  EXPECT_EQ(summary["steps"], 4);
  EXPECT_EQ(summary["timed_steps"], 2);
  EXPECT_EQ(summary["time_every"], 2);
  EXPECT_EQ(summary["stage_steps"], 4);
  EXPECT_EQ(summary["stage_basis"], "scaled from the timed steps of each phase");
  for (int step = 0; step < 4; ++step) {
    const auto& s = report["steps"][step];
    EXPECT_EQ(s["timed"], step % 2 == 0);
    EXPECT_EQ(s["stage_us"].is_null(), step % 2 == 1);
    EXPECT_EQ(s["expert_rows"][0], (std::vector<int32_t>{1, 1}));
  }
  const auto& steps = profiler.steps();
  const double wall_ms = (steps[0].wall_ns + 3.0 * steps[2].wall_ns) * 1e-6;
  EXPECT_NEAR(summary["stage_wall_ms"].get<double>(), wall_ms, 1e-9);
  const auto& experts = report["totals"][static_cast<int>(Stage::kExperts)];
  EXPECT_NEAR(experts["total_ms"].get<double>(), (5000 + 3 * 1000) * 1e-6, 1e-12);
  EXPECT_NEAR(experts["mean_us_per_step"].get<double>(), 2.0, 1e-9);
  EXPECT_EQ(experts["calls"], 2);
  EXPECT_NEAR(experts["share"].get<double>(), 8000e-6 / wall_ms, 1e-9);
  double shares = 0.0;
  for (const auto& t : report["totals"]) shares += t["share"].get<double>();
  EXPECT_NEAR(shares, 1.0, 1e-9);
  EXPECT_NEAR(report["layers"][0]["stage_ms"]["experts"].get<double>(), 8000e-6, 1e-12);
  EXPECT_EQ(report["layers"][0]["load"], (std::vector<int64_t>{4, 4}));
  const std::string text = render_text_report(report);
  EXPECT_NE(text.find("timed on 2 of 4 steps"), std::string::npos) << text;
  EXPECT_NE(render_html_report(report).find("timed on 2 of the 4 steps"), std::string::npos);

  const Profiler prefill_only = sampled_profile(8);
  const nlohmann::ordered_json partial = build_report(run, prefill_only, {}, OverheadInfo{});
  EXPECT_EQ(partial["summary"]["timed_steps"], 1);
  EXPECT_EQ(partial["summary"]["stage_steps"], 1);
  EXPECT_EQ(partial["summary"]["stage_basis"],
            "scaled from the timed steps; a phase without one is left out");
  EXPECT_NEAR(partial["totals"][static_cast<int>(Stage::kExperts)]["total_ms"].get<double>(),
              5000e-6, 1e-12);
}

// The expert cache's counts as either decoder reports them (record_expert_cache, several calls
// per layer and step add up), in the step records, on the host-device link and in the report.
TEST(ProfileReport, ExpertCacheCountersPerLayerAndInTotal) {
  Profiler profiler(ProfilerOptions{.num_layers = 3, .num_experts = 4, .time_stages = false});
  const int64_t a[offload::kNumCacheCounters] = {2, 1, 1, 0, 0};  // hits, misses, unplaced, ...
  const int64_t b[offload::kNumCacheCounters] = {0, 0, 0, 3, 0};  // a prefetch of layer 2
  const int64_t c[offload::kNumCacheCounters] = {1, 0, 0, 0, 1, 0, 0, 2};  // 1 used, 2 wasted
  profiler.begin_step(4);
  EXPECT_FALSE(profiler.timing());
  profiler.record_expert_cache(0, a, 200, 0.001);
  profiler.record_expert_cache(2, b, 300, 0.0);
  profiler.record_expert_cache(2, c, 0, 0.0);
  profiler.end_step();
  profiler.begin_step(1);
  profiler.record_expert_cache(0, a, 200, 0.002);
  profiler.end_step();
  const StepRecord& first = profiler.steps()[0];
  EXPECT_EQ(first.expert_cache_count(0, offload::kCacheHits), 2);
  EXPECT_EQ(first.expert_cache_count(2, offload::kCachePrefetched), 3);
  EXPECT_EQ(first.expert_cache_count(2, offload::kCachePrefetchUsed), 1);
  EXPECT_EQ(first.expert_cache_bytes[2], 300);
  EXPECT_EQ(first.link_bytes[static_cast<int>(Link::kHostDevice)], 500);
  EXPECT_EQ(first.cache_hits, 3);
  EXPECT_EQ(first.cache_misses, 2);  // misses and unplaced: demands not found resident
  EXPECT_EQ(profiler.steps()[1].expert_cache_count(2, offload::kCachePrefetched), 0);  // per step
  EXPECT_THROW(profiler.record_expert_cache(3, a, 0, 0.0), Error);
  EXPECT_THROW(profiler.record_expert_cache(0, std::span<const int64_t>(a, 2), 0, 0.0), Error);

  const nlohmann::ordered_json report =
      build_report(hand_run(/*input_len=*/4, /*output_len=*/1, {true, false, true}), profiler, {},
                   OverheadInfo{});
  const auto& total = report["summary"]["expert_cache"];
  EXPECT_EQ(total["hits"], 5);
  EXPECT_EQ(total["misses"], 2);
  EXPECT_EQ(total["unplaced"], 2);
  EXPECT_EQ(total["prefetched"], 3);
  EXPECT_DOUBLE_EQ(total["prefetch_accuracy"].get<double>(), 1.0 / 3.0);
  EXPECT_EQ(total["host_to_device_bytes"], 700);
  EXPECT_NEAR(total["stall_ms"].get<double>(), 3.0, 1e-9);
  EXPECT_EQ(report["layers"][0]["expert_cache"]["hits"], 4);
  EXPECT_FALSE(report["layers"][1].contains("expert_cache"));  // dense
  EXPECT_EQ(report["layers"][2]["expert_cache"]["host_to_device_bytes"], 300);
  const std::string text = render_text_report(report);
  EXPECT_NE(text.find("expert cache: 5 hits, 2 misses, 2 unplaced"), std::string::npos) << text;
  EXPECT_NE(text.find("expert cache per layer"), std::string::npos);
}

}  // namespace
}  // namespace moeinfer::profile
