# brokkr — build, test, demo, bench. Every target that touches networking does
# so only inside brk-* network namespaces it creates and removes.
SHELL := /bin/bash
export PATH := /usr/local/go/bin:$(PATH)
GO ?= go
BIN := bin
TEST_TIMEOUT ?= 45m

.PHONY: all build deps test restart-soak soak test-unit vet generate check-generate guest-image bench demo clean clean-ns fuzz bench-fleet demo-fleet test-kernels bench-kernels

all: build

deps:
	@scripts/deps.sh

# --version and brokkr_build_info: git describe and the commit, stamped into
# daemon/api (a plain go build falls back to Go's build info).
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null)
COMMIT ?= $(shell git rev-parse --short=12 HEAD 2>/dev/null)
LDFLAGS := -X github.com/brokkr/brokkr/daemon/api.version=$(VERSION) -X github.com/brokkr/brokkr/daemon/api.commit=$(COMMIT)

build:
	$(GO) build -ldflags "$(LDFLAGS)" -o $(BIN)/ ./cmd/...

# staticcheck and deadcode come from the module proxy at pinned versions
# (go run caches them); deadcode -test fails on functions nothing reaches,
# not even a test.
STATICCHECK ?= honnef.co/go/tools/cmd/staticcheck@v0.8.2
DEADCODE ?= golang.org/x/tools/cmd/deadcode@v0.52.0
vet:
	@test -z "$$(gofmt -l $$(git ls-files '*.go'))" || { gofmt -l $$(git ls-files '*.go'); echo "gofmt: files above need formatting"; exit 1; }
	$(GO) vet ./...
	$(GO) run $(STATICCHECK) ./...
	@out=$$($(GO) run $(DEADCODE) -test ./...); test -z "$$out" || { echo "$$out"; echo "deadcode: the functions above are reached by nothing"; exit 1; }

# vmlinux.h is generated from the running kernel's BTF and committed.
vmlinux.h:
	bpftool btf dump file /sys/kernel/btf/vmlinux format c > $@

# Rebuild the bpf2go outputs (committed, so plain builds need no clang).
generate:
	$(GO) generate ./bpf/...

# Fails when the committed bpf2go outputs are stale (only where clang is present).
check-generate:
	@if command -v clang-14 >/dev/null; then \
		$(GO) generate ./bpf/... && git diff --exit-code -- bpf/ || { echo "bpf2go outputs are stale: run make generate and commit"; exit 1; }; \
	else echo "check-generate: clang-14 not installed, skipped"; fi

# The guest image (kernel from Debian's linux-image-cloud-amd64 + busybox
# initramfs) used by real-VM tests and the demo; cached under .cache/guest.
guest-image:
	@tests/guest/build.sh

# The kernel matrix (tests/kernels/run.sh): Debian's 5.10, 6.1 and 6.12
# cloud kernels booted under QEMU, the kernel-touching tests run in each,
# then on this host; one line per kernel. KERNELS=6.1 runs one. Downloads
# are cached under .cache/kernels (a second run needs no network).
KERNELS ?= 5.10 6.1 6.12
test-kernels: deps
	KERNELS="$(KERNELS)" tests/kernels/run.sh

# bench-kernels: capped brokkr nat against plain nft DNAT and direct, inside
# each kernel's VM (ratios; absolute figures under TCG mean nothing), then on
# this host. BENCH_KERNELS=6.1 by default; ROUNDS, DUR (s) per measurement.
BENCH_KERNELS ?= 6.1
bench-kernels: deps
	BENCH=1 KERNELS="$(BENCH_KERNELS)" tests/kernels/run.sh

clean-ns:
	@scripts/clean-ns.sh

# The README's test command: installs what it needs, then runs everything;
# then the nat path's tests once more on its tc programs (BROKKR_NAT_HOOKS=tc:
# what kernels before 6.4 run, Debian 12's 6.1 among them).
NAT_TC_E2E ?= Nat|KernelMatrix|AllowFrom|Suspend
test: deps vet check-generate guest-image
	@scripts/clean-ns.sh
	$(GO) test -race -count=1 -timeout $(TEST_TIMEOUT) ./... ; rc=$$?; \
	if [ $$rc = 0 ]; then BROKKR_NAT_HOOKS=tc $(GO) test -race -count=1 -timeout $(TEST_TIMEOUT) ./bpf/ ./netplane/ && \
		BROKKR_NAT_HOOKS=tc $(GO) test -race -count=1 -timeout $(TEST_TIMEOUT) -run '$(NAT_TC_E2E)' ./tests/e2e/; rc=$$?; fi; \
	scripts/clean-ns.sh; exit $$rc

# The restart/upgrade/crash soak, long (tests/restart with BROKKR_SOAK=1):
# `make test` runs it short (3 hand-overs, 2 upgrades, 2 SIGKILLs) with the
# upgrade from the previous release. RESTARTS, UPGRADES, KILLS override 20, 5, 5.
restart-soak: build
	BROKKR_SOAK=1 $(GO) test -count=1 -v -timeout 10m ./tests/restart/ ./proxy/ -run 'Restart|Freeze|Thaw'

# The fast lane: pure logic only (no namespaces, no BPF, no QEMU): tests that
# need root skip themselves (internal/nstest.Privileged).
test-unit:
	BROKKR_TEST_UNPRIVILEGED=1 $(GO) test -count=1 -short ./...

# Go 1.27's fuzz coordinator: 1.26's can fail on its own -fuzztime deadline
# with no failing input (golang/go#75804); the go command fetches it from
# the module proxy once.
FUZZ_GO ?= go1.27.3
fuzz:
	@for t in $$(grep -rl '^func Fuzz' --include='*_test.go' . | xargs -n1 dirname | sort -u); do \
		for f in $$(grep -ho '^func Fuzz[A-Za-z0-9_]*' $$t/*_test.go | sed 's/func //'); do \
			GOTOOLCHAIN=$(FUZZ_GO) $(GO) test -run=^$$ -fuzz=^$$f$$ -fuzztime=20s $$t || exit 1; done; done

# The reliability soak (issue 10): faults, load, disk full, bad input,
# permissions, in brk-soak-* namespaces of its own; one figure per line.
# SOAK_MINUTES (20) bounds it; tests/soak/soak.sh lists the other knobs.
soak: deps guest-image
	SOAK_FUZZ_GO=$${SOAK_FUZZ_GO:-$(FUZZ_GO)} tests/soak/soak.sh

bench: deps build guest-image
	@scripts/clean-ns.sh
	tests/bench/run.sh

# Fleet mode at scale: FLEET_NODES brokkrd processes in namespaces of their own
# on a three-member etcd (embedded, in a namespace of its own too); prints the
# BENCH lines BENCHMARKS.md records. Removes only the namespaces it made.
FLEET_NODES ?= 100
bench-fleet: deps
	BROKKR_BENCH_FLEET_NODES=$(FLEET_NODES) $(GO) test -count=1 -timeout 20m -run '^TestBenchFleet$$' -v ./daemon/fleet/ | grep -E 'BENCH|started|^(ok|FAIL|---)'

# Two brokkrd nodes with a guest each on a three-member etcd, one fleet apply,
# calls through both hosts' ports, `brokkr fleet status`; cleans up after itself.
demo-fleet: deps build guest-image
	$(GO) build -o $(BIN)/ ./tests/fleet/etcdrun
	@scripts/demo-fleet.sh

demo: deps build guest-image
	@scripts/demo.sh

clean:
	rm -rf $(BIN)
