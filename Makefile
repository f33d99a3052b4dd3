# dilocod build.  Out-of-tree objects in $(BUILD); sanitizer variants get their own dir.
#   make                      build/libdiloco.a build/diloco (and build/dilocod once server/ has a main)
#   make check                install deps + venv, build, C unit tests (plain and ASan/UBSan), pytest
#   make SANITIZE=address,undefined check   the same suite on instrumented binaries
#   make fuzz FUZZ_SECONDS=60 libFuzzer on the safetensors header parser, the request path and the
#                              compressed-delta validator
#   make deps                 install missing Debian packages (no-op when all present)

SHELL       := /bin/bash
CC          ?= cc
SANITIZE    ?=
PKGS        := libuv libcurl libcjson libcrypto expat libxxhash
LLHTTP_SRC  := /usr/share/llhttp
LLHTTP_INC  := /usr/share/include/llhttp

ifeq ($(SANITIZE),)
BUILD       ?= build
SANFLAGS    :=
else
BUILD       ?= build-$(subst $(comma),-,$(SANITIZE))
SANFLAGS    := -fsanitize=$(SANITIZE) -fno-omit-frame-pointer -fno-sanitize-recover=all
endif
comma := ,

WARN        := -Wall -Wextra -Wshadow -Wstrict-prototypes -Werror
CFLAGS      ?= -O2 -g
ALL_CFLAGS  := -std=c11 -D_GNU_SOURCE $(CFLAGS) $(WARN) $(SANFLAGS) -MMD -MP -Icommon \
               $(shell pkg-config --cflags $(PKGS) 2>/dev/null)
LDLIBS      := $(shell pkg-config --libs $(PKGS) 2>/dev/null) -lm
LDFLAGS     += $(SANFLAGS)

COMMON_SRC  := $(wildcard common/*.c)
CLIENT_SRC  := $(wildcard client/*.c)
SERVER_SRC  := $(wildcard server/*.c server/*/*.c)
# server/ is layered (server/README.md): one -I per layer, and `make lint-layers` keeps the include rules
SERVER_INC  := -Iserver -Iserver/core -Iserver/net -Iserver/hub -Iserver/api
UNIT_SRC    := $(wildcard tests/unit/test-*.c)

COMMON_OBJ  := $(COMMON_SRC:%.c=$(BUILD)/%.o)
CLIENT_OBJ  := $(CLIENT_SRC:%.c=$(BUILD)/%.o)
SERVER_OBJ  := $(SERVER_SRC:%.c=$(BUILD)/%.o)
# the server minus main(): a static library that dilocod, the unit tests and the fuzzers link
SERVER_LIB_OBJ := $(filter-out $(BUILD)/server/main.o,$(SERVER_OBJ))
UNIT_OBJ    := $(UNIT_SRC:%.c=$(BUILD)/%.o) $(BUILD)/tests/unit/runner.o
# the client's pieces that hold no command, unit-tested too (the rest of client/ is the binary's)
CLIENT_UNIT_OBJ := $(BUILD)/client/cli_untrusted.o $(BUILD)/client/cli_body.o

LLHTTP_OBJ  := $(BUILD)/llhttp/llhttp.o $(BUILD)/llhttp/api.o $(BUILD)/llhttp/http.o
BINS        := $(BUILD)/diloco $(BUILD)/tests/st-write $(BUILD)/tests/unit-tests
ifneq ($(SERVER_SRC),)
BINS        += $(BUILD)/dilocod
endif

VENV        := .venv
PY          := $(VENV)/bin/python
# libopenblas0-pthread: Debian's python3-torch calls whatever libblas.so.3 the alternatives name, and
# without it that is the reference BLAS: the demo's workers trained at 2.6 GFLOP/s (a matrix product
# of theirs, one thread), at 64 with OpenBLAS; `make demo` took 154 s instead of 17 (same losses).
DEB_PKGS    := build-essential pkg-config libuv1-dev libcurl4-openssl-dev libcjson-dev node-llhttp libssl-dev \
               python3-venv python3-torch python3-numpy clang libclang-rt-14-dev curl \
               chromium systemd nginx iproute2 libexpat1-dev podman runc debootstrap python3-pil \
               libopenblas0-pthread libxxhash-dev
PY_PKGS     := safetensors huggingface_hub pytest pytest-xdist requests prometheus_client boto3

.PHONY: all deps venv venv-transformers seaweedfs check lint lint-layers lint-errors unit test-integration fuzz fuzz-regress bench bench-deps soak clean distclean

