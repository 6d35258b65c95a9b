module github.com/brokkr/brokkr

go 1.26.8

require (
	github.com/cilium/ebpf v0.22.0
	github.com/stretchr/testify v1.12.1
	github.com/vishvananda/netlink v1.3.1
	github.com/vishvananda/netns v0.0.5
	go.uber.org/goleak v1.3.0
	go.yaml.in/yaml/v3 v3.0.5
	golang.org/x/sys v0.50.0
)

tool github.com/cilium/ebpf/cmd/bpf2go
