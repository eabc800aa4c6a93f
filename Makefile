# Two commands on a fresh machine: `make train` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU wheel of torch 2.13.0 lies on this machine's disk; on a GPU machine pass e.g.
# TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128" or keep the
# torch already installed in the venv (any torch >= 2.6 satisfies the package).
TORCH_SPEC ?= torch==2.13.0
STDLIB := $(shell $(PY) -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])")
export RAY_TMPDIR ?= /tmp/elastic_gpt_ray
export RAY_DEDUP_LOGS ?= 0
export MLFLOW_SERVER_ENABLE_JOB_EXECUTION ?= false

.PHONY: venv train data test test-fast lint bench clean

venv: $(BIN)/elastic-gpt
$(BIN)/elastic-gpt: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q $(TORCH_SPEC)
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

data: data/stdlib/manifest.json
data/stdlib/manifest.json: | venv
	$(BIN)/elastic-gpt prepare-data --input "file://$(STDLIB)/*.py" --output data/stdlib \
		--tokenizer gpt2 --seq-len 256

train: venv data
	mkdir -p $(RAY_TMPDIR)
	$(BIN)/elastic-gpt train --config jobs/configs/mini.yaml
	@echo "---- a sample from the trained model ----"
	$(BIN)/elastic-gpt generate --checkpoint runs/mini/checkpoints --prompt "def " \
		--max-new-tokens 80 --temperature 0.7
	@echo "---- MLflow: $(BIN)/mlflow ui --backend-store-uri sqlite:///$(CURDIR)/mlflow.db"

test: venv
	mkdir -p $(RAY_TMPDIR)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -ra --durations=15 tests

lint: venv
	$(BIN)/ruff check .

bench: venv
	$(BIN)/python bench/run_all.py

clean:
	rm -rf runs data mlflow.db mlartifacts
