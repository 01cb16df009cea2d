# fastshare: `make demo` and `make test` set everything up from nothing (see README.md).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PROTOS := $(shell find proto -name '*.proto')
VERSION := $(shell sed -n 's/^version = "\(.*\)"$$/\1/p' pyproject.toml)
# What the Ansible roles install by default (fastshare_package_source: wheel).
WHEEL  := dist/fastshare-$(VERSION)-py3-none-any.whl

.PHONY: demo test lint pytest system-deps venv protos clean wheel

## One-time set-up: a virtualenv with the package (editable) and the dev tools.
$(STAMP): pyproject.toml setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

## Regenerate gRPC code when a .proto changes (also done by every install).
fastshare/v1/.generated: $(PROTOS) $(STAMP)
	$(BIN)/python setup.py -q generate_protos
	touch $@

venv: $(STAMP) fastshare/v1/.generated

## Debian packages the tests need (systemd-nspawn, debootstrap, etcd, ...), installed when root.
system-deps:
	bash scripts/install-system-deps.sh

## The wheel of this checkout for the Ansible roles (README, Ansible collection). build/ goes
## first: setuptools would pack a module deleted from the tree but still in build/lib.
wheel: venv
	rm -rf build $(WHEEL)
	$(BIN)/python -m pip wheel -q --no-deps --no-build-isolation --wheel-dir dist .
	test -f $(WHEEL) && echo "$(WHEEL)"

demo: venv
	PATH="$(CURDIR)/$(BIN):$$PATH" bash scripts/demo.sh

lint: venv
	$(BIN)/ruff check .

pytest: venv system-deps
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest $(PYTEST_ARGS)

test: lint pytest

clean:
	rm -rf $(VENV) build dist *.egg-info fastshare/v1/*_pb2*.py* fastshare/v1/.generated
