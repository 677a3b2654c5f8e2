# Two entry points: `make demo` (the main job on the bundled corpus, CPU) and `make test`.
# A working Python 3.12 is found as `python3.12`, or through pyenv when the shim refuses.
PYTHON312 := $(shell python3.12 -c 'import sys' >/dev/null 2>&1 && echo python3.12 || \
	(PYENV_VERSION=3.12.1 python3.12 -c 'import sys' >/dev/null 2>&1 && echo "env PYENV_VERSION=3.12.1 python3.12") || \
	(command -v pyenv >/dev/null 2>&1 && ls $$(pyenv root)/versions/3.12*/bin/python3 2>/dev/null | tail -1))
VENV := .venv
PY := $(VENV)/bin/python
# CPU runs: one thread per rank, no JIT-built DeepSpeed ops. No global Dynamo switch: CPU runs are
# eager by model.compile (auto: off on CPU), and megatron's jit_fuser follows it (parallel/compat.py).
export OMP_NUM_THREADS ?= 1
export DS_ACCELERATOR ?= cpu
export TOKENIZERS_PARALLELISM ?= false
# pip installs without compiling every module of the 6.5 GB stack to bytecode (161 s → 61 s on
# 2 cores); the modules a run imports are compiled on first import and cached, which needs
# bytecode writing on (an environment's PYTHONDONTWRITEBYTECODE=1 would recompile at every start).
export PYTHONDONTWRITEBYTECODE =

.PHONY: venv test test-fast demo gpu-carry gpu-check clean

$(VENV)/.installed: requirements.txt pyproject.toml
	@test -n "$(PYTHON312)" || { echo "error: no working python3.12 found (install Python 3.12)"; exit 1; }
	test -x $(PY) || $(PYTHON312) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-compile -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	@# no start-up hook: the one an older `make venv` wrote imported the package in every process
	rm -f "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/megatron_kappa_quiet.pth" $(VENV)/.quiet-hook
	touch $@

venv: $(VENV)/.installed

# Everything: the unit tests on two pytest workers; then the tests marked `slow` (multi-process
# launches, end-to-end training, the Slurm clusters and two hosts) on two workers a file each, the
# longest files first (tests/conftest.py), as their launches leave a core idle (imports,
# launchers, one-process references, waits for daemons and timeouts). Those also marked `serial`
# (wall-clock timeouts) pass beside the others (tests/support/under_load.py). The 25 slowest are listed.
# Both targets start with the linter (ruff, configured in pyproject.toml): a finding fails them.
test: venv
	$(PY) -m ruff check .
	$(PY) -m pytest -q -n 2 -m "not slow" tests
	$(PY) -m pytest -q -n 2 --dist loadfile -m "slow" --durations=25 tests

# The unit tests of every package: no multi-process launches, no end-to-end training runs (those
# are marked `slow`), spread over two pytest workers.
test-fast: venv
	$(PY) -m ruff check .
	$(PY) -m pytest -q -n 2 -m "not slow and not gpu" tests

demo: venv
	$(PY) launch/demo.py

# For a GPU machine without a package index: ../shared/tools/gpu-carry copies megatron-core and
# DeepSpeed from .venv into .gpu/site; the GPU check also needs pytest, torchao (precision: fp8)
# and a few pure-Python packages (PyYAML falls back to pure Python without its C extension).
CARRY_EXTRA := pytest _pytest pluggy iniconfig packaging tqdm yaml torchao
gpu-carry: venv
	../shared/tools/gpu-carry
	for p in $(CARRY_EXTRA); do rm -rf .gpu/site/$$p; cp -r $(VENV)/lib/python3.12/site-packages/$$p .gpu/site/; done
	find .gpu/site -name '*.so' -path '*yaml*' -delete
	du -sh .gpu/site

# On a machine with one GPU: gpu tests, main command with resume, evaluation, benchmarks, one
# report (runs/gpu_check/report.md). Where megatron-core and DeepSpeed were carried in .gpu/site
# (../shared/tools/gpu-carry), the machine's own python is used and no venv is made.
gpu-check:
	@if [ -d .gpu/site ]; then \
		PYTHONPATH=$(CURDIR)/.gpu/site:$(CURDIR) PYTHONUNBUFFERED=1 python3 bench/gpu_check.py; \
	else $(MAKE) venv && $(PY) bench/gpu_check.py; fi

clean:
	rm -rf $(VENV) runs/demo
