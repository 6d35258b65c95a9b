# brokkr — build, test, demo, bench. Every target that touches networking does
# so only inside brk-* network namespaces it creates and removes.
SHELL := /bin/bash
export PATH := /usr/local/go/bin:$(PATH)
GO ?= go
BIN := bin
TEST_TIMEOUT ?= 45m

.PHONY: all build deps test test-unit vet generate check-generate guest-image bench demo clean clean-ns fuzz soak

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

vet:
	@test -z "$$(gofmt -l $$(git ls-files '*.go'))" || { gofmt -l $$(git ls-files '*.go'); echo "gofmt: files above need formatting"; exit 1; }
	$(GO) vet ./...

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

clean-ns:
	@scripts/clean-ns.sh

# The README's test command: installs what it needs, then runs everything.
test: deps vet check-generate guest-image
	@scripts/clean-ns.sh
	$(GO) test -race -count=1 -timeout $(TEST_TIMEOUT) ./... ; rc=$$?; scripts/clean-ns.sh; exit $$rc

test-unit:
	$(GO) test -race -count=1 -short ./...

fuzz:
	@for t in $$(grep -rl '^func Fuzz' --include='*_test.go' . | xargs -n1 dirname | sort -u); do \
		for f in $$(grep -ho '^func Fuzz[A-Za-z0-9_]*' $$t/*_test.go | sed 's/func //'); do \
			$(GO) test -run=^$$ -fuzz=^$$f$$ -fuzztime=20s $$t || exit 1; done; done

# The reliability soak (issue 10): faults, load, disk full, bad input,
# permissions, in brk-soak-* namespaces of its own; one figure per line.
# SOAK_MINUTES (20) bounds it; tests/soak/soak.sh lists the other knobs.
soak: deps
	tests/soak/soak.sh

bench: deps build guest-image
	@scripts/clean-ns.sh
	tests/bench/run.sh

demo: deps build guest-image
	@scripts/demo.sh

clean:
	rm -rf $(BIN)
