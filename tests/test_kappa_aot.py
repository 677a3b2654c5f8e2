"""Every κ Triton kernel variant the launch code can produce compiles for sm_80 and sm_90 without a
GPU, and none spills registers in bf16.

The variants come from megatron_kappa.kappa.triton_op.launch_variants() (the op's own forward and
backward on meta tensors, launches recorded), so the list follows the code. Each is compiled with
`triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))` in a child process with
TRITON_INTERPRET=0 (conftest interprets in this one); ptxas's -v log (knobs.nvidia.dump_ptxas_log)
gives registers and spill bytes. Negative control: a kernel with a type error and one whose tile
cannot fit in registers are reported as failures by the same checker.
Slow: about 300 compiles, one process per arch side by side (2–3 minutes on two CPU cores).
"""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import triton
import triton.language as tl

ARCHS = (80, 90)
REPO = Path(__file__).resolve().parents[1]


@triton.jit
def _type_error(x_ptr, BLOCK: tl.constexpr):
    """Does not compile: tl.arange needs a power-of-2 range."""
    offs = tl.arange(0, BLOCK - 1)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs) * 2)


@triton.jit
def _spills(x_ptr, y_ptr, BLOCK: tl.constexpr):
    """Compiles, but keeps BLOCK / 32 values per thread live across a reduction: spills for 16384."""
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs).to(tl.float32)
    y = x * tl.sum(x * x, axis=0) + tl.cumsum(x, 0)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty))


