# Two entry points: `make demo` (the main job on the bundled corpus, CPU) and `make test`.
# A working Python 3.12 is found as `python3.12`, or through pyenv when the shim refuses.
PYTHON312 := $(shell python3.12 -c 'import sys' >/dev/null 2>&1 && echo python3.12 || \
	(PYENV_VERSION=3.12.1 python3.12 -c 'import sys' >/dev/null 2>&1 && echo "env PYENV_VERSION=3.12.1 python3.12") || \
	(command -v pyenv >/dev/null 2>&1 && ls $$(pyenv root)/versions/3.12*/bin/python3 2>/dev/null | tail -1))
VENV := .venv
PY := $(VENV)/bin/python
# CPU runs: one thread per rank, no torch.compile cold starts, no JIT-built DeepSpeed ops.
export OMP_NUM_THREADS ?= 1
export TORCHDYNAMO_DISABLE ?= 1
export DS_ACCELERATOR ?= cpu
export TOKENIZERS_PARALLELISM ?= false

.PHONY: venv test demo clean

$(VENV)/.installed: requirements.txt pyproject.toml
	@test -n "$(PYTHON312)" || { echo "error: no working python3.12 found (install Python 3.12)"; exit 1; }
	test -x $(PY) || $(PYTHON312) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $@

venv: $(VENV)/.installed

test: venv
	$(PY) -m pytest -q tests

demo: venv
	$(PY) launch/demo.py

clean:
	rm -rf $(VENV) runs/demo
