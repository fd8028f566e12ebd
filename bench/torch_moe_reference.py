#!/usr/bin/env python3
"""Our whole MoE layer against a PyTorch MoE layer built on torch._grouped_mm, same run.

The question (from the issue): is moeinfer's MoE layer alone faster than a PyTorch reference
layer at every token count from 1 to 8192, and at least 1.5x faster at 64 tokens and below?

Shape: the Qwen3-30B-A3B MoE layer (H 2048, E 128, K 8, I 768), softmax top-k with the K
weights renormalised (norm_topk_prob), bf16 weights and activations, float32 router logits, no
shared experts. Weights are laid out as the moeinfer kernels want them and torch reads the same
layout without a copy: gate_up [E, 2I, H] (gate rows first, then up), down [E, H, I], router
[E, H].

The PyTorch layer (torch_moe_layer below), eager ops only:
  logits  = mm(x, Wr^T) with a float32 output (torch.mm out_dtype; if this torch lacks it,
            bf16 then .float(), and the header line says so)
  softmax, topk, renormalise the K weights
  sort the T*K (token, expert) pairs by expert (one stable torch.sort gives the order and the
  sorted ids), offs = searchsorted(sorted ids, 1..E) as int32: the cumulative row count at the
  end of each expert, which is the cumsum of the per-expert counts without a separate histogram
  gather the rows (index_select), torch._grouped_mm(rows, gate_up.transpose(-2, -1), offs=offs)
  SiLU(gate) * up, torch._grouped_mm(act, down.transpose(-2, -1), offs=offs)
  multiply by the routing weights in float32, index_add_ back to [T, H] in float32, round to bf16
torch._grouped_mm(mat_a [M, K], mat_b [G, K, N], offs int32 [G]) -> [M, N] (torch 2.8-2.11
schema: _grouped_mm(self, mat2, offs=None, bias=None, out_dtype=None)); mat_b may be row- or
column-major in its last two dims with 16-byte aligned strides, so w.transpose(-2, -1) of our
[E, N, K] tensor is a view (column-major, K-major B as in nn.Linear). On SM90/SM100 with bf16 it
runs the CUTLASS grouped GEMM that reads offs on the device (no host sync); elsewhere torch
falls back to a per-expert loop that syncs, and graph capture then fails (reported below).

Timing, the same method as bench/bench_cuda_moe_layer.cpp: random inputs (x ~ N(0, 1); Wr,
gate_up ~ N(0, 1/H); down ~ N(0, 1/I): an untrained, near-uniform router, the same distribution
as the C++ bench), three copies of the weights rotated over successive layer calls so decode
sizes do not find their experts in L2, 20 layer calls captured in one torch.cuda.CUDAGraph, the
median of 10 replays (after 2 warm-ups) over 20. If capture fails for a T, that T is timed eager
with CUDA events over the same 20 calls and marked "eager" in the table. The eager time (CPU
launch overhead included) is printed beside for reference; the criteria use the graph time, the
faster of the two.

Checks, before any timing:
  1. the PyTorch layer against a loop over experts in float32 (its own routing from float32
     logits) at T = 37, printing the max error;
  2. unless --no-cross-check: the moeinfer binary dumps one layer call at T = 37 (inputs,
     weights, routing, output); the PyTorch layer and the loop reference recompute it from the
     same tensors, and the routing and outputs are compared. This is what makes the ratio a
     comparison of the same function.
Tolerance: bf16 outputs within 1e-2 of the float32 reference, relative to its largest value.

Usage (on the GPU machine, after building bench_cuda_moe_layer):
  python3 bench/torch_moe_reference.py --moeinfer-bench build/bench/bench_cuda_moe_layer \
      [--json FILE] [--tokens 1,2,4,...] [--quick] [--no-cross-check]
Exit status: 1 when a check or the moeinfer binary fails; the speed criteria only print.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F

H, I, E, K = 2048, 768, 128, 8
TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
WEIGHT_SETS = 3
CALLS_PER_GRAPH = 20
WARMUP_REPLAYS = 2
CHECK_TOKENS = 37
BF16_TOLERANCE = 1e-2


# ---------------------------------------------------------------------------------------------
# The layer


def _logits_f32_out(x, wr):
    return torch.mm(x, wr.t(), out_dtype=torch.float32)


def _logits_bf16_then_float(x, wr):
    return torch.mm(x, wr.t()).float()


def pick_router_mm(device):
    """torch.mm with out_dtype=float32 where this torch has it (bf16 GEMM, f32 output, as the
    moeinfer router GEMM); otherwise bf16 logits converted to float32 (as transformers does)."""
    try:
        a = torch.randn(4, 64, device=device, dtype=torch.bfloat16)
        b = torch.randn(8, 64, device=device, dtype=torch.bfloat16)
        out = _logits_f32_out(a, b)
        if out.dtype == torch.float32:
            return _logits_f32_out, "mm(bf16, bf16, out_dtype=float32)"
    except (TypeError, RuntimeError):
        pass
    return _logits_bf16_then_float, "mm(bf16, bf16) -> bf16, then .float()"


ROUTER_MM = _logits_bf16_then_float


def torch_moe_layer(x, wr, w_gate_up, w_down, expert_ends):
    """x [T, H] bf16, wr [E, H], w_gate_up [E, 2I, H], w_down [E, H, I] bf16,
    expert_ends = arange(1, E + 1) int64. Returns [T, H] bf16."""
    T = x.shape[0]
    logits = ROUTER_MM(x, wr)  # [T, E] float32
    probs = torch.softmax(logits, dim=-1)
    topk_w, topk_ids = torch.topk(probs, K, dim=-1)  # [T, K], best first
    topk_w = topk_w / topk_w.sum(dim=-1, keepdim=True)
    flat_ids = topk_ids.reshape(-1)  # [T*K] expert of assignment t*K + k
    sorted_ids, order = torch.sort(flat_ids, stable=True)  # order: assignment at each sorted row
    offs = torch.searchsorted(sorted_ids, expert_ends, out_int32=True)  # [E] end row per expert
    token = order // K  # [T*K] token of each sorted row
    rows = x.index_select(0, token)  # [T*K, H] expert order
    gate_up = torch._grouped_mm(rows, w_gate_up.transpose(-2, -1), offs=offs)  # [T*K, 2I]
    act = F.silu(gate_up[:, :I]) * gate_up[:, I:]  # [T*K, I]
    down = torch._grouped_mm(act, w_down.transpose(-2, -1), offs=offs)  # [T*K, H]
    weighted = down.float() * topk_w.reshape(-1)[order].unsqueeze(1)  # [T*K, H] float32
    out = torch.zeros(T, H, device=x.device, dtype=torch.float32)
    out.index_add_(0, token, weighted)
    return out.to(torch.bfloat16)


def reference_routing(x, wr, logits_fn=None):
    """softmax, top-k, renormalise of logits_fn(x, wr), by default float32 logits from the
    float32 upcasts: ([T, K] ids, [T, K] weights, [T, E] probs)."""
    logits = logits_fn(x, wr) if logits_fn else x.float() @ wr.float().t()
    probs = torch.softmax(logits, dim=-1)
    w, ids = torch.topk(probs, K, dim=-1)
    return ids, w / w.sum(dim=-1, keepdim=True), probs


def loop_reference(x, w_gate_up, w_down, ids, weights):
    """The layer as a loop over experts, all in float32 from the bf16 tensors. [T, H] float32."""
    out = torch.zeros(x.shape[0], H, device=x.device, dtype=torch.float32)
    for e in range(E):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        h = x[tok].float()
        gu = h @ w_gate_up[e].float().t()
        a = F.silu(gu[:, :I]) * gu[:, I:]
        y = a @ w_down[e].float().t()
        out.index_add_(0, tok, y * weights[tok, slot].unsqueeze(1))
    return out


# ---------------------------------------------------------------------------------------------
# Checks


def same_expert_sets(ids_a, ids_b):
    """[T] bool: token t routes to the same set of K experts in both."""
    return (ids_a.sort(dim=-1).values == ids_b.sort(dim=-1).values).all(dim=-1)


def relative_error(out, ref, rows):
    """Max |out - ref| over the given rows, and that over max |ref| (0 rows -> 0, 0)."""
    if rows.sum() == 0:
        return 0.0, 0.0
    diff = (out.float()[rows] - ref[rows]).abs().max().item()
    scale = ref[rows].abs().max().item()
    return diff, diff / max(scale, 1e-30)


def report_routing_mismatch(name, agree, probs):
    """Prints the tokens whose expert sets differ and the gap between their K-th and (K+1)-th
    reference scores: a gap at float32 rounding level is a near-tie, not a bug. Returns True
    when every disagreement is such a near-tie."""
    bad = (~agree).nonzero().flatten().tolist()
    if not bad:
        return True
    top = torch.topk(probs[bad], K + 1, dim=-1).values
    gaps = (top[:, K - 1] - top[:, K]).tolist()
    print(f"  {name}: {len(bad)} token(s) route to other experts than the float32 reference: "
          + ", ".join(f"t={t} (K-th vs next score gap {g:.2e})" for t, g in zip(bad, gaps)))
    return all(g < 1e-5 for g in gaps)


def check_torch_layer(weights, device):
    """The torch layer against the loop over experts at T = CHECK_TOKENS, fresh inputs."""
    wr, w_gate_up, w_down = weights[0]
    x = torch.randn(CHECK_TOKENS, H, device=device, dtype=torch.bfloat16)
    ends = torch.arange(1, E + 1, device=device)
    out = torch_moe_layer(x, wr, w_gate_up, w_down, ends)
    # The reference routes from the torch layer's own logits (this check is about the sort,
    # gather, grouped GEMMs and combine; check 2 compares routings), then runs in float32.
    ids, w, _ = reference_routing(x, wr, ROUTER_MM)
    ref = loop_reference(x, w_gate_up, w_down, ids, w)
    diff, rel = relative_error(out, ref, torch.ones(CHECK_TOKENS, dtype=torch.bool,
                                                    device=device))
    ok = rel <= BF16_TOLERANCE and torch.isfinite(out).all().item()
    print(f"check 1: torch._grouped_mm layer vs float32 loop over experts, T={CHECK_TOKENS}: "
          f"max abs error {diff:.3e}, relative to max |ref| {rel:.3e} "
          f"(tolerance {BF16_TOLERANCE:g}) -> {'ok' if ok else 'FAILED'}")
    return ok


def load_raw(path, dtype, shape, device):
    with open(path, "rb") as f:
        data = bytearray(f.read())
    if dtype == torch.bfloat16:
        t = torch.frombuffer(data, dtype=torch.int16).view(torch.bfloat16)
    else:
        t = torch.frombuffer(data, dtype=dtype)
    return t.reshape(shape).to(device)


def cross_check(dump_dir, device):
    """moeinfer's dumped layer call against the torch layer and the loop reference."""
    with open(os.path.join(dump_dir, "meta.json")) as f:
        meta = json.load(f)
    assert (meta["H"], meta["I"], meta["E"], meta["K"]) == (H, I, E, K), meta
    T = meta["T"]
    p = lambda name: os.path.join(dump_dir, name + ".bin")
    x = load_raw(p("x"), torch.bfloat16, (T, H), device)
    wr = load_raw(p("router"), torch.bfloat16, (E, H), device)
    w_gate_up = load_raw(p("gate_up"), torch.bfloat16, (E, 2 * I, H), device)
    w_down = load_raw(p("down"), torch.bfloat16, (E, H, I), device)
    m_ids = load_raw(p("topk_ids"), torch.int32, (T, K), device).long()
    m_w = load_raw(p("topk_weights"), torch.float32, (T, K), device)
    m_out = load_raw(p("out"), torch.float32, (T, H), device)  # the block output is float32

    ids, w, probs = reference_routing(x, wr)
    ref = loop_reference(x, w_gate_up, w_down, ids, w)
    agree = same_expert_sets(m_ids, ids)
    ties_only = report_routing_mismatch("moeinfer", agree, probs)
    # Routing weights of the agreeing tokens, matched by expert id.
    m_sorted = m_ids.sort(dim=-1)
    r_sorted = ids.sort(dim=-1)
    w_diff = 0.0
    if agree.any():
        w_diff = (m_w.gather(1, m_sorted.indices) - w.gather(1, r_sorted.indices))[agree]
        w_diff = w_diff.abs().max().item()
    m_diff, m_rel = relative_error(m_out, ref, agree)
    t_out = torch_moe_layer(x, wr, w_gate_up, w_down, torch.arange(1, E + 1, device=device))
    # The torch layer's routing (its logits may be bf16 where torch.mm lacks out_dtype).
    t_ids = reference_routing(x, wr, ROUTER_MM)[0]
    both = agree & same_expert_sets(t_ids, ids)
    t_diff, t_rel = relative_error(t_out, ref, both)
    mt_diff, mt_rel = relative_error(m_out, t_out.float(), both)
    finite = torch.isfinite(m_out).all().item()
    ok = ties_only and finite and m_rel <= BF16_TOLERANCE and w_diff <= 1e-5
    print(f"check 2: the same layer call (T={T}, moeinfer's inputs and weights):")
    print(f"  routing: {int(agree.sum())}/{T} tokens pick the same experts as the float32 "
          f"reference (torch layer: {int(same_expert_sets(t_ids, ids).sum())}/{T}); "
          f"moeinfer's routing weights max abs difference {w_diff:.2e}")
    print(f"  moeinfer vs float32 loop reference: max abs error {m_diff:.3e}, relative {m_rel:.3e}"
          f"{'' if finite else ' (NaN/inf in the output)'}")
    print(f"  torch    vs float32 loop reference: max abs error {t_diff:.3e}, relative {t_rel:.3e}"
          f" ({int(both.sum())} tokens both route as the reference)")
    print(f"  moeinfer vs torch:                  max abs error {mt_diff:.3e}, relative {mt_rel:.3e}"
          f"  -> {'ok' if ok else 'FAILED'}")
    return ok