all: $(BUILD)/libdiloco.a $(BUILD)/libdilocod.a $(BINS)

# The dependency file names the object both ways, relative and absolute: a tree built with BUILD=/abs/dir
# and then with BUILD=dir (or the reverse) still rebuilds what a header change touches.
$(BUILD)/%.o: %.c
	@mkdir -p $(@D)
	$(CC) $(ALL_CFLAGS) -MT $(abspath $@) -MT $(patsubst $(CURDIR)/%,%,$(abspath $@)) -c $< -o $@

$(BUILD)/libdiloco.a: $(COMMON_OBJ)
	@mkdir -p $(@D)
	rm -f $@ && ar rcs $@ $^

$(BUILD)/libdilocod.a: $(SERVER_LIB_OBJ) $(LLHTTP_OBJ) $(BUILD)/gen/dashboard.o
	@mkdir -p $(@D)
	rm -f $@ && ar rcs $@ $^

$(BUILD)/diloco: $(CLIENT_OBJ) $(BUILD)/libdiloco.a
	$(CC) $(LDFLAGS) -o $@ $^ $(LDLIBS)

$(BUILD)/tests/st-write: $(BUILD)/tests/tools/st-write.o $(BUILD)/libdiloco.a
	@mkdir -p $(@D)
	$(CC) $(LDFLAGS) -o $@ $^ $(LDLIBS)

$(UNIT_OBJ): ALL_CFLAGS += $(SERVER_INC) -I$(LLHTTP_INC) -Iclient
$(BUILD)/tests/unit-tests: $(UNIT_OBJ) $(CLIENT_UNIT_OBJ) $(BUILD)/libdilocod.a $(BUILD)/libdiloco.a
	@mkdir -p $(@D)
	$(CC) $(LDFLAGS) -o $@ $^ $(LDLIBS)

# llhttp ships as C sources in Debian 12 (no shared library): compile them in, without our -Werror.
$(BUILD)/llhttp/%.o: $(LLHTTP_SRC)/%.c
	@mkdir -p $(@D)
	$(CC) -std=c11 $(CFLAGS) $(SANFLAGS) -I$(LLHTTP_INC) -c $< -o $@

# The dashboard page is compiled into the binary (no files to install, no CDN): a byte array made
# with od and sed, so the build needs nothing beyond coreutils.
$(BUILD)/gen/dashboard.c: server/api/dashboard.html
	@mkdir -p $(@D)
	{ echo '/* generated from server/api/dashboard.html by the Makefile */'; \
	  echo '#include <stddef.h>'; \
	  echo 'const unsigned char dashboard_html[] = {'; \
	  od -An -v -tx1 $< | sed -e 's/ \([0-9a-f][0-9a-f]\)/0x\1,/g'; \
	  echo '};'; \
	  echo 'const size_t dashboard_html_len = sizeof(dashboard_html);'; } > $@.tmp && mv $@.tmp $@

$(BUILD)/gen/dashboard.o: $(BUILD)/gen/dashboard.c
	$(CC) -std=c11 $(CFLAGS) $(SANFLAGS) -c $< -o $@

$(BUILD)/dilocod: $(BUILD)/server/main.o $(BUILD)/libdilocod.a $(BUILD)/libdiloco.a
	$(CC) $(LDFLAGS) -o $@ $^ $(LDLIBS)

$(SERVER_OBJ): ALL_CFLAGS += $(SERVER_INC) -I$(LLHTTP_INC)

# Tensor kernels: gcc 12's -O2 cost model vectorises almost nothing, and the selects in the f16 loops
# are only if-converted when float operations may be speculated (we never read FP exception flags).
# -ffp-contract=off: a multiply-add is fused only where the code calls fmaf(), as torch fuses it (gcc
# already defaults to off with -std=c11, clang does not; the outer step's bits depend on it).
KERNEL_OBJ  := $(BUILD)/common/convert.o $(BUILD)/common/outer.o $(BUILD)/common/outer_run.o $(BUILD)/common/delta.o \
               $(BUILD)/common/delta_norm.o $(BUILD)/common/compress.o
$(KERNEL_OBJ): ALL_CFLAGS += -ftree-vectorize -fvect-cost-model=dynamic -fno-trapping-math -ffp-contract=off

