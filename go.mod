module github.com/brokkr/brokkr

go 1.26.8

require (
	github.com/cilium/ebpf v0.22.0
	github.com/digitalocean/go-qemu v0.0.0-20250212194115-ee9b0668d242
	github.com/stretchr/testify v1.12.1
	github.com/vishvananda/netlink v1.3.1
	github.com/vishvananda/netns v0.0.5
	go.uber.org/goleak v1.3.0
	golang.org/x/sync v0.25.0
	golang.org/x/sys v0.50.0
)

require (
	github.com/digitalocean/go-libvirt v0.0.0-20220804181439-8648fbde413e // indirect
	go.yaml.in/yaml/v3 v3.0.5 // indirect
)

tool github.com/cilium/ebpf/cmd/bpf2go