# ---------------------------------------------------------------------------------------------
# Timing


def make_weights(device, gen):
    sets = []
    for _ in range(WEIGHT_SETS):
        wr = (torch.randn(E, H, device=device, generator=gen) * H ** -0.5).to(torch.bfloat16)
        w_gate_up = torch.empty(E, 2 * I, H, device=device, dtype=torch.bfloat16)
        w_down = torch.empty(E, H, I, device=device, dtype=torch.bfloat16)
        for e in range(E):  # per expert, so no float32 copy of the whole tensor is made
            w_gate_up[e] = torch.randn(2 * I, H, device=device, generator=gen) * H ** -0.5
            w_down[e] = torch.randn(H, I, device=device, generator=gen) * I ** -0.5
        sets.append((wr, w_gate_up, w_down))
    return sets


def time_events(fn, replays):
    """Median ms per call of fn(i) over CALLS_PER_GRAPH calls between two events."""
    start = torch.cuda.Event(enable_timing=True)
    stop = torch.cuda.Event(enable_timing=True)
    times = []
    for r in range(WARMUP_REPLAYS + replays):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        if r >= WARMUP_REPLAYS:
            times.append(start.elapsed_time(stop) / CALLS_PER_GRAPH)
    return statistics.median(times)


def time_torch(T, x_all, weights, expert_ends, replays):
    """(graph ms or None, eager ms, capture error or None) for one layer call at T tokens."""
    x = x_all[:T]

    def calls():
        for i in range(CALLS_PER_GRAPH):
            wr, w_gate_up, w_down = weights[i % WEIGHT_SETS]
            torch_moe_layer(x, wr, w_gate_up, w_down, expert_ends)

    # Eager, on a side stream as capture wants its warm-up; this also warms cuBLAS and CUTLASS.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        eager_ms = time_events(calls, replays)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    graph_ms, error = None, None
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            calls()
        graph_ms = time_events(graph.replay, replays)
    except Exception as e:  # capture refused (a host sync inside some op): eager stands in
        error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    del graph
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return graph_ms, eager_ms, error


