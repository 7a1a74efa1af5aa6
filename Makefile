# `make demo` and `make test` set up .venv on a fresh machine; `make test-gpu` uses the GPU
# machine's preinstalled torch/triton (it has no network, so it installs nothing).
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
# torch==2.13.0 is the CPU build that lies on the CI machines' disk; a bare `torch` would
# pull a multi-GB CUDA build.
TORCH  ?= torch==2.13.0

.PHONY: demo test test-gpu bench-gpu clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m fp8train demo

test: $(STAMP)
	$(PY) -m pytest -q -m "not gpu" tests
	# Triton kernels' structure under the Triton interpreter (CPU); bitwise checks are GPU tests.
	TRITON_INTERPRET=1 $(PY) -m pytest -q -p no:cacheprovider tests/interpret

test-gpu:
	PYTHONPATH=$(CURDIR) python3 -m pytest -q -m gpu tests

clean:
	rm -rf $(VENV) demo_out .pytest_cache
