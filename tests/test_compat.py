"""Every megatron-core symbol the CPU compat module patches must still exist upstream."""
import importlib

import pytest
import torch

from megatron_kappa import compat


@pytest.mark.parametrize("module,attr", compat.PATCHED)
def test_patched_symbol_exists(module, attr):
    obj, name = compat._resolve(module, attr)
    assert hasattr(obj, name), f"{module}.{attr} is gone: review megatron_kappa/compat.py"


@pytest.mark.parametrize("name", compat.CUDA_SHIMMED)
def test_shimmed_cuda_entry_point_exists(name):
    assert hasattr(torch.cuda, name)


def test_apply_patches_on_cpu(world1):
    if torch.cuda.is_available():
        pytest.skip("patches apply only without CUDA")
    assert compat.apply()
    mappings = importlib.import_module("megatron.core.tensor_parallel.mappings")
    assert mappings._gather_along_first_dim.__name__ == "gather"
    assert importlib.import_module("megatron.core.transformer.utils").get_default_causal_mask(3).device.type == "cpu"
