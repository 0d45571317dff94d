# The two commands: `make train` (set up, then train the tiny preset on the embedded corpus)
# and `make test` (set up, then run the whole suite on 8 virtual CPU devices).
SHELL := /bin/bash
PYTHON312 := $(shell command -v python3.12 2>/dev/null || ls -d $$HOME/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null | tail -n 1)
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
EXTRAS := test$(if $(HAS_GPU),$(comma)gpu)
comma := ,
VENV := .venv
STAMP := $(VENV)/.installed-$(EXTRAS)

.PHONY: setup train test bench-gmm clean
setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -n "$(PYTHON312)" || { echo "dropless needs Python >= 3.12: install it (e.g. 'pyenv install 3.12') and retry." >&2; exit 1; }
	@test -x $(VENV)/bin/python || $(PYTHON312) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
	$(VENV)/bin/python -m pip install -q --disable-pip-version-check -e '.[$(EXTRAS)]'
	@rm -f $(VENV)/.installed-*; touch $@

train: setup
	$(VENV)/bin/dropless train $(ARGS)

test: setup
	XLA_FLAGS="--xla_force_host_platform_device_count=8 $$XLA_FLAGS" JAX_PLATFORMS=cpu \
	  $(VENV)/bin/python -m pytest -n 2 --dist loadfile $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) runs build src/*.egg-info