# ---- dependencies -------------------------------------------------------------------------------
deps:
	@missing=""; for p in $(DEB_PKGS); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q 'install ok installed' || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "deps: installing$$missing"; \
	  SUDO=; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing; \
	else echo "deps: all Debian packages present"; fi

venv: $(VENV)/.stamp
# the worker package (client/python, import diloco) is installed too, again whenever it changes:
# tests/integration/test_worker_package.py and the examples import it as users do.  --no-deps: its
# dependencies are the venv's already (torch from Debian); a resolver must never swap that torch
PKG_SRC     := client/python/pyproject.toml $(wildcard client/python/diloco/*.py client/python/diloco/*/*.py)
$(VENV)/.stamp: Makefile $(PKG_SRC)
	@test -x $(PY) || /usr/bin/python3 -m venv --system-site-packages $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check $(PY_PKGS)
	$(PY) -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps ./client/python
	$(PY) -c 'import safetensors, huggingface_hub, pytest, xdist, numpy, torch, prometheus_client, boto3, PIL, diloco'
	touch $@

# The worker package's transformers extra in an environment of its own: transformers 4.46.3 (a release
# that imports with Debian's torch 1.13) needs huggingface_hub < 1.0, the main venv has 2.x.  The
# DiLoCoCallback test runs its worker processes with this python.
VENV_TF     := .venv-transformers
venv-transformers: $(VENV_TF)/.stamp
$(VENV_TF)/.stamp: Makefile $(PKG_SRC)
	@test -x $(VENV_TF)/bin/python || /usr/bin/python3 -m venv --system-site-packages $(VENV_TF)
	$(VENV_TF)/bin/python -m pip install -q --disable-pip-version-check safetensors requests \
	  "transformers==4.46.3" "accelerate==1.1.1"
	$(VENV_TF)/bin/python -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps ./client/python
	$(VENV_TF)/bin/python -c 'import torch, transformers, diloco.integrations.transformers; from transformers import Trainer'
	touch $@

# SeaweedFS, the S3 server of tests/integration/test_s3.py: built once from the Go module proxy and
# cached in ~/.cache/dilocod/seaweedfs-<version>/ (about 7 minutes on a fresh machine; a no-op after)
seaweedfs:
	@bash tests/tools/seaweedfs.sh

# ---- tests --------------------------------------------------------------------------------------
# server/'s layers include only what they may (server/README.md, Layers)
lint-layers:
	@bash tests/tools/lint-layers.sh

# the error convention (server/README.md, Error convention): banned calls, exits, unchecked allocations
lint-errors:
	@bash tests/tools/lint-errors.sh --self-test
	@bash tests/tools/lint-errors.sh

lint: lint-layers lint-errors

unit: $(BUILD)/tests/unit-tests
	$(BUILD)/tests/unit-tests

# The integration tests mostly wait (on a daemon, a poll, a timeout): PYTEST_JOBS pytest workers run
# them side by side, one test file per worker (--dist loadfile: a file's module fixtures, a container
# image, a SeaweedFS, are made once).  3 on 2 CPUs: 7.5 min against 15.7 one after another.
# PYTEST_JOBS=0 runs them in this process, one after another.
PYTEST_JOBS ?= 3
test-integration: all venv venv-transformers
	DILOCO_BUILD=$(abspath $(BUILD)) $(PY) -m pytest -q -n $(PYTEST_JOBS) --dist loadfile tests/integration \
	  $(PYTEST_ARGS)

check: deps
	$(MAKE) lint
	$(MAKE) venv
	$(MAKE) venv-transformers
	$(MAKE) all
	$(MAKE) unit
ifeq ($(SANITIZE),)
	$(MAKE) SANITIZE=address,undefined unit
endif
	$(MAKE) fuzz-regress
	$(MAKE) seaweedfs
	$(MAKE) test-integration

# ---- fuzzing (clang + libFuzzer) -----------------------------------------------------------------
FUZZ_SECONDS ?= 60
FUZZ_BUILD   := build-fuzz
FUZZ_FLAGS   := -std=c11 -D_GNU_SOURCE -O1 -g -Icommon $(shell pkg-config --cflags libcjson) \
                -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all
FUZZ_TARGETS := $(FUZZ_BUILD)/fuzz-header $(FUZZ_BUILD)/fuzz-request $(FUZZ_BUILD)/fuzz-compressed
FUZZ_SERVER  := $(filter-out server/main.c,$(SERVER_SRC))