def project_variants():
    """Every variant at the default tiles (all I/O dtypes), plus, for the heaviest flags in bf16,
    the extreme tiles check_tiles allows and an F that is not a multiple of 16 (unaligned)."""
    import torch

    from megatron_kappa.kappa import triton_op as K
    def heaviest(v):
        return all(v["constexprs"].get(k, True) for k in (
"HAS_A", "HAS_B", "GROUPED", "BACKWARD", "NEED_DLOGIT", "NEED_DA", "NEED_DB"))
    most = K.MAX_TILE_PER_THREAD * 32 * K.NUM_WARPS
    extreme = ((1, K.MAX_BLOCK_F), (K.MAX_BLOCK_N, most // K.MAX_BLOCK_N))
    extra = [v for v in K.launch_variants((torch.bfloat16,), extreme) + K.launch_variants(
        (torch.bfloat16,), f=K.BLOCK_F + 1) if heaviest(v)]
    return K.launch_variants() + extra


def broken_variants():
    return [dict(kernel=_type_error, signature={"x_ptr": "*bf16", "BLOCK": "constexpr"},
                 constexprs={"BLOCK": 64}, attrs={}, num_warps=4),
            dict(kernel=_spills, signature={"x_ptr": "*bf16", "y_ptr": "*bf16", "BLOCK": "constexpr"},
                 constexprs={"BLOCK": 16384}, attrs={}, num_warps=1)]


def compile_all(which: str, archs):
    """Child process: compile each variant for each arch, one `RESULT {json}` line per compile."""
    import contextlib
    import io
    import re

    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    assert os.environ.get("TRITON_INTERPRET") == "0", "the kernels must be real JIT functions here"
    knobs.nvidia.dump_ptxas_log = True  # ptxas -v: registers and spills, printed per compile
    knobs.compilation.always_compile = True  # no cache hit may skip ptxas (and its log)
    variants = project_variants() if which == "project" else broken_variants()
    for arch in archs:
        for v in variants:
            flags = " ".join(f"{k}={int(x) if isinstance(x, bool) else x}" for k, x in v["constexprs"].items())
            ptrs = ",".join(sorted({t for t in v["signature"].values() if t.startswith("*")}))
            label = f"sm_{arch} {v['kernel'].__name__} {flags} ptrs={ptrs} aligned_args={len(v['attrs'])}"
            result = dict(label=label, bf16="*bf16" in ptrs, error=None, regs=None, spill=None)
            log = io.StringIO()
            try:
                with contextlib.redirect_stdout(log):
                    compiled = triton.compile(
                        ASTSource(fn=v["kernel"], signature=v["signature"], constexprs=v["constexprs"],
                                  attrs=v["attrs"]),
                        target=GPUTarget("cuda", arch, 32),
                        options={"num_warps": v["num_warps"],
                                 **({"maxnreg": v["maxnreg"]} if v.get("maxnreg") else {})})
                if not compiled.asm.get("cubin"):
                    result["error"] = "no cubin"
            except Exception as err:  # reported, the parent fails the test
                result["error"] = f"{type(err).__name__}: {str(err)[-500:]}"
            regs = re.search(r"Used (\d+) registers", log.getvalue())
            spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log.getvalue())
            if regs and spill:
                result["regs"], result["spill"] = int(regs.group(1)), int(spill.group(1)) + int(spill.group(2))
            elif result["error"] is None:
                result["error"] = "no ptxas -v log to read registers and spills from"
            print("RESULT " + json.dumps(result), flush=True)


def run_checker(which: str, archs=ARCHS) -> list[dict]:
    """Compile in one child process per arch, side by side (the compiles are single-threaded)."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TRITON_INTERPRET": "0",
               "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        children = []
        for arch in archs:
            code = f"import test_kappa_aot as t; t.compile_all({which!r}, ({arch},))"
            children.append(subprocess.Popen(
                [sys.executable, "-c", code], cwd=Path(__file__).parent, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, text=True, env={**env, "TRITON_CACHE_DIR": f"{cache}/sm_{arch}"}))
        outputs = []
        for child in children:
            out, err = child.communicate(timeout=3600)
            assert child.returncode == 0, err[-3000:]
            outputs.append(out)
    return [json.loads(line[len("RESULT "):]) for out in outputs for line in out.splitlines()
            if line.startswith("RESULT ")]


def failures(results) -> list[str]:
    """A compile error anywhere, or spilled registers in a bf16 variant."""
    bad = []
    for r in results:
        if r["error"]:
            bad.append(f"{r['label']}: {r['error']}")
        elif r["bf16"] and r["spill"]:
            bad.append(f"{r['label']}: {r['spill']} bytes spilled")
    return bad


@pytest.mark.slow
def test_every_kernel_variant_compiles_without_spills():
    from megatron_kappa.kappa import triton_op as K
    results = run_checker("project")
    expected = len(project_variants()) * len(ARCHS)
    assert len(results) == expected, f"{len(results)} of {expected} variants reported"
    bad = failures(results)
    assert not bad, "\n".join(bad)
    kernels = {r["label"].split()[1] for r in results}
    assert kernels == {"_kappa_swiglu_kernel", "_reduce_param_grads_kernel"}
    assert len(K.launch_variants()) >= 4 * 2 * 2 * 3  # α/b ablations × grouping × fwd/bwd × dtypes


@pytest.mark.slow
def test_checker_reports_broken_kernels():
    """Negative control: the checker fails a kernel that does not compile and one that spills."""
    results = run_checker("broken", archs=(90,))
    assert [r["label"].split()[1] for r in results] == ["_type_error", "_spills"]
    bad = failures(results)
    assert len(bad) == 2 and results[0]["error"] and results[1]["spill"] > 0, bad


def test_launch_variants_follow_the_launch_code():
    """Fast, in this process: the variant list has every flag combination the backward can ask
    for, and changes when the launch code does (a flag forced in _launch shows up in the list)."""
    import torch

    from megatron_kappa.kappa import triton_op as K
    variants = K.launch_variants(dtypes=(torch.float32,))
    main = [v["constexprs"] for v in variants if v["kernel"].__name__ == "_kappa_swiglu_kernel"]
    # forward: 4 α/b ablations × 2 groupings; backward: the (d_logit, d_α, d_b) subsets that exist
    # (8 with α and b, 4 with α only, 2 with b only, 1 with neither) × 2 groupings
    assert len(main) == 2 * (4 + 8 + 4 + 2 + 1)
    assert all(c["BLOCK_N"] == K.BLOCK_N and c["BLOCK_F"] == K.BLOCK_F for c in main)
    assert not any(c["NEED_DA"] and not c["HAS_A"] or c["NEED_DB"] and not c["HAS_B"] for c in main)
    reduce = [v for v in variants if v["kernel"].__name__ == "_reduce_param_grads_kernel"]
    assert {(c["constexprs"]["GROUPED"], c["constexprs"]["NEED_DA"], c["constexprs"]["NEED_DB"]) for c in reduce} \
        == {(g, a, b) for g in (False, True) for a in (False, True) for b in (False, True) if a or b}
    original = K._needs
    try:  # negative control: a launch code that never asks for d_logit gives a different list
        K._needs = lambda need, has_a, has_b: (False,) + tuple(original(need, has_a, has_b)[1:])
        assert not any(v["constexprs"].get("NEED_DLOGIT") for v in K.launch_variants(dtypes=(torch.float32,)))
    finally:
        K._needs = original
