"""The project's κ MoE layer against the authors' (14c9b04) MoE layer: forward + backward time, as
a ratio project / authors, on the CPU in fp32 on one thread (issue 60, deliverable 6).

    python bench/kappa_moe_layer.py                    # moe8's layer shapes sliced: d 768, 8 experts, 256 tokens
    python bench/kappa_moe_layer.py --hidden 192 --head-dim 64 --rounds 30   # a small, overhead-bound slice
    python bench/kappa_moe_layer.py --old-root /work/wt/old5c   # also the project's layer from another checkout

Both layers are built as their code builds them (tests/support/kappa_moe.py): the project's
from configs/moe8.yaml (KappaMoELayer, KappaRouter, grouped κ experts), the authors' MOELayer from
their base_train.py's build_model_meta; the project's weights copied into theirs. Before timing,
one forward + backward of each on the same input: the output, the input gradient and the router
weight's gradient must agree within 1e-5 of their largest value, or nothing is timed.

Rows, each from a fresh process (the bench re-executes itself):
  malloc default   glibc's allocator as it is
  malloc no-mmap   MALLOC_MMAP_MAX_=0 (and the trim threshold raised): large blocks are reused from
                   the heap instead of mmap'ed and unmapped (page faults) on every step
  compiled         the project's layer with model.compile's treatment (megatron_kappa/model/compile.py:
                   the dispatch eager, the router a compiled graph; fp32 experts stay eager there)
  no-drop, old      with --old-root: the project's layer from this checkout and from that one
                   (megatron_kappa imported from it), both without the capacity drop on either side
                   (capacity_factor null; the authors' capacity the busiest expert's count):
                   older code lacks the authors' capacity rule, and would otherwise compute
                   something else and be refused
Each row times the variants interleaved (megatron_kappa/bench/interleave.py) and prints medians and
ratios against the authors' layer measured in the same process; the default row also profiles one
forward + backward of each layer (torch.profiler): the top ops by self CPU time and what the
elementwise ops cost. Ratios only: no time is asserted. The load average is printed with each row.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NO_MMAP = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2 ** 34)}
# pointwise aten ops (forward and their backward kernels) and the small copies/concats around them
ELEMENTWISE = {"mul", "mul_", "div", "div_", "add", "add_", "sub", "sub_", "rsub", "neg", "tanh", "tanh_", "exp",
               "exp_", "sigmoid", "sigmoid_", "log", "pow", "sqrt", "rsqrt", "square", "clamp", "clamp_min",
               "where", "masked_fill", "masked_fill_", "fill_", "zero_", "copy_", "cat", "stack", "silu",
               "tanh_backward", "sigmoid_backward", "silu_backward", "mul_backward", "to", "_to_copy",
               "ones_like", "zeros_like", "full_like", "lt", "gt", "ge", "le", "eq", "ne", "logical_and",
               "reciprocal", "abs", "sign", "maximum", "minimum", "softplus", "expm1", "log1p"}


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def profile(step) -> dict:
    """One step under torch.profiler (CPU): the top ops by self CPU time, and the elementwise ops'
    call count and share of the step's self CPU time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        step()
        wall = time.perf_counter() - start
    events = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    total = sum(e.self_cpu_time_total for e in prof.key_averages())
    pointwise = [e for e in events if e.key.removeprefix("aten::") in ELEMENTWISE]
    top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]
    return {"aten_calls": sum(e.count for e in events),
            "elementwise_calls": sum(e.count for e in pointwise),
            "elementwise_share": sum(e.self_cpu_time_total for e in pointwise) / max(total, 1),
            "self_cpu_ms": total / 1e3, "wall_ms": wall * 1e3,
            "top": [(e.key, e.count, e.self_cpu_time_total / 1e3) for e in top]}


