import os
import sys
from pathlib import Path

# CPU runs: one thread, no torch.compile cold starts, DeepSpeed's CPU accelerator.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # data_prep/, eval/, launch/

import pytest  # noqa: E402
import torch  # noqa: E402

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="session")
def world1():
    """megatron parallel state for one process (TP = EP = 1) on a gloo group of one."""
    from megatron_kappa.config import ParallelConfig
    from megatron_kappa.parallel import init_distributed

    init_distributed(ParallelConfig(), seed=1)
    yield
