PY ?= python3
STAMP := build/install.stamp
# The interpreter the install chose (an active venv, python3, or .venv; see scripts/install.sh).
PYTHON = "$$(cat build/python 2>/dev/null || echo $(PY))"

.PHONY: install run test gpu-test

# Installs again when pyproject.toml or the install script change; `make install` forces it.
$(STAMP): pyproject.toml scripts/install.sh
	PY=$(PY) bash scripts/install.sh
	touch $@

install:
	PY=$(PY) bash scripts/install.sh
	touch $(STAMP)

# The main job: dos train on its defaults (the stdlib's source as bytes; GPU when present).
run: $(STAMP)
	$(PYTHON) -m deep_optimizer_states train

# The CPU test suite (CI runs exactly this); GPU tests are skipped without CUDA.
test: $(STAMP)
	$(PYTHON) -m pytest -q

# On a GPU machine: the GPU tests alone.
gpu-test: $(STAMP)
	$(PYTHON) -m pytest -q -m gpu tests/gpu
