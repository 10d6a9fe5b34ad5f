# kvpool: the commands a user types. Each one installs missing Debian packages first
# (scripts/install-deps.sh, a no-op when all is present), configures and builds with CMake
# (Release), then acts.
BUILD ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=

.PHONY: all deps configure build run test bench-cpu format clean

all: build

deps:
	@./scripts/install-deps.sh

$(BUILD)/CMakeCache.txt: | deps
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS)

configure: deps $(BUILD)/CMakeCache.txt

build: configure
	cmake --build $(BUILD) -j $(JOBS)

run: build
	$(BUILD)/bin/kvpool-codec-demo

test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) --timeout 900

bench-cpu: build
	@mkdir -p bench-results
	$(BUILD)/bin/kvpool-bench-cpu --out bench-results/cpu.json

format:
	find kernels server client tests calibration -name '*.h' -o -name '*.cc' -o -name '*.cu' -o -name '*.cuh' | xargs clang-format -i

clean:
	rm -rf $(BUILD)