$(FUZZ_BUILD)/fuzz-header: tests/fuzz/fuzz-header.c $(COMMON_SRC) $(wildcard common/*.h)
	@mkdir -p $(@D)
	clang $(FUZZ_FLAGS) -o $@ $< $(COMMON_SRC) $(shell pkg-config --libs libcjson libcrypto libxxhash) -lm

# The compressed-delta validator (README, "Compressed deltas"): the common sources only.
$(FUZZ_BUILD)/fuzz-compressed: tests/fuzz/fuzz-compressed.c $(COMMON_SRC) $(wildcard common/*.h)
	@mkdir -p $(@D)
	clang $(FUZZ_FLAGS) -o $@ $< $(COMMON_SRC) $(shell pkg-config --libs libcjson libcrypto libxxhash) -lm

# The request path links the server (without main) and llhttp's C sources.
$(FUZZ_BUILD)/fuzz-request: tests/fuzz/fuzz-request.c $(COMMON_SRC) $(FUZZ_SERVER) $(wildcard common/*.h server/*.h server/*/*.h)
	@mkdir -p $(@D)
	clang $(FUZZ_FLAGS) $(SERVER_INC) -I$(LLHTTP_INC) $(shell pkg-config --cflags $(PKGS)) -o $@ $< $(COMMON_SRC) \
	  $(FUZZ_SERVER) $(BUILD)/gen/dashboard.c $(LLHTTP_SRC)/llhttp.c $(LLHTTP_SRC)/api.c $(LLHTTP_SRC)/http.c $(LDLIBS)

$(FUZZ_BUILD)/fuzz-request: $(BUILD)/gen/dashboard.c

