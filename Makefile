# Two commands on a fresh machine: `make train` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# TORCH_SPEC is installed only when the venv has no torch yet, before the package, so a torch
# already in the venv (a CUDA build, say) is kept when it is in the range pyproject.toml states
# (pip replaces it otherwise). For a given build pass an index, e.g. the CPU wheel with
# TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" or a CUDA one with
# TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128".
TORCH_SPEC ?= torch==2.13.0
STDLIB := $(shell $(PY) -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])")
export RAY_TMPDIR ?= /tmp/elastic_gpt_ray
export RAY_DEDUP_LOGS ?= 0
export MLFLOW_SERVER_ENABLE_JOB_EXECUTION ?= false

.PHONY: venv train data test test-fast test-integration test-system test-validation lint bench clean

venv: $(BIN)/elastic-gpt
$(BIN)/elastic-gpt: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q $(TORCH_SPEC)
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

# The default corpus: the standard library's top-level modules, 5% of them (by a seeded hash of
# their text) held out as data/stdlib-bpe4k/val. The tokenizer is a 4,096-id byte-level BPE
# learnt on the other 95% (docs/performance.md, "The default job"). The recipe
# data_pipelines/recipes/stdlib.py makes both (the tokenizer only when its file is missing); make
# runs it when the dataset's manifest is missing or older than the tokenizer file.
DATA := data/stdlib-bpe4k
TOKENIZER := data/stdlib-bpe4k.json
data: $(DATA)/manifest.json
$(DATA)/manifest.json: $(wildcard $(TOKENIZER)) | venv
	$(BIN)/python -m data_pipelines.recipes.stdlib --stdlib "$(STDLIB)" --output $(DATA) \
		--tokenizer-output $(TOKENIZER)

# JOB=mini-llama trains a small Llama 3 on the same corpus (jobs/configs/mini-llama.yaml).
JOB ?= mini
train: venv data
	mkdir -p $(RAY_TMPDIR)
	$(BIN)/elastic-gpt train --config jobs/configs/$(JOB).yaml
	@echo "---- a sample from the trained model ----"
	@# generate heals a prompt's trailing space (the BPE puts a word's leading space in the
	@# word's token): the first new token must start with it, so "def " is continued by " name".
	$(BIN)/elastic-gpt generate --checkpoint runs/$(JOB)-bpe4k/checkpoints --prompt "def " \
		--max-new-tokens 100 --temperature 0.7
	@echo "---- MLflow: $(BIN)/mlflow ui --backend-store-uri sqlite:///$(CURDIR)/mlflow.db"

test: venv
	mkdir -p $(RAY_TMPDIR)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -ra --durations=15 tests

# The tests are split by what they start (tests/<kind>/): unit (nothing: no process, socket,
# process group or sleep; tests/unit/conftest.py fails one that does, or that runs over its
# budget), integration (gloo process groups, loopback servers, command-line subprocesses), system
# (Ray clusters, chaos, jobs) and validation (published runs, benchmark dry runs). `make test` runs
# them all; `make test-fast` is the unit tests, for the edit-test loop.
test-fast: venv
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -ra --durations=10 tests/unit

test-integration test-system test-validation: test-%: venv
	mkdir -p $(RAY_TMPDIR)
	$(BIN)/python -m pytest -q -ra --durations=15 tests/$*

lint: venv
	$(BIN)/ruff check .

bench: venv
	$(BIN)/python bench/run_all.py

clean:
	rm -rf runs data mlflow.db mlartifacts
