// report.html: the profile report as one self-contained page. Everything is inline (CSS in a
// <style>, charts as <svg>, tooltips as SVG <title>), there is no script and nothing is fetched,
// so the page opens from a file, an e-mail or a CI artefact the same way. Charts are drawn here
// in plain SVG with a small set of helpers (nice axis ticks, a categorical palette for stages,
// a sequential ramp for the heat map).
#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <string>
#include <vector>

#include "profile/report.h"

namespace moeinfer::profile {
namespace {

using Json = nlohmann::ordered_json;

std::string format(const char* fmt, ...) {
  char buffer[1024];
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(buffer, sizeof(buffer), fmt, args);
  va_end(args);
  return buffer;
}

std::string escape(const std::string& text) {
  std::string out;
  for (char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

// One colour per stage (report order), then "other". Chosen to stay apart from each other and
// readable on white; the routed path runs through blues and greens, step-level stages are warm.
const char* stage_colour(const std::string& name) {
  struct Entry {
    const char* name;
    const char* colour;
  };
  static const Entry kColours[] = {
      {"attention", "#4e79a7"}, {"route", "#f28e2b"},          {"plan", "#edc948"},
      {"dispatch", "#76b7b2"},  {"experts", "#59a14f"},        {"combine", "#b07aa1"},
      {"unpermute", "#9c755f"}, {"shared_experts", "#1b9e77"}, {"dense_mlp", "#8cd17d"},
      {"lm_head", "#e15759"},   {"sample", "#ff9da7"},         {"schedule", "#d4a6c8"},
      {"other", "#bab0ac"}};
  for (const Entry& e : kColours) {
    if (name == e.name) return e.colour;
  }
  return "#999999";
}

// A "nice" axis: ticks at 1, 2 or 5 times a power of ten, covering [0, max].
struct Axis {
  double top = 1.0;
  double step = 1.0;
};

Axis nice_axis(double max_value, int target_ticks = 5) {
  if (!(max_value > 0.0)) return {};
  const double raw = max_value / target_ticks;
  const double power = std::pow(10.0, std::floor(std::log10(raw)));
  double step = power;
  for (double m : {1.0, 2.0, 2.5, 5.0, 10.0}) {
    step = m * power;
    if (step >= raw) break;
  }
  return {std::ceil(max_value / step - 1e-9) * step, step};
}

std::string tick_label(double value, double step) {
  if (step >= 1.0) return format("%.0f", value);
  if (step >= 0.1) return format("%.1f", value);
  return format("%.2f", value);
}

// Sequential ramp for loads: t in [0, 1] from near-white to deep blue-violet.
std::string ramp(double t) {
  static const double kStops[][3] = {{247, 251, 255}, {198, 219, 239}, {107, 174, 214},
                                     {33, 113, 181},  {8, 48, 107},    {37, 0, 80}};
  constexpr int kN = 6;
  t = std::clamp(t, 0.0, 1.0) * (kN - 1);
  const int i = std::min(static_cast<int>(t), kN - 2);
  const double f = t - i;
  int rgb[3];
  for (int c = 0; c < 3; ++c) {
    rgb[c] = static_cast<int>(std::lround(kStops[i][c] + f * (kStops[i + 1][c] - kStops[i][c])));
  }
  return format("#%02x%02x%02x", rgb[0], rgb[1], rgb[2]);
}

std::string human_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 4) {
    bytes /= 1024.0;
    ++u;
  }
  return format(u == 0 ? "%.0f %s" : "%.1f %s", bytes, units[u]);
}

std::string human_us(double us) {
  if (us >= 1e6) return format("%.2f s", us * 1e-6);
  if (us >= 1e3) return format("%.2f ms", us * 1e-3);
  return format("%.1f µs", us);
}

// Layer stages with any time in the run, in report order.
std::vector<std::string> active_layer_stages(const Json& report) {
  std::vector<std::string> names;
  for (const Json& s : report["stages"]) {
    if (s["scope"] != "layer") continue;
    const std::string name = s["name"].get<std::string>();
    for (const Json& l : report["layers"]) {
      if (l["stage_ms"][name].get<double>() > 0.0) {
        names.push_back(name);
        break;
      }
    }
  }
  return names;
}

// Horizontal legend of coloured swatches; returns its SVG and advances nothing else.
std::string legend(const std::vector<std::pair<std::string, std::string>>& items, double x,
                   double y, double width) {
  std::string out = format("<g class=\"legend\" transform=\"translate(%.1f,%.1f)\">", x, y);
  double cx = 0.0, cy = 0.0;
  for (const auto& [label, colour] : items) {
    const double w = 22.0 + 7.2 * static_cast<double>(label.size()) + 18.0;
    if (cx > 0.0 && cx + w > width) {
      cx = 0.0;
      cy += 20.0;
    }
    out += format(
        "<g class=\"legend-item\"><rect x=\"%.1f\" y=\"%.1f\" width=\"14\" height=\"14\" rx=\"3\" "
        "fill=\"%s\"/><text x=\"%.1f\" y=\"%.1f\" class=\"legend-text\">%s</text></g>",
        cx, cy, colour.c_str(), cx + 20.0, cy + 11.5, escape(label).c_str());
    cx += w;
  }
  return out + "</g>";
}

// Chart 1: mean time per step of each layer, stacked by stage.
std::string stage_layer_chart(const Json& report) {
  const std::vector<std::string> stages = active_layer_stages(report);
  const Json& layers = report["layers"];
  const double steps = std::max(report["summary"]["stage_steps"].get<double>(), 1.0);
  const int64_t L = static_cast<int64_t>(layers.size());
  double max_total = 0.0;
  for (const Json& l : layers) {
    double total = 0.0;
    for (const std::string& s : stages) total += l["stage_ms"][s].get<double>() * 1e3 / steps;
    max_total = std::max(max_total, total);
  }
  const Axis axis = nice_axis(max_total * 1.08);
  const double W = 960, left = 70, right = 20, top = 56, plot_h = 300, bottom = 48;
  const double plot_w = W - left - right;
  const double H = top + plot_h + bottom;
  std::string out = format(
      "<svg id=\"chart-stage-layers\" class=\"chart\" viewBox=\"0 0 %.0f %.0f\" "
      "width=\"%.0f\" height=\"%.0f\" role=\"img\" aria-labelledby=\"t-stage-layers\">"
      "<title id=\"t-stage-layers\">Stage time per layer</title>",
      W, H, W, H);
  std::vector<std::pair<std::string, std::string>> items;
  for (const std::string& s : stages) items.emplace_back(s, stage_colour(s));
  out += legend(items, left, 12, plot_w);
  // Grid and y axis.
  for (double v = 0.0; v <= axis.top + 1e-9; v += axis.step) {
    const double y = top + plot_h - v / axis.top * plot_h;
    out += format(
        "<line class=\"grid\" x1=\"%.1f\" x2=\"%.1f\" y1=\"%.1f\" y2=\"%.1f\"/>"
        "<text class=\"tick\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">%s</text>",
        left, left + plot_w, y, y, left - 8, y + 4, tick_label(v, axis.step).c_str());
  }
  out += format(
      "<text class=\"axis-title\" transform=\"translate(18,%.1f) rotate(-90)\" "
      "text-anchor=\"middle\">mean µs per step</text>",
      top + plot_h / 2);
  const double band = plot_w / std::max<int64_t>(L, 1);
  const double bar_w = std::min(band * 0.62, 90.0);
  for (int64_t i = 0; i < L; ++i) {
    const Json& l = layers[i];
    const double x = left + band * i + (band - bar_w) / 2;
    double y = top + plot_h;
    double total = 0.0;
    out += format("<g class=\"layer-bar\" data-layer=\"%lld\">", static_cast<long long>(i));
    for (const std::string& s : stages) {
      const double us = l["stage_ms"][s].get<double>() * 1e3 / steps;
      total += us;
      const double h = us / axis.top * plot_h;
      y -= h;
      out += format(
          "<rect class=\"seg\" x=\"%.1f\" y=\"%.2f\" width=\"%.1f\" height=\"%.2f\" fill=\"%s\">"
          "<title>layer %lld · %s: %s per step</title></rect>",
          x, y, bar_w, std::max(h, 0.0), stage_colour(s), static_cast<long long>(i), s.c_str(),
          human_us(us).c_str());
    }
    out +=
        format("<text class=\"bar-label\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%s</text>",
               x + bar_w / 2, y - 6, human_us(total).c_str());
    out += format(
        "<text class=\"tick\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%lld%s</text></g>",
        x + bar_w / 2, top + plot_h + 18, static_cast<long long>(i),
        l["moe"].get<bool>() ? "" : " (dense)");
  }
  out += format("<line class=\"axis\" x1=\"%.1f\" x2=\"%.1f\" y1=\"%.1f\" y2=\"%.1f\"/>", left,
                left + plot_w, top + plot_h, top + plot_h);
  out +=
      format("<text class=\"axis-title\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">layer</text>",
             left + plot_w / 2, H - 8);
  return out + "</svg>";
}

// Chart 4 (under offloading): each MoE layer's demands by where they were served, stacked.
struct CacheOutcome {
  const char* key;  // the report's field
  const char* label;
  const char* colour;
};
constexpr CacheOutcome kCacheOutcomes[] = {{"hits", "hit (resident)", "#2a9d8f"},
                                           {"misses", "copied in", "#e9c46a"},
                                           {"unplaced", "read from host", "#e76f51"},
                                           {"cpu_experts", "computed on the CPU", "#6a4c93"}};

std::string expert_cache_chart(const Json& report) {
  std::vector<const Json*> layers;
  for (const Json& l : report["layers"]) {
    if (l.contains("expert_cache")) layers.push_back(&l);
  }
  double max_total = 0.0;
  for (const Json* l : layers) {
    double total = 0.0;
    for (const CacheOutcome& o : kCacheOutcomes) total += (*l)["expert_cache"][o.key].get<double>();
    max_total = std::max(max_total, total);
  }
  const Axis axis = nice_axis(std::max(max_total, 1.0) * 1.08);
  const double W = 960, left = 70, right = 20, top = 56, plot_h = 240, bottom = 48;
  const double plot_w = W - left - right;
  const double H = top + plot_h + bottom;
  std::string out = format(
      "<svg id=\"chart-expert-cache\" class=\"chart\" viewBox=\"0 0 %.0f %.0f\" "
      "width=\"%.0f\" height=\"%.0f\" role=\"img\" aria-labelledby=\"t-expert-cache\">"
      "<title id=\"t-expert-cache\">Expert demands per layer by where they were served</title>",
      W, H, W, H);
  std::vector<std::pair<std::string, std::string>> items;
  for (const CacheOutcome& o : kCacheOutcomes) items.emplace_back(o.label, o.colour);
  out += legend(items, left, 12, plot_w);
  for (double v = 0.0; v <= axis.top + 1e-9; v += axis.step) {
    const double y = top + plot_h - v / axis.top * plot_h;
    out += format(
        "<line class=\"grid\" x1=\"%.1f\" x2=\"%.1f\" y1=\"%.1f\" y2=\"%.1f\"/>"
        "<text class=\"tick\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">%s</text>",
        left, left + plot_w, y, y, left - 8, y + 4, tick_label(v, axis.step).c_str());
  }
  out += format(
      "<text class=\"axis-title\" transform=\"translate(18,%.1f) rotate(-90)\" "
      "text-anchor=\"middle\">expert demands</text>",
      top + plot_h / 2);
  const double band = plot_w / std::max<size_t>(layers.size(), 1);
  const double bar_w = std::min(band * 0.62, 90.0);
  for (size_t i = 0; i < layers.size(); ++i) {
    const Json& l = *layers[i];
    const long long layer = l["layer"].get<long long>();
    const double x = left + band * static_cast<double>(i) + (band - bar_w) / 2;
    double y = top + plot_h;
    out += format("<g class=\"cache-bar\" data-layer=\"%lld\">", layer);
    for (const CacheOutcome& o : kCacheOutcomes) {
      const double n = l["expert_cache"][o.key].get<double>();
      const double h = n / axis.top * plot_h;
      y -= h;
      out += format(
          "<rect class=\"seg\" x=\"%.1f\" y=\"%.2f\" width=\"%.1f\" height=\"%.2f\" "
          "fill=\"%s\"><title>layer %lld · %s: %.0f</title></rect>",
          x, y, bar_w, std::max(h, 0.0), o.colour, layer, o.label, n);
    }
    out +=
        format("<text class=\"tick\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%lld</text></g>",
               x + bar_w / 2, top + plot_h + 18, layer);
  }
  out += format("<line class=\"axis\" x1=\"%.1f\" x2=\"%.1f\" y1=\"%.1f\" y2=\"%.1f\"/>", left,
                left + plot_w, top + plot_h, top + plot_h);
  out += format(
      "<text class=\"axis-title\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">MoE "
      "layer</text>",
      left + plot_w / 2, H - 8);
  return out + "</svg>";
}

// The expert cache's section: totals, the chart, and a table per layer.
std::string card(const std::string& key, const std::string& value, const std::string& sub);

std::string expert_cache_section(const Json& report) {
  const Json& c = report["summary"]["expert_cache"];
  std::string html =
      "<section><h2>Expert cache</h2><p class=\"sub\">Under <code>--expert-budget</code>: "
      "each MoE layer's demanded experts by where they were served (resident, copied in over "
      "PCIe, read from host memory by the GPU, or computed on the CPU by "
      "<code>--cold-experts</code>), with the prefetch's accuracy, the bytes that crossed host "
      "to device and the time compute waited for copies.</p>";
  html += format(
      "<div class=\"cards\">%s%s%s%s</div>",
      card("hit rate",
           format("%.1f%%", 100.0 * c["hits"].get<double>() /
                                std::max(1.0, c["hits"].get<double>() + c["misses"].get<double>() +
                                                  c["unplaced"].get<double>() +
                                                  c["cpu_experts"].get<double>())),
           format("%lld hits, %lld copied, %lld from host, %lld on the CPU",
                  c["hits"].get<long long>(), c["misses"].get<long long>(),
                  c["unplaced"].get<long long>(), c["cpu_experts"].get<long long>()))
          .c_str(),
      card("prefetch accuracy", format("%.1f%%", 100.0 * c["prefetch_accuracy"].get<double>()),
           format("%lld used, %lld evicted unused, of %lld prefetched",
                  c["prefetch_used"].get<long long>(), c["prefetch_wasted"].get<long long>(),
                  c["prefetched"].get<long long>()))
          .c_str(),
      card("host to device", human_bytes(c["host_to_device_bytes"].get<double>()),
           format("%.3f ms stalled", c["stall_ms"].get<double>()))
          .c_str(),
      card("rows on the CPU", format("%lld", c["cpu_rows"].get<long long>()),
           "rows of the experts computed on the host")
          .c_str());
  html += expert_cache_chart(report);
  html +=
      "<div class=\"scroll\"><table class=\"layers\"><thead><tr><th>layer</th><th>hits</th>"
      "<th>copied</th><th>from host</th><th>on CPU</th><th>CPU rows</th><th>prefetched</th>"
      "<th>prefetch used</th><th>to device</th><th>stall</th></tr></thead><tbody>";
  for (const Json& l : report["layers"]) {
    if (!l.contains("expert_cache")) continue;
    const Json& e = l["expert_cache"];
    html += format(
        "<tr><td>%lld</td><td>%lld</td><td>%lld</td><td>%lld</td><td>%lld</td><td>%lld</td>"
        "<td>%lld</td><td>%.0f%%</td><td>%s</td><td>%.3f ms</td></tr>",
        l["layer"].get<long long>(), e["hits"].get<long long>(), e["misses"].get<long long>(),
        e["unplaced"].get<long long>(), e["cpu_experts"].get<long long>(),
        e["cpu_rows"].get<long long>(), e["prefetched"].get<long long>(),
        100.0 * e["prefetch_accuracy"].get<double>(),
        human_bytes(e["host_to_device_bytes"].get<double>()).c_str(), e["stall_ms"].get<double>());
  }
  return html + "</tbody></table></div></section>";
}

// Chart 2: rows each expert received in each MoE layer over the whole run.
std::string heatmap_chart(const Json& report) {
  const Json& layers = report["layers"];
  const int64_t E = report["run"]["num_experts"].get<int64_t>();
  std::vector<const Json*> moe;
  for (const Json& l : layers) {
    if (l["moe"].get<bool>()) moe.push_back(&l);
  }
  double max_load = 0.0;
  for (const Json* l : moe) {
    for (const Json& c : (*l)["load"]) max_load = std::max(max_load, c.get<double>());
  }
  const double W = 960, left = 70, right = 110, top = 16, bottom = 46;
  const double cell_w = std::min(56.0, (W - left - right) / std::max<int64_t>(E, 1));
  const double cell_h = std::clamp(cell_w * 0.7, 14.0, 34.0);
  const double plot_w = cell_w * E;
  const double plot_h = cell_h * static_cast<double>(moe.size());
  const double H = top + plot_h + bottom;
  std::string out = format(
      "<svg id=\"chart-load-heatmap\" class=\"chart\" viewBox=\"0 0 %.0f %.0f\" "
      "width=\"%.0f\" height=\"%.0f\" role=\"img\" aria-labelledby=\"t-heatmap\">"
      "<title id=\"t-heatmap\">Expert load per layer</title>",
      W, H, W, H);
  const bool numbers = cell_w >= 26.0;
  for (size_t r = 0; r < moe.size(); ++r) {
    const Json& l = *moe[r];
    const double y = top + cell_h * static_cast<double>(r);
    const double assigned = l["assignments"].get<double>();
    const double mean = assigned / std::max<int64_t>(E, 1);
    out += format("<g class=\"heat-row\" data-layer=\"%lld\">", l["layer"].get<long long>());
    out += format("<text class=\"tick\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">%lld</text>",
                  left - 8, y + cell_h / 2 + 4, l["layer"].get<long long>());
    for (int64_t e = 0; e < E; ++e) {
      const double load = l["load"][e].get<double>();
      const double t = max_load > 0.0 ? load / max_load : 0.0;
      const double x = left + cell_w * e;
      out += format(
          "<rect class=\"cell\" x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"%s\">"
          "<title>layer %lld · expert %lld: %.0f rows (%.2f× mean, %.1f%% of the layer)</title>"
          "</rect>",
          x + 0.5, y + 0.5, cell_w - 1.0, cell_h - 1.0, ramp(t).c_str(),
          l["layer"].get<long long>(), static_cast<long long>(e), load,
          mean > 0 ? load / mean : 0.0, assigned > 0 ? 100.0 * load / assigned : 0.0);
      if (numbers) {
        out += format(
            "<text class=\"cell-text\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\" "
            "fill=\"%s\">%.0f</text>",
            x + cell_w / 2, y + cell_h / 2 + 4, t > 0.45 ? "#ffffff" : "#1f2937", load);
      }
    }
    out += "</g>";
  }
  // Expert ids along the bottom (every one when there is room, else every 4th / 8th).
  const int64_t every = cell_w >= 18 ? 1 : cell_w >= 6 ? 4 : 8;
  for (int64_t e = 0; e < E; e += every) {
    out += format("<text class=\"tick\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%lld</text>",
                  left + cell_w * e + cell_w / 2, top + plot_h + 16, static_cast<long long>(e));
  }
  out += format(
      "<text class=\"axis-title\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">expert</text>",
      left + plot_w / 2, H - 6);
  out += format(
      "<text class=\"axis-title\" transform=\"translate(22,%.1f) rotate(-90)\" "
      "text-anchor=\"middle\">layer</text>",
      top + plot_h / 2);
  // Colour scale.
  const double lx = left + plot_w + 36, lh = std::max(plot_h, 80.0);
  out += "<defs><linearGradient id=\"heat-ramp\" x1=\"0\" y1=\"1\" x2=\"0\" y2=\"0\">";
  for (int i = 0; i <= 10; ++i) {
    out += format("<stop offset=\"%d%%\" stop-color=\"%s\"/>", i * 10, ramp(i / 10.0).c_str());
  }
  out += "</linearGradient></defs>";
  out += format(
      "<g class=\"color-scale\"><rect x=\"%.1f\" y=\"%.1f\" width=\"14\" height=\"%.1f\" "
      "fill=\"url(#heat-ramp)\" stroke=\"#cbd5e1\"/>"
      "<text class=\"tick\" x=\"%.1f\" y=\"%.1f\">%.0f</text>"
      "<text class=\"tick\" x=\"%.1f\" y=\"%.1f\">0</text>"
      "<text class=\"tick\" x=\"%.1f\" y=\"%.1f\">rows</text></g>",
      lx, top, lh, lx + 20, top + 10, max_load, lx + 20, top + lh, lx - 2, top + lh + 16);
  return out + "</svg>";
}

// Chart 3: max/mean expert load of every step (mean over MoE layers, and the worst layer).
std::string imbalance_chart(const Json& report) {
  const Json& steps = report["steps"];
  const int64_t N = static_cast<int64_t>(steps.size());
  double max_value = 1.0;
  for (const Json& s : steps) {
    if (s["imbalance_max"].is_number())
      max_value = std::max(max_value, s["imbalance_max"].get<double>());
  }
  const Axis axis = nice_axis(max_value * 1.08);
  const double W = 960, left = 70, right = 20, top = 40, plot_h = 260, bottom = 48;
  const double plot_w = W - left - right;
  const double H = top + plot_h + bottom;
  auto px = [&](int64_t i) { return left + (N > 1 ? plot_w * i / (N - 1) : plot_w / 2); };
  auto py = [&](double v) { return top + plot_h - v / axis.top * plot_h; };
  std::string out = format(
      "<svg id=\"chart-imbalance\" class=\"chart\" viewBox=\"0 0 %.0f %.0f\" "
      "width=\"%.0f\" height=\"%.0f\" role=\"img\" aria-labelledby=\"t-imbalance\">"
      "<title id=\"t-imbalance\">Expert load imbalance over steps</title>",
      W, H, W, H);
  // Prefill steps shaded.
  const int64_t prefill = report["summary"]["prefill_steps"].get<int64_t>();
  if (prefill > 0 && N > 1) {
    const double x0 = left,
                 x1 = std::min(px(prefill - 1) + plot_w / (2.0 * (N - 1)), left + plot_w);
    out += format(
        "<rect class=\"prefill\" x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\"/>"
        "<text class=\"note\" x=\"%.1f\" y=\"%.1f\">prefill</text>",
        x0, top, std::max(x1 - x0, 2.0), plot_h, x0 + 4, top + 14);
  }
  for (double v = 0.0; v <= axis.top + 1e-9; v += axis.step) {
    out += format(
        "<line class=\"grid\" x1=\"%.1f\" x2=\"%.1f\" y1=\"%.1f\" y2=\"%.1f\"/>"
        "<text class=\"tick\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">%s</text>",
        left, left + plot_w, py(v), py(v), left - 8, py(v) + 4, tick_label(v, axis.step).c_str());
  }
  out += format(
      "<line class=\"balanced\" x1=\"%.1f\" x2=\"%.1f\" y1=\"%.1f\" y2=\"%.1f\"/>"
      "<text class=\"note\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">1.0 = perfectly "
      "balanced</text>",
      left, left + plot_w, py(1.0), py(1.0), left + plot_w - 4, py(1.0) - 6);
  // X ticks: about 10 step labels.
  const int64_t every = std::max<int64_t>(1, static_cast<int64_t>(nice_axis(N, 10).step));
  for (int64_t i = 0; i < N; i += every) {
    out += format(
        "<line class=\"tick-mark\" x1=\"%.1f\" x2=\"%.1f\" y1=\"%.1f\" y2=\"%.1f\"/>"
        "<text class=\"tick\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%lld</text>",
        px(i), px(i), top + plot_h, top + plot_h + 5, px(i), top + plot_h + 18,
        static_cast<long long>(i));
  }
  out += format("<line class=\"axis\" x1=\"%.1f\" x2=\"%.1f\" y1=\"%.1f\" y2=\"%.1f\"/>", left,
                left + plot_w, top + plot_h, top + plot_h);
  out +=
      format("<text class=\"axis-title\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">step</text>",
             left + plot_w / 2, H - 8);
  out += format(
      "<text class=\"axis-title\" transform=\"translate(18,%.1f) rotate(-90)\" "
      "text-anchor=\"middle\">busiest expert / mean</text>",
      top + plot_h / 2);
  struct Series {
    const char* key;
    const char* label;
    const char* colour;
  };
  const Series series[] = {{"imbalance_max", "worst layer", "#e15759"},
                           {"imbalance_mean", "mean over MoE layers", "#4e79a7"}};
  for (const Series& s : series) {
    std::string points;
    for (int64_t i = 0; i < N; ++i) {
      const Json& v = steps[i][s.key];
      if (!v.is_number()) continue;
      points += format("%s%.1f,%.1f", points.empty() ? "" : " ", px(i), py(v.get<double>()));
    }
    out += format(
        "<polyline class=\"series\" data-series=\"%s\" fill=\"none\" stroke=\"%s\" "
        "stroke-width=\"2\" stroke-linejoin=\"round\" points=\"%s\"><title>%s</title></polyline>",
        s.key, s.colour, points.c_str(), s.label);
  }
  // Hover targets with the exact figures when the steps are few enough to tell apart.
  if (N <= 200) {
    for (int64_t i = 0; i < N; ++i) {
      const Json& step = steps[i];
      if (!step["imbalance_max"].is_number()) continue;
      out += format(
          "<circle class=\"dot\" cx=\"%.1f\" cy=\"%.1f\" r=\"%.1f\" fill=\"#e15759\">"
          "<title>step %lld (%s, %lld tokens): worst layer %.2f, mean %.2f</title></circle>",
          px(i), py(step["imbalance_max"].get<double>()), N <= 60 ? 3.0 : 2.0,
          static_cast<long long>(i), step["phase"].get<std::string>().c_str(),
          step["tokens"].get<long long>(), step["imbalance_max"].get<double>(),
          step["imbalance_mean"].get<double>());
    }
  }
  out +=
      legend({{"worst layer", "#e15759"}, {"mean over MoE layers", "#4e79a7"}}, left, 10, plot_w);
  return out + "</svg>";
}

// Where one step's time goes: a single horizontal stacked bar of every stage and "other".
std::string step_breakdown(const Json& report) {
  const double W = 960, left = 0, top = 6, bar_h = 26;
  double total = 0.0;
  for (const Json& t : report["totals"]) total += std::max(0.0, t["total_ms"].get<double>());
  std::string out = format(
      "<svg id=\"chart-step-breakdown\" class=\"chart\" viewBox=\"0 0 %.0f %.0f\" width=\"%.0f\" "
      "height=\"%.0f\" role=\"img\"><title>Share of step time by stage</title>",
      W, top + bar_h + 6, W, top + bar_h + 6);
  double x = left;
  for (const Json& t : report["totals"]) {
    const double ms = std::max(0.0, t["total_ms"].get<double>());
    if (total <= 0.0 || ms <= 0.0) continue;
    const std::string name = t["stage"].get<std::string>();
    const double w = ms / total * W;
    out += format(
        "<rect x=\"%.2f\" y=\"%.1f\" width=\"%.2f\" height=\"%.1f\" fill=\"%s\"><title>%s: %.1f%% "
        "(%.3f ms)</title></rect>",
        x, top, w, bar_h, stage_colour(name), name.c_str(), 100.0 * t["share"].get<double>(), ms);
    if (w > 64) {
      out += format("<text class=\"seg-text\" x=\"%.1f\" y=\"%.1f\">%s %.0f%%</text>", x + 6,
                    top + bar_h / 2 + 4, name.c_str(), 100.0 * t["share"].get<double>());
    }
    x += w;
  }
  return out + "</svg>";
}

const char* kStyle = R"css(
:root { --ink:#1f2937; --muted:#6b7280; --line:#e5e7eb; --card:#ffffff; --bg:#f4f6fa;
        --accent:#4e79a7; }
* { box-sizing: border-box; }
body { margin:0; background:var(--bg); color:var(--ink);
       font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif; }
header { background:linear-gradient(120deg,#1e3a5f,#4e79a7); color:#fff; padding:26px 40px 22px; }
header h1 { margin:0 0 4px; font-size:24px; font-weight:650; letter-spacing:.2px; }
header p { margin:0; opacity:.88; }
main { max-width:1100px; margin:0 auto; padding:22px 24px 40px; }
.cards { display:grid; grid-template-columns:repeat(auto-fill,minmax(185px,1fr)); gap:12px;
         margin-bottom:18px; }
.card { background:var(--card); border:1px solid var(--line); border-radius:10px;
        padding:12px 14px; box-shadow:0 1px 2px rgba(15,23,42,.04); }
.card .k { color:var(--muted); font-size:12px; text-transform:uppercase; letter-spacing:.5px; }
.card .v { font-size:22px; font-weight:650; margin-top:2px; }
.card .s { color:var(--muted); font-size:12px; }
section { background:var(--card); border:1px solid var(--line); border-radius:12px;
          padding:18px 22px 14px; margin:16px 0; box-shadow:0 1px 2px rgba(15,23,42,.04); }
section h2 { margin:0 0 2px; font-size:17px; }
section .sub { margin:0 0 10px; color:var(--muted); font-size:13px; }
svg.chart { display:block; max-width:100%; height:auto; margin:0 auto; }
svg text { font-family:inherit; }
.tick { font-size:11.5px; fill:#4b5563; }
.axis-title { font-size:12.5px; fill:#374151; font-weight:600; }
.legend-text { font-size:12px; fill:#374151; }
.bar-label { font-size:11.5px; fill:#111827; font-weight:600; }
.cell-text { font-size:11px; font-variant-numeric:tabular-nums; pointer-events:none; }
.seg-text { font-size:12px; fill:#fff; font-weight:600; pointer-events:none; }
.note { font-size:11.5px; fill:#6b7280; font-style:italic; }
.grid { stroke:#eef0f4; stroke-width:1; }
.axis { stroke:#9ca3af; stroke-width:1; }
.tick-mark { stroke:#9ca3af; }
.balanced { stroke:#6b7280; stroke-dasharray:5 4; stroke-width:1.2; }
.prefill { fill:#fdf3e1; }
rect.seg:hover, rect.cell:hover { stroke:#111827; stroke-width:1.5; }
table { border-collapse:collapse; width:100%; font-size:13px; font-variant-numeric:tabular-nums; }
th, td { padding:6px 10px; border-bottom:1px solid var(--line); text-align:right; }
th:first-child, td:first-child { text-align:left; }
th { color:var(--muted); font-weight:600; font-size:12px; text-transform:uppercase;
     letter-spacing:.4px; }
.swatch { display:inline-block; width:10px; height:10px; border-radius:2px; margin-right:7px; }
.bar-cell { position:relative; }
.bar-cell span.fill { position:absolute; left:0; top:25%; height:50%; background:#dbe7f3;
                      border-radius:2px; z-index:0; }
.bar-cell span.num { position:relative; z-index:1; }
footer { color:var(--muted); font-size:12px; text-align:center; margin-top:22px; }
table.layers { font-size:12.5px; }
table.layers th, table.layers td { padding:6px 5px; white-space:nowrap; }
.scroll { overflow-x:auto; }
.muted { color:var(--muted); }
table.layers th { text-transform:none; letter-spacing:0; white-space:nowrap; }
code { background:#eef2f7; padding:1px 5px; border-radius:4px; font-size:12.5px; }
)css";

std::string card(const std::string& key, const std::string& value, const std::string& sub) {
  return format(
      "<div class=\"card\"><div class=\"k\">%s</div><div class=\"v\">%s</div>"
      "<div class=\"s\">%s</div></div>",
      escape(key).c_str(), escape(value).c_str(), escape(sub).c_str());
}

}  // namespace

std::string render_html_report(const Json& report) {
  const Json& run = report["run"];
  const Json& summary = report["summary"];
  const Json& overhead = report["overhead"];
  const std::string model = run["model"].get<std::string>();
  std::string html;
  html += "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">";
  html += "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">";
  html += "<title>moeinfer profile · " + escape(model) + "</title>";
  html += std::string("<style>") + kStyle + "</style></head><body>";
  html += "<header><h1>moeinfer profile · " + escape(model) + "</h1>";
  html += format(
      "<p>%s · %lld layers · %lld experts, top-%lld · batch %lld × %lld %s input tokens, then "
      "%lld decode steps · %lld threads</p></header><main>",
      escape(run["model_type"].get<std::string>()).c_str(), run["num_layers"].get<long long>(),
      run["num_experts"].get<long long>(), run["top_k"].get<long long>(),
      run["batch"].get<long long>(), run["input_len"].get<long long>(),
      escape(run["tokens"].get<std::string>()).c_str(), run["output_len"].get<long long>(),
      run["threads"].get<long long>());

  // Summary cards.
  double imbalance_sum = 0.0;
  int64_t imbalance_n = 0;
  for (const Json& s : report["steps"]) {
    if (s["phase"] == "decode" && s["imbalance_mean"].is_number()) {
      imbalance_sum += s["imbalance_mean"].get<double>();
      ++imbalance_n;
    }
  }
  html += "<div class=\"cards\">";
  html += card("decode step", format("%.3f ms", summary["decode_step_mean_ms"].get<double>()),
               format("%.0f tokens/s over %lld steps", summary["decode_tokens_per_s"].get<double>(),
                      summary["decode_steps"].get<long long>()));
  html += card("prefill", format("%.2f ms", summary["prefill_ms"].get<double>()),
               format("%.0f tokens/s, %lld tokens", summary["prefill_tokens_per_s"].get<double>(),
                      summary["prefill_tokens"].get<long long>()));
  html += card("expert weights read",
               human_bytes(summary["expert_bytes_read_per_decode_step"].get<double>()),
               "per decode step (distinct experts × bytes)");
  html += card("decode imbalance", imbalance_n ? format("%.2f×", imbalance_sum / imbalance_n) : "-",
               "busiest expert / mean, mean over layers");
  // The estimate (scopes per step x the measured cost of one scope) is steady; the A/B timings
  // carry the machine's noise, so they are the sub-line.
  html += card("profiler overhead", format("%.2f%%", 100.0 * overhead["estimated"].get<double>()),
               overhead["repeats"].get<int64_t>() > 0
                   ? format("of step time (estimate); measured on a decode step, off/on "
                            "alternating: %+.2f%%",
                            100.0 * overhead["measured_step"].get<double>())
                   : std::string("of step time, from the cost of one scope"));
  html += "</div>";

  // Which steps the stage figures below come from: all, or one in time_every.
  const int64_t timed_steps = summary["timed_steps"].get<int64_t>();
  const std::string timed_note =
      timed_steps == summary["steps"].get<int64_t>()
          ? std::string()
          : format(
                " Stages were timed on %lld of the %lld steps (one in %lld; the other steps "
                "counted rows and bytes only): the figures are %s.",
                static_cast<long long>(timed_steps), summary["steps"].get<long long>(),
                summary["time_every"].get<long long>(),
                summary["stage_basis"].get<std::string>().c_str());
  html +=
      "<section><h2>Where a step's time goes</h2><p class=\"sub\">Share of the steps' wall "
      "time by stage; <i>other</i> is time no stage claims (norms, residual adds, embedding, "
      "bookkeeping)." +
      timed_note + "</p>";
  html += step_breakdown(report);
  html += "</section>";

  html +=
      "<section><h2>Stage time per layer</h2><p class=\"sub\">Mean time per step spent in each "
      "stage of each layer, stacked. Hover a segment for its figure; the thin stages' figures "
      "are in the Layers table below.</p>";
  html += stage_layer_chart(report);
  html += "</section>";

  html += format(
      "<section><h2>Expert load</h2><p class=\"sub\">Rows (token assignments) each expert "
      "received in each MoE layer over the whole run; every layer receives tokens × top-%lld "
      "rows. Darker is busier.</p>",
      run["top_k"].get<long long>());
  html += heatmap_chart(report);
  html += "</section>";

  html +=
      "<section><h2>Load imbalance over steps</h2><p class=\"sub\">Busiest expert's rows over "
      "the mean rows per expert, per step: the factor by which the slowest expert holds up "
      "its layer. Small decode batches are imbalanced by nature (fewer rows than experts).</p>";
  html += imbalance_chart(report);
  html += "</section>";

  if (!summary["expert_cache"].is_null()) html += expert_cache_section(report);

  // Stage table.
  double max_share = 0.0;
  for (const Json& t : report["totals"]) max_share = std::max(max_share, t["share"].get<double>());
  html +=
      "<section><h2>Stages</h2><table><thead><tr><th>stage</th><th>total</th>"
      "<th>mean per step</th><th>share</th></tr></thead><tbody>";
  for (const Json& t : report["totals"]) {
    if (t["total_ms"].get<double>() <= 0.0 && t["stage"] != "other") continue;
    const std::string name = t["stage"].get<std::string>();
    const double share = t["share"].get<double>();
    html += format(
        "<tr><td><span class=\"swatch\" style=\"background:%s\"></span>%s</td><td>%.3f ms</td>"
        "<td>%s</td><td class=\"bar-cell\"><span class=\"fill\" style=\"width:%.1f%%\"></span>"
        "<span class=\"num\">%.1f%%</span></td></tr>",
        stage_colour(name), name.c_str(), t["total_ms"].get<double>(),
        human_us(t["mean_us_per_step"].get<double>()).c_str(),
        max_share > 0 ? 100.0 * share / max_share : 0.0, 100.0 * share);
  }
  html += "</tbody></table></section>";

  // Layer table: mean time per step of every stage that ran.
  const std::vector<std::string> stage_columns = active_layer_stages(report);
  html +=
      "<section><h2>Layers</h2><p class=\"sub\">Mean time per step of each stage in each "
      "layer.</p><div class=\"scroll\"><table class=\"layers\"><thead><tr><th>layer</th>";
  for (const std::string& name : stage_columns) {
    html += format("<th><span class=\"swatch\" style=\"background:%s\"></span>%s</th>",
                   stage_colour(name), name.c_str());
  }
  html += "<th>total</th></tr></thead><tbody>";
  const double steps = std::max(summary["stage_steps"].get<double>(), 1.0);
  for (const Json& l : report["layers"]) {
    std::string row = format("<tr><td>%lld%s</td>", l["layer"].get<long long>(),
                             l["moe"].get<bool>() ? "" : " (dense)");
    for (const std::string& name : stage_columns) {
      row += "<td>" + human_us(l["stage_ms"][name].get<double>() * 1e3 / steps) + "</td>";
    }
    html +=
        row + "<td><b>" + human_us(l["total_ms"].get<double>() * 1e3 / steps) + "</b></td></tr>";
  }
  html += "</tbody></table></div></section>";

  // Routing table: load skew, reuse and co-selection of the MoE layers.
  html +=
      "<section><h2>Routing</h2><p class=\"sub\">Per MoE layer over the run: the busiest and "
      "idlest expert against the mean, experts never picked, how many steps pass on average "
      "before an expert is picked again (and how often it is picked in the very next step), and "
      "the pairs of experts most often chosen by the same token.</p><div class=\"scroll\">"
      "<table class=\"layers\"><thead><tr><th>layer</th><th>max / mean</th><th>min / mean</th>"
      "<th>unused experts</th><th>reuse distance</th><th>reused next step</th>"
      "<th>top expert pairs</th></tr></thead><tbody>";
  for (const Json& l : report["layers"]) {
    if (!l["moe"].get<bool>() || !l.contains("max_over_mean")) continue;
    std::string row =
        format("<tr><td>%lld</td><td>%.2f×</td><td>%.2f×</td><td>%lld</td>",
               l["layer"].get<long long>(), l["max_over_mean"].get<double>(),
               l["min_over_mean"].get<double>(), l["unused_experts"].get<long long>());
    if (l.contains("mean_reuse_distance")) {
      row += format("<td>%.2f steps</td><td>%.0f%%</td>", l["mean_reuse_distance"].get<double>(),
                    100.0 * l["reuse_within_1_step"].get<double>());
      std::string pairs;
      for (const Json& p : l["top_pairs"]) {
        pairs += format("%s%d+%d <span class=\"muted\">×%lld</span>", pairs.empty() ? "" : ", ",
                        p[0].get<int>(), p[1].get<int>(), p[2].get<long long>());
      }
      row += "<td>" + (pairs.empty() ? std::string("-") : pairs) + "</td>";
    } else {
      row += "<td>-</td><td>-</td><td>-</td>";
    }
    html += row + "</tr>";
  }
  html += "</tbody></table></div></section>";

  html += format(
      "<footer>Written by <code>moeinfer profile</code>. Times from a steady clock on the CPU; "
      "the full per-step, per-layer, per-stage figures are in <code>report.json</code>. "
      "Profiler overhead: %.1f ns per scope when on, %.1f ns when off; %.0f scopes per step."
      "</footer></main></body></html>\n",
      overhead["scope_on_ns"].get<double>(), overhead["scope_off_ns"].get<double>(),
      overhead["scopes_per_step"].get<double>());
  return html;
}

const char* chart_stage_colour(const std::string& stage) { return stage_colour(stage); }
std::string chart_load_ramp(double t) { return ramp(t); }
const char* chart_css() { return kStyle; }

}  // namespace moeinfer::profile