# ---------------------------------------------------------------------------------------------
# Driver


def run_moeinfer(binary, tokens, quick, json_path, dump_dir):
    cmd = [binary, "--tokens", ",".join(str(t) for t in tokens), "--json", json_path]
    if quick:
        cmd.append("--quick")
    if dump_dir:
        cmd += ["--dump", dump_dir, "--dump-tokens", str(CHECK_TOKENS)]
    print("running:", " ".join(cmd), flush=True)
    rc = subprocess.run(cmd).returncode
    if rc != 0:
        print(f"moeinfer bench exited with {rc}", file=sys.stderr)
        return None
    with open(json_path) as f:
        return {int(t): us for t, us in json.load(f).items()}


def main():
    global ROUTER_MM
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--moeinfer-bench", help="path of build/bench/bench_cuda_moe_layer; without "
                    "it only the PyTorch layer is checked and timed")
    ap.add_argument("--tokens", default=",".join(str(t) for t in TOKENS),
                    help="comma-separated token counts (default 1..8192, powers of two)")
    ap.add_argument("--quick", action="store_true", help="3 timed replays instead of 10")
    ap.add_argument("--no-cross-check", action="store_true",
                    help="skip the moeinfer dump and the same-inputs comparison")
    ap.add_argument("--json", help="write the table and the criteria here")
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    replays = 3 if args.quick else 10

    if not torch.cuda.is_available():
        sys.exit("torch_moe_reference: no CUDA device visible to torch")
    if not hasattr(torch, "_grouped_mm"):
        sys.exit(f"torch_moe_reference: torch {torch.__version__} has no torch._grouped_mm")
    device = torch.device("cuda", 0)

    ok = True
    moeinfer_us = None
    tmp = tempfile.mkdtemp(prefix="moe_layer_bench_")
    try:
        # moeinfer first, before this process holds several GB of weights and graph pools.
        if args.moeinfer_bench:
            dump_dir = None if args.no_cross_check else os.path.join(tmp, "dump")
            if dump_dir:
                os.makedirs(dump_dir)
            moeinfer_us = run_moeinfer(args.moeinfer_bench, tokens, args.quick,
                                       os.path.join(tmp, "moeinfer.json"), dump_dir)
            if moeinfer_us is None:
                ok = False
        print(flush=True)

        ROUTER_MM, router_desc = pick_router_mm(device)
        prop = torch.cuda.get_device_properties(device)
        print(f"torch {torch.__version__} (CUDA {torch.version.cuda}) on {prop.name}; "
              f"router logits: {router_desc}")
        print(f"PyTorch MoE layer: H {H}, I {I}, E {E}, K {K}; {WEIGHT_SETS} weight copies "
              f"rotated, {CALLS_PER_GRAPH} layers per CUDA graph, median of {replays} replays")

        if moeinfer_us is not None and not args.no_cross_check:
            ok &= cross_check(os.path.join(tmp, "dump"), device)
        shutil.rmtree(os.path.join(tmp, "dump"), ignore_errors=True)

        gen = torch.Generator(device=device)
        gen.manual_seed(20240611)
        weights = make_weights(device, gen)
        ok &= check_torch_layer(weights, device)
        expert_ends = torch.arange(1, E + 1, device=device)
        x_all = torch.randn(max(tokens), H, device=device, generator=gen).to(torch.bfloat16)

        print()
        header = f"{'T':>6} {'torch us':>10} {'mode':>6} {'eager us':>10}"
        if moeinfer_us is not None:
            header += f" {'moeinfer us':>12} {'speed-up':>9}"
        print(header, flush=True)
        rows = []
        for T in tokens:
            graph_ms, eager_ms, error = time_torch(T, x_all, weights, expert_ends, replays)
            torch_us = (graph_ms if graph_ms is not None else eager_ms) * 1e3
            mode = "graph" if graph_ms is not None else "eager"
            row = {"T": T, "torch_us": torch_us, "torch_mode": mode, "torch_eager_us": eager_ms * 1e3}
            line = f"{T:>6} {torch_us:>10.1f} {mode:>6} {eager_ms * 1e3:>10.1f}"
            if moeinfer_us is not None and T in moeinfer_us:
                row["moeinfer_us"] = moeinfer_us[T]
                row["speedup"] = torch_us / moeinfer_us[T]
                line += f" {moeinfer_us[T]:>12.1f} {row['speedup']:>8.2f}x"
            if error:
                line += f"   (graph capture failed: {error})"
                row["capture_error"] = error
            print(line, flush=True)
            rows.append(row)

        criteria = {}
        if moeinfer_us is not None:
            timed = [r for r in rows if "speedup" in r]
            small = [r for r in timed if r["T"] <= 64]
            full = set(TOKENS) <= {r["T"] for r in timed}
            criteria["faster_at_every_T"] = bool(timed) and all(r["speedup"] > 1.0 for r in timed)
            criteria["at_least_1.5x_at_T_le_64"] = bool(small) and all(
                r["speedup"] >= 1.5 for r in small)
            worst = min(timed, key=lambda r: r["speedup"]) if timed else None
            worst_small = min(small, key=lambda r: r["speedup"]) if small else None
            scope = "" if full else " (only the token counts measured here, not all of 1..8192)"
            print()
            print(f"criterion 1, faster at every T{scope}: "
                  f"{'PASS' if criteria['faster_at_every_T'] else 'FAIL'}"
                  + (f" (lowest {worst['speedup']:.2f}x at T={worst['T']})" if worst else ""))
            print(f"criterion 2, >= 1.5x at T <= 64{scope}: "
                  f"{'PASS' if criteria['at_least_1.5x_at_T_le_64'] else 'FAIL'}"
                  + (f" (lowest {worst_small['speedup']:.2f}x at T={worst_small['T']})"
                     if worst_small else ""))
        print(f"checks: {'ok' if ok else 'FAILED'}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": prop.name, "torch": torch.__version__,
                           "router_logits": router_desc, "checks_ok": bool(ok), "rows": rows,
                           "criteria": criteria}, f, indent=1)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
