# `make demo` and `make test` set up .venv on a fresh machine; `make test-gpu` uses the GPU
# machine's preinstalled torch/triton (it has no network, so it installs nothing).
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
# torch==2.13.0 is the CPU build that lies on the CI machines' disk; a bare `torch` would
# pull a multi-GB CUDA build.
TORCH  ?= torch==2.13.0
# pytest-xdist workers: the CPU suite is mostly Python, one worker per core of CI's two, one
# torch thread each; a test file goes to one worker (its costly fixtures run once there).
WORKERS ?= 2
PYTEST := OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider
XDIST  := -n $(WORKERS) --dist loadscope
# Tests that start process groups (`launch`) run after, one at a time: gloo ranks that wait
# for each other on cores that other tests hold ran 2-5x slower. Only their files are collected.
LAUNCH_FILES := $(shell grep -l -e mark.launch -e world_params tests/test_*.py)

.PHONY: demo test test-all test-gpu clean

# --no-compile: pip byte-compiles every installed module (torch's and transformers' thousands)
# by default; imports compile the few that run (2026-12-02, 2-core machine: torch 46 -> 20 s,
# transformers 38 -> 23 s of install).
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --no-compile $(TORCH)
	$(PY) -m pip install -q --no-compile -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m fp8train demo

# make test: the CPU unit tests, under 10 minutes cold on a 2-core machine 3x slower than
# ours (tests/tiers.py: no slow tests, sweeps as pairwise covers, no process launches, no
# Triton interpreter, nothing that builds the C++ extension).
test: $(STAMP)
	$(PYTEST) $(XDIST) --durations=10 -m "not gpu and not slow and not launch" --ignore=tests/interpret tests

# make test-all: make test, then the rest (what CI runs): the slow tests, the tests that
# launch process groups, and the Triton kernels' structure under the Triton interpreter (CPU;
# bitwise checks are GPU tests).
test-all: test
	$(PYTEST) $(XDIST) -m "not gpu and slow and not launch" --ignore=tests/interpret tests
	$(PYTEST) -m "launch" $(LAUNCH_FILES)
	TRITON_INTERPRET=1 $(PYTEST) -n $(WORKERS) tests/interpret

test-gpu:
	PYTHONPATH=$(CURDIR) python3 -m pytest -q -m gpu tests

clean:
	rm -rf $(VENV) demo_out .pytest_cache
