import os
import sys
from pathlib import Path

# CPU runs, also on a machine with a GPU: the CPU device for this process and every process it
# starts (tests/test_gpu.py sets the device of its own runs), one thread, no torch.compile cold
# starts, DeepSpeed's CPU accelerator.
os.environ.setdefault("MEGATRON_KAPPA_DEVICE", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
# Triton kernels run on CPU tensors through Triton's interpreter in the test process, on any
# machine; the flag is read when a kernel is defined, so it is set before any kernel module is
# imported. The gpu-marked kernel tests run the compiled kernels in a child process without it.
os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # data_prep/, eval/, launch/

import pytest
import torch

# Fixtures shared by several test files live in these support modules, registered here so that no
# test file imports a fixture by name (which pyflakes rightly reports as redefined by the parameter).
pytest_plugins = ["tests.support.export_runs"]

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="session")
def world1():
    """megatron parallel state for one process (TP = EP = 1) on a gloo group of one."""
    from megatron_kappa.config import ParallelConfig
    from megatron_kappa.parallel.groups import init_distributed

    init_distributed(ParallelConfig(), seed=1)
    yield


@pytest.fixture(autouse=True)
def fresh_moe_metrics_tracker():
    """megatron's MoE metrics tracker is a process-wide singleton sized by the first model that
    records into it; each test starts with none, so no test depends on which ran before it."""
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker
    destroy_moe_metrics_tracker()
    yield


# --- shared by several test modules: each made once per session --------------------------------

# The disk a test file leaves behind: pytest removes a passed test's tmp_path when the test ends but
# a module fixture's tmp_path_factory folder only when the whole session ends, so a session of
# slow files held 15-18 GB of checkpoints at once and filled CI's disk. A file whose tests all pass
# has its folders removed when it ends (a failed file keeps them to read); the session fixtures'
# folders, made through session_dir, stay for the files after it.
SESSION_DIRS: set[Path] = set()
FAILED_FILES: set[str] = set()
TMP_BYTES: dict[str, int] = {}  # a file's folders' bytes at its end: the summary names the largest


def session_dir(tmp_path_factory, name: str) -> Path:
    path = tmp_path_factory.mktemp(name)
    SESSION_DIRS.add(path)
    return path


def tree_bytes(path: Path) -> int:
    """Bytes on the disk under `path`: blocks (sparse files), each hard-linked file once."""
    total, seen = 0, set()
    for root, _, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed:
        FAILED_FILES.add(str(item.path))
    return report


@pytest.fixture(scope="module", autouse=True)
def file_folders_removed(request, tmp_path_factory):
    import shutil
    base = tmp_path_factory.getbasetemp()
    before = set(base.iterdir())
    yield
    # (pytest's "<name>current" links to a numbered folder are left: they would count it twice)
    made = [path for path in set(base.iterdir()) - before if path not in SESSION_DIRS and not path.is_symlink()]
    TMP_BYTES[request.path.stem] = sum(tree_bytes(path) for path in made)
    if str(request.path) not in FAILED_FILES:
        for path in made:
            shutil.rmtree(path, ignore_errors=True)


def pytest_sessionfinish(session):
    if hasattr(session.config, "workeroutput"):  # an xdist worker: its files' sizes go to the controller
        session.config.workeroutput["tmp_bytes"] = dict(TMP_BYTES)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: absent without it
def pytest_testnodedown(node, error):
    TMP_BYTES.update(getattr(node, "workeroutput", {}).get("tmp_bytes", {}))


def pytest_terminal_summary(terminalreporter):
    top = sorted(((name, size) for name, size in TMP_BYTES.items() if size >= 2 ** 26), key=lambda kv: -kv[1])[:5]
    if top:  # files of 64 MiB or more
        terminalreporter.write_line("largest temporary folders at a file's end: " +
                                    ", ".join(f"{name} {size / 2**30:.2f} GiB" for name, size in top))


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """One Slurm cluster (slurmctld + slurmd on this machine) for every Slurm test of the session;
    skips, saying why, without Slurm or root (tests/support/slurm_cluster.py)."""
    from tests.support.slurm_cluster import slurm_cluster
    with slurm_cluster(session_dir(tmp_path_factory, "slurm")) as c:
        yield c


@pytest.fixture(scope="session")
def sample_shards(tmp_path_factory):
    """Shards and a 2048-piece tokenizer from 400 documents of the bundled sample
    (data_prep/fineweb_edu.py, as `make demo` runs it): {"train", "valid", "tokenizer", "dir"}."""
    import json
    import subprocess
    root = Path(__file__).resolve().parents[1]
    out = session_dir(tmp_path_factory, "sample_shards")
    done = subprocess.run([sys.executable, "data_prep/fineweb_edu.py", "--input", "data_prep/sample", "--output", out,
                           "--train-tokenizer", "--vocab-size", "2048", "--workers", "1", "--max-docs", "400",
                           "--valid-fraction", "0.05", "--quiet"], cwd=root, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    return {"train": [str(out / p) for p in manifest["prefixes"]["train"]],
            "valid": [str(out / p) for p in manifest["prefixes"]["valid"]],
            "tokenizer": str(out / "tokenizer.model"), "dir": out}


# The slow files, longest first (worker-seconds of each file's slow tests in a clean clone, 2026-12-04;
# only their order matters): pytest-xdist's --dist loadfile hands files to its workers in collection
# order, so the long ones start first and the last file a worker runs is a short one (a short tail).
LONGEST_FIRST = ("test_preemption", "test_study", "test_multinode", "test_demo", "test_plan", "test_pipeline",
                 "test_reshard", "test_export", "test_training", "test_async_checkpoint", "test_compile",
                 "test_disk_full", "test_gpu_check", "test_optimizers",
                 "test_export_tools", "test_import_hf", "test_checkpoint_step", "test_mla_training", "test_mtp",
                 "test_parallel", "test_softmoe_training", "test_two_ranks_reliability", "test_kappa_aot",
                 "test_sharded_alpha", "test_offload", "test_fp8", "test_export_card", "test_analysis", "test_loss",
                 "test_reliability",
                 "test_launcher_exit", "test_slurm", "test_slurm_training")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: the rest keeps its order


# A run needs room for its checkpoints and shards: say so before they fail one by one with
# errors that never name the disk (megatron's "MockGPTDataset failed to build", zip writers).
# Measured: 3.4 GB under pytest's folder at the slow stage's peak (du every 10 s, two workers,
# 2026-12-05).
FREE_BYTES_NEEDED = 6 * 2**30


def pytest_sessionstart(session):
    import shutil
    import tempfile
    if hasattr(session.config, "workerinput"):  # an xdist worker: the controller has said it
        return
    free = shutil.disk_usage(tempfile.gettempdir()).free
    if free < FREE_BYTES_NEEDED:
        print(f"\nwarning: {free / 2**30:.1f} GiB free under {tempfile.gettempdir()}; the slow tests "
              f"write up to {FREE_BYTES_NEEDED / 2**30:.0f} GiB and fail in odd ways when it runs out",
              file=sys.stderr)
