# Tandem: `make up` starts the whole system on this machine, `make test` runs every test.
# Both create .venv/ and install Tandem (with its generated gRPC stubs) when needed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tandem-installed
PROTOS := $(wildcard protos/tandem/v1/*.proto)
NODE_CLIENT := tests/node/node_modules/.package-lock.json

.PHONY: install up test lint test-unit bench clean compose-test docs

install: $(STAMP)

# torch is pinned to 2.13.0: that spec installs a local CPU wheel in seconds, any other pulls
# several GB of CUDA packages. Installed first so that Tandem's own `torch>=2.4` is satisfied.
TORCH_SPEC ?= torch==2.13.0

$(STAMP): pyproject.toml setup.py $(PROTOS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet '$(TORCH_SPEC)'
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

$(NODE_CLIENT): tests/node/package.json tests/node/package-lock.json
	cd tests/node && npm ci --no-audit --no-fund --loglevel=error

up: install
	$(VENV)/bin/tandem up $(ARGS)

test: install $(NODE_CLIENT) lint
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check tandem services tests benchmarks
	$(VENV)/bin/mypy tandem services
	# Import circles in tandem/, services/, tests/ and benchmarks/.
	$(PY) -m tandem.devtools.circles

# compose.yaml's cpu profile under podman, from an image built on a Debian base (mmdebstrap):
# deploy/podman/setup.sh installs podman, runc and mmdebstrap through apt when missing.
compose-test: install
	bash deploy/podman/setup.sh
	bash deploy/podman/build.sh
	TANDEM_COMPOSE_TEST=1 $(PY) -m pytest -q -p no:cacheprovider tests/compose $(PYTEST_ARGS)

test-unit: install
	$(PY) -m pytest -q tests/unit $(PYTEST_ARGS)

# docs/configuration.md from the config classes, and the scoreboard (README.md,
# benchmarks/RESULTS.md, benchmarks/plots/) from benchmarks/results/; tests check both.
docs: install
	$(PY) -m tandem.devtools.configdoc
	$(PY) -m benchmarks.scoreboard

bench: install
	bash benchmarks/setup_aiperf.sh
	$(PY) benchmarks/backbone.py

clean:
	rm -rf $(VENV) tests/node/node_modules tandem/v1/*_pb2*.py tandem/v1/*_pb2.pyi
