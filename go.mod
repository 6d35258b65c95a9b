module github.com/brokkr/brokkr

go 1.26.8

require (
	github.com/cilium/ebpf v0.22.0
	github.com/stretchr/testify v1.12.1
	github.com/vishvananda/netlink v1.3.1
	github.com/vishvananda/netns v0.0.5
	go.uber.org/goleak v1.3.0
	golang.org/x/sys v0.50.0
)

require (
	github.com/google/go-cmp v0.7.0 // indirect
	github.com/google/nftables v0.3.0 // indirect
	github.com/mdlayher/netlink v1.7.3-0.20250113171957-fbb4dce95f42 // indirect
	github.com/mdlayher/socket v0.5.1 // indirect
	github.com/pkg/errors v0.9.1 // indirect
	github.com/ti-mo/conntrack v0.6.0 // indirect
	github.com/ti-mo/netfilter v0.5.3 // indirect
	go.yaml.in/yaml/v3 v3.0.5 // indirect
	golang.org/x/net v0.48.0 // indirect
	golang.org/x/sync v0.20.0 // indirect
)

tool github.com/cilium/ebpf/cmd/bpf2go
