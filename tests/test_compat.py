"""The CPU compat patches: every library symbol they replace still exists upstream, and they
apply on the CPU only."""
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_kappa.parallel import compat

ROOT = Path(__file__).resolve().parents[1]


def missing_in_fresh_process(extra_entries=(), extra_cuda=()) -> list[str]:
    """compat.missing_symbols() in a new interpreter, where no test has applied the patches yet
    (after `apply` every patched name exists, so checking in this process could not fail)."""
    code = ("import json, sys; from megatron_kappa.parallel import compat; "
            "e, c = json.loads(sys.argv[1]); "
            "print(json.dumps(compat.missing_symbols(compat.PATCHED + [tuple(x) for x in e], "
            "compat.CUDA_SHIMMED + c)))")
    done = subprocess.run([sys.executable, "-c", code, json.dumps([list(extra_entries), list(extra_cuda)])],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


BOGUS = ("megatron.core.transformer.utils", "no_such_function")


@pytest.fixture(scope="module")
def missing():
    return missing_in_fresh_process([BOGUS], ["no_such_cuda_call"])


@pytest.mark.parametrize("module,attr", compat.PATCHED)
def test_patched_symbol_exists_upstream(missing, module, attr):
    assert f"{module}.{attr}" not in missing, f"{module}.{attr} is gone: review megatron_kappa/parallel/compat.py"


@pytest.mark.parametrize("name", compat.CUDA_SHIMMED)
def test_shimmed_cuda_entry_point_exists(missing, name):
    assert f"torch.cuda.{name}" not in missing


def test_negative_control_missing_names_are_reported(missing):
    assert missing == [".".join(BOGUS), "torch.cuda.no_such_cuda_call"]


def test_apply_patches_on_cpu_only(world1):
    # world1 runs init_distributed on the CPU, which applies the patches (in whatever test order).
    assert compat.applied()
    assert not compat.apply("cuda") or compat.applied()  # on "cuda" apply() never patches anything new
    mappings = importlib.import_module("megatron.core.tensor_parallel.mappings")
    assert mappings._gather_along_first_dim.__name__ == "gather"
    assert importlib.import_module("megatron.core.transformer.utils").get_default_causal_mask(3).device.type == "cpu"
    # megatron's jit_fuser functions run eager on CPU (model.compile), with no global Dynamo switch
    assert not hasattr(importlib.import_module("megatron.core.fusions.fused_bias_swiglu").weighted_swiglu,
                       "_torchdynamo_orig_callable")
    import deepspeed.ops
    assert all(deepspeed.ops.__compatible_ops__[op] is False for op in compat.DEEPSPEED_OPS_OFF)


def test_apply_refuses_when_a_symbol_is_gone(monkeypatch):
    monkeypatch.setattr(compat, "_applied", False)
    monkeypatch.setattr(compat, "PATCHED", compat.PATCHED + [("megatron.core.transformer.utils", "gone")])
    try:
        compat.apply("cpu")
    except RuntimeError as e:
        assert "megatron.core.transformer.utils.gone" in str(e)
    else:
        raise AssertionError("apply() patched over a symbol that does not exist")


def test_deepspeed_names_the_stage_norm_reads_exist():
    """megatron_kappa.parallel.stage_norm replaces DeepSpeed's ZeRO gradient norm on pipeline
    stages and reads these; an upgrade that renames one fails here, not in a pipeline run."""
    import inspect

    from deepspeed.runtime import utils
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from megatron_kappa.parallel import stage_norm
    source = inspect.getsource(DeepSpeedZeroOptimizer)
    for name in stage_norm.READS:
        assert hasattr(DeepSpeedZeroOptimizer, name) or f"self.{name} =" in source, name
    assert callable(utils.combine_grad_norm_groups) and callable(utils.is_model_parallel_parameter)
    assert "self.bit16_groups.append" in source  # one norm per group: what stage_norm keys by name
