# The two commands: `make train` (set up, then train the tiny preset on the embedded corpus)
# and `make test` (set up, then run the whole suite on 8 virtual CPU devices). The tests compile many small
# programs: XLA's CPU backend optimisation is off (compile time, not numbers, is what tiny tests spend) and
# compiled programs are cached in .jax_cache across the processes of one run.
SHELL := /bin/bash
# The first interpreter that really runs and is >= 3.12 (a pyenv shim can exist and still fail).
PYTHON312 := $(shell for p in python3.12 python3.13 $$HOME/.pyenv/versions/3.12*/bin/python3.12 \
                 $$HOME/.pyenv/versions/3.13*/bin/python3.13 python3; do \
                 "$$p" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1 && { echo "$$p"; break; }; done)
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
	XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 $$XLA_FLAGS" \
	  JAX_PLATFORMS=cpu JAX_COMPILATION_CACHE_DIR=$(CURDIR)/.jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 \
	  $(VENV)/bin/python -m pytest -n 2 --dist loadfile --durations=10 $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) runs build src/*.egg-info .jax_cache
