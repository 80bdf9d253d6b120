PY ?= python3

.PHONY: install run test gpu-test
install:
	PY=$(PY) bash scripts/install.sh

# The main job: train the tiny Llama on its defaults (GPU when present), checked against torch.optim.AdamW.
run: install
	$(PY) -m deep_optimizer_states train

# The CPU test suite (CI runs exactly this); GPU tests are skipped without CUDA.
test: install
	$(PY) -m pytest -q

# On a GPU machine: the GPU tests alone.
gpu-test:
	$(PY) -m pytest -q -m gpu tests/gpu