def child(args) -> dict:
    """One row, in this process: build, check, time (and profile or compile)."""
    if args.old_root:  # the project's code from another checkout; the authors' loader from this one
        import tests.support.authors_loop  # noqa: F401
        sys.path.insert(0, args.old_root)
    import importlib.util

    import torch
    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location("kappa_moe_bench", ROOT / "tests/support/kappa_moe.py")
    km = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(km)
    from megatron_kappa.bench.interleave import time_interleaved
    shape = (args.hidden, args.head_dim, args.experts, args.seq)
    project = km.build_project(*shape, root=Path(args.old_root or ROOT), drop=not args.no_drop)
    authors = km.build_authors(*shape, drop=not args.no_drop)
    km.randomize(project)
    km.copy_weights(project, authors)
    x, g = km.inputs(args.batch, args.seq, args.hidden)
    if args.no_drop:
        km.fit_capacity(project, authors, x)
    out = {"row": args.row, "load_before": load_average(), "shape": dict(zip(("d", "head", "E", "seq"), shape)),
           "tokens": args.batch * args.seq, "code": sys.modules[type(project).__module__].__file__,
           "diff": km.differences(project, authors, x, g)}
    aux, z = km.loss_weights(project)
    steps = {"project": lambda: km.step_project(project, x, g),
             "authors": lambda: km.step_authors(authors, x, g, aux, z)}
    if args.row == "compiled":
        compiled = km.build_project(*shape)
        compiled.load_state_dict(project.state_dict())
        compile_router(compiled)
        out["diff_compiled"] = km.differences(compiled, authors, x, g)  # also the compile's first pass
        steps["compiled"] = lambda: km.step_project(compiled, x, g)
    agrees = all(d <= km.TOLERANCE for key, diffs in out.items() if key.startswith("diff") for d in diffs.values())
    if not agrees:
        out["refused"] = f"the layers differ beyond {km.TOLERANCE:g}: not timed"
        return out
    for _ in range(args.warmup):
        for step in steps.values():
            step()
    for m in (project, authors):
        m.zero_grad(set_to_none=True)
    ms = time_interleaved(steps, args.rounds, torch.device("cpu"))
    out.update(ms=ms, ratio={k: ms[k] / ms["authors"] for k in ms if k != "authors"}, load_after=load_average())
    if args.row == "compiled":
        out["ratio"]["compiled/project"] = ms["compiled"] / ms["project"]
    if args.profile:
        out["profile"] = {name: profile(step) for name, step in steps.items()}
    return out


def compile_router(layer):
    """model.compile's treatment of one MoE layer (megatron_kappa/model/compile.py): the layer's
    forward (the dispatch) eager at its named boundary, the router compiled; fp32 grouped experts
    do not trace (torch._grouped_mm takes bf16/fp16 only) and stay eager."""
    from megatron_kappa.model import compile as model_compile
    model_compile.prepare()
    model_compile.compile_moe_layer(layer)


def run_row(args, row: str, env: dict, extra: list[str]) -> dict:
    # run as a module from the repository root, so that the child finds tests/support (the authors'
    # vendored code and its loader live there, not in the installed package)
    cmd = [sys.executable, "-m", "bench.kappa_moe_layer", "--child", row, *extra,
           *(f"--{k.replace('_', '-')}={getattr(args, k)}" for k in ("hidden", "head_dim", "experts", "seq",
                                                                      "batch", "rounds", "warmup"))]
    env = {**os.environ, **env}
    if row == "compiled":  # this row compiles, whatever the shell says
        env.pop("TORCHDYNAMO_DISABLE", None)
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        return {"row": row, "error": (done.stderr.strip().splitlines() or ["no output"])[-1]}
    return json.loads(lines[-1])


def show(res: dict):
    print(f"\n== {res['row']}  (load average {res.get('load_before')} before, {res.get('load_after')} after)")
    if "error" in res:
        print(f"   failed: {res['error']}")
        return
    print(f"   project's layer from {res['code']}")
    for key in [k for k in res if k.startswith("diff")]:
        print(f"   {key} (relative max |Δ| vs the authors'): " + ", ".join(f"{k} {v:.1e}" for k, v in res[key].items()))
    if "refused" in res:
        print(f"   {res['refused']}")
        return
    print("   median ms: " + ", ".join(f"{k} {v:.1f}" for k, v in res["ms"].items()))
    print("   ratios:    " + ", ".join(f"{k}{'' if '/' in k else '/authors'} {v:.3f}" for k, v in res["ratio"].items()))
    for name, p in res.get("profile", {}).items():
        print(f"   profile {name}: {p['aten_calls']} aten calls, {p['elementwise_calls']} elementwise "
              f"({100 * p['elementwise_share']:.0f} % of {p['self_cpu_ms']:.1f} ms self CPU in ops; "
              f"{p['wall_ms']:.1f} ms wall under the profiler)")
        for key, count, self_ms in p["top"]:
            print(f"      {key:<40} {count:>5} calls {self_ms:8.2f} ms")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rows", default="default,no-mmap,compiled", help="which rows (comma-separated)")
    parser.add_argument("--old-root", default=None, help="also time the project's layer from this checkout")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-drop", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        args.row = args.child
        print(json.dumps(child(args)))
        return
    print(f"κ MoE layer, project vs authors (14c9b04), fp32, CPU, 1 thread: d {args.hidden}, {args.experts} experts "
          f"top-2, {args.batch}×{args.seq} tokens, {args.rounds} interleaved rounds")
    rows = {"default": ({}, ["--profile"]), "no-mmap": (NO_MMAP, []), "compiled": ({}, []),
            "no-drop": ({}, ["--no-drop"])}
    results = []
    for row in args.rows.split(","):
        results.append(run_row(args, row, *rows[row]))
        show(results[-1])
    if args.old_root:  # without the capacity drop on both sides: older code lacks the authors' rule
        for row, extra in (("no-drop", []), ("old", [f"--old-root={args.old_root}"])):
            results.append(run_row(args, row, {}, ["--no-drop", *extra]))
            show(results[-1])
    return results


if __name__ == "__main__":
    main()