# Replays the committed corpus: a regression test, part of `make check`.
fuzz-regress: $(FUZZ_TARGETS)
	@set -o pipefail; for t in $(FUZZ_TARGETS); do n=$${t##*/fuzz-}; \
	  $$t -runs=0 tests/fuzz/corpus/$$n 2>&1 | tail -1 || exit 1; done

fuzz: $(FUZZ_TARGETS)
	@for t in $(FUZZ_TARGETS); do n=$${t##*/fuzz-}; mkdir -p $(FUZZ_BUILD)/corpus-$$n; \
	  $$t -max_total_time=$(FUZZ_SECONDS) -max_len=65536 $(FUZZ_BUILD)/corpus-$$n tests/fuzz/corpus/$$n || exit 1; done

# Benchmarks are reports, not tests: each prints ratios measured side by side in one run.
BENCH_BINS  := $(BUILD)/tests/bench-convert $(BUILD)/tests/bench-outer $(BUILD)/tests/stream
# bench_round.py: model sizes in MiB (8 deltas each); BENCH_ROUNDS=3 fresh rounds per figure (environment).
BENCH_SIZES ?= 1024 256
$(BUILD)/tests/bench-%: $(BUILD)/tests/bench/bench-%.o $(BUILD)/libdiloco.a
	@mkdir -p $(@D)
	$(CC) $(LDFLAGS) -o $@ $^ $(LDLIBS)

$(BUILD)/tests/stream: tests/bench/stream.c
	@mkdir -p $(@D)
	$(CC) -O2 -pthread -o $@ $<

# bench_http.py runs nginx and wrk (Debian packages) next to dilocod.
BENCH_DEB_PKGS := nginx wrk
bench-deps:
	@missing=""; for p in $(BENCH_DEB_PKGS); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q 'install ok installed' || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "bench-deps: installing$$missing"; \
	  SUDO=; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing; \
	else echo "bench-deps: nginx and wrk present"; fi

bench: all venv bench-deps $(BENCH_BINS)
	$(BUILD)/tests/bench-convert 256
	$(PY) tests/bench/bench_round.py $(BUILD) $(BENCH_SIZES)
	$(PY) tests/bench/bench_async.py $(BUILD) $(BENCH_SIZES)
	$(PY) tests/bench/bench_robust.py $(BUILD) 256
	$(PY) tests/bench/bench_compress.py $(BUILD) 1024
	$(PY) tests/bench/bench_cluster.py $(BUILD) 256
	$(PY) tests/bench/bench_netns.py $(BUILD) 64 || [ $$? -eq 2 ]   # 2: no rights for network namespaces (said why)
	$(PY) tests/bench/bench_http.py $(BUILD)
	$(PY) tests/bench/bench_worker.py $(BUILD) 256

# Soak: 1,000 rounds over HTTP and file:// with the chaos client beside them (tests/integration/test_soak.py);
# prints the descriptor, RSS and state-size curves (CSV under pytest's tmp dir).
SOAK_ROUNDS ?= 1000
soak: all venv
	SOAK_ROUNDS=$(SOAK_ROUNDS) SOAK_PACE=$${SOAK_PACE:-0.15} CHAOS_SECONDS=$${CHAOS_SECONDS:-7200} \
	  DILOCO_BUILD=$(abspath $(BUILD)) $(PY) -m pytest -q -s tests/integration/test_soak.py $(PYTEST_ARGS)

# ---- install (PREFIX, DESTDIR) ------------------------------------------------------------------
PREFIX      ?= /usr/local
BINDIR      ?= $(PREFIX)/bin
SBINDIR     ?= $(PREFIX)/sbin
MANDIR      ?= $(PREFIX)/share/man
SYSCONFDIR  ?= /etc
UNITDIR     ?= /lib/systemd/system
DOCDIR      ?= $(PREFIX)/share/doc/dilocod

install: all
	install -d $(DESTDIR)$(BINDIR) $(DESTDIR)$(SBINDIR) $(DESTDIR)$(MANDIR)/man1 $(DESTDIR)$(MANDIR)/man8 \
	  $(DESTDIR)$(SYSCONFDIR)/dilocod $(DESTDIR)$(UNITDIR) $(DESTDIR)$(DOCDIR)
	install -m 0755 $(BUILD)/dilocod $(DESTDIR)$(SBINDIR)/dilocod
	install -m 0755 $(BUILD)/diloco $(DESTDIR)$(BINDIR)/diloco
	install -m 0644 config/dilocod.conf $(DESTDIR)$(SYSCONFDIR)/dilocod/dilocod.conf
	sed -e 's|@SBINDIR@|$(SBINDIR)|g' -e 's|@SYSCONFDIR@|$(SYSCONFDIR)|g' deploy/dilocod.service \
	  > $(DESTDIR)$(UNITDIR)/dilocod.service && chmod 0644 $(DESTDIR)$(UNITDIR)/dilocod.service
	install -m 0644 deploy/dilocod.8 $(DESTDIR)$(MANDIR)/man8/dilocod.8
	install -m 0644 deploy/diloco.1 $(DESTDIR)$(MANDIR)/man1/diloco.1
	install -m 0644 README.md deploy/nginx-tls.conf $(DESTDIR)$(DOCDIR)/

# ---- demo: a real training through dilocod, with PyTorch workers --------------------------------
DEMO_ROUNDS  ?= 8
DEMO_WORKERS ?= 3
DEMO_PORT    ?= 8470
DEMO_DIR     ?= demo
# DEMO_MODE=async: dilocod --mode async, workers that never wait for each other (and follow DyLU);
# DEMO_SPEEDS=1,1,3: per-worker slowdown factors (empty: all 1), e.g. a straggler three times as slow
DEMO_MODE    ?= sync
DEMO_SPEEDS  ?=
# DEMO_FAULTY=N: worker N sends its delta x 100 (dilocod quarantines it; 0: none)
DEMO_FAULTY  ?= 0
# DEMO_ENCODE=int8_block|mxfp8|mxfp4: compressed deltas (README, "Compressed deltas"); DEMO_EF=0: without
# the workers' error feedback
DEMO_ENCODE  ?=
DEMO_EF      ?= 1
# DEMO_DOWNLINK=mxfp8|mxfp4: dilocod --downlink, the workers replay each step's update (README, "The downlink")
DEMO_DOWNLINK ?=
# more demo.py options, e.g. DEMO_ARGS=--target-loss=0.75 (when the global first reaches that loss)
DEMO_ARGS    ?=
demo: deps
	$(MAKE) venv
	$(MAKE) all
	$(PY) client/examples/demo.py --build $(BUILD) --rounds $(DEMO_ROUNDS) --workers $(DEMO_WORKERS) \
	  --port $(DEMO_PORT) --dir $(DEMO_DIR) --mode $(DEMO_MODE) --speeds '$(DEMO_SPEEDS)' --faulty $(DEMO_FAULTY) \
	  --encode '$(DEMO_ENCODE)' $(if $(filter 0,$(DEMO_EF)),--no-error-feedback) --downlink '$(DEMO_DOWNLINK)' $(DEMO_ARGS)

clean:
	rm -rf build build-* 

distclean: clean
	rm -rf $(VENV)

-include $(shell find $(BUILD) -name '*.d' 2>/dev/null)
