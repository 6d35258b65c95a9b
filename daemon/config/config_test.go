package config

import (
	"encoding/json"
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// The contract's own example (docs/ARCHITECTURE.md, "External contract"), with a target exposure added.
const designExample = `
stateDir: /var/lib/brokkr
runDir: /run/brokkr
bpfDir: /sys/fs/bpf/brokkr
network:
  bridge: brokkr0
  cidr: 10.213.0.1/24
  cidr6: fd00:6272:6b72::1/64
  mtu: 1500
  masquerade: true
  dhcp: true
  isolateGuests: false
hypervisor:
  kind: cloud-hypervisor
  path: ""
  maxConcurrentCreates: 2
vms:
  - name: web
    cpus: 1
    memory: 256M
    kernel: https://example.com/vmlinuz
    kernelSha256: 0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef
    initramfs: /srv/initrd.img
    cmdline: "console=ttyS0"
    disk: {source: /srv/root.img, size: 2G}
    power: running
    restart: always
exposures:
  - name: web-http
    vm: web
    protocol: tcp
    guestPort: 80
    hostPort: 8080
    hostAddress: 0.0.0.0
    mode: auto
    maxConns: 256
  - name: other
    target: 10.213.0.200
    guestPort: 22
    hostPort: 2222
`

func TestDesignExampleParses(t *testing.T) {
	c, err := Parse([]byte(designExample))
	require.NoError(t, err)
	require.Len(t, c.VMs, 1)
	assert.Equal(t, "web", c.VMs[0].Name)
	assert.Equal(t, "2G", c.VMs[0].Disk.Size)
	require.Len(t, c.Exposures, 2)
	assert.Equal(t, "tcp", c.Exposures[1].Protocol, "protocol defaults to tcp")
	assert.Equal(t, "auto", c.Exposures[1].Mode)
	assert.Equal(t, 256, *c.Exposures[1].MaxConns, "maxConns defaults to 256")
	assert.Equal(t, "", c.Exposures[1].HostAddress, "hostAddress defaults to every address of both families")
}

func TestEmptyIsDefaults(t *testing.T) {
	for _, in := range []string{"", "\n", "# only a comment\n", "---\n"} {
		c, err := Parse([]byte(in))
		require.NoError(t, err, "%q", in)
		assert.Equal(t, Defaults(), c)
	}
	d := Defaults()
	assert.Equal(t, "/var/lib/brokkr", d.StateDir)
	assert.Equal(t, "/run/brokkr", d.RunDir)
	assert.Equal(t, "/sys/fs/bpf/brokkr", d.BPFDir)
	assert.Equal(t, "brokkr0", d.Network.Bridge)
	assert.Equal(t, "10.213.0.1/24", d.Network.CIDR)
	assert.Equal(t, "fd00:6272:6b72::1/64", *d.Network.CIDR6)
	assert.Equal(t, 1500, *d.Network.MTU)
	assert.True(t, *d.Network.Masquerade)
	assert.True(t, *d.Network.DHCP)
	assert.Equal(t, "cloud-hypervisor", d.Hypervisor.Kind)
	assert.Equal(t, 2, *d.Hypervisor.MaxConcurrentCreates)
	assert.Empty(t, d.Validate())
}

func TestExplicitZeroIsNotTheDefault(t *testing.T) {
	c, err := Parse([]byte(`
vms: [{name: a, kernel: /k}]
exposures: [{name: e, vm: a, guestPort: 1, hostPort: 1, maxConns: 0}]
hypervisor: {maxConcurrentCreates: 0}
`))
	require.NoError(t, err)
	assert.Equal(t, 0, *c.Exposures[0].MaxConns, "0 means unlimited, not 256")
	assert.Equal(t, 0, *c.Hypervisor.MaxConcurrentCreates)
	assert.Equal(t, 1, *c.VMs[0].CPUs)
	assert.Equal(t, "256M", c.VMs[0].Memory)
	assert.Equal(t, "running", c.VMs[0].Power)
	assert.Equal(t, "always", c.VMs[0].Restart)
}

func TestJSONRoundTrip(t *testing.T) {
	c, err := Parse([]byte(designExample))
	require.NoError(t, err)
	b, err := json.Marshal(c)
	require.NoError(t, err)
	back, err := Parse(b)
	require.NoError(t, err, "the JSON form (desired.json, API bodies) goes through the same parser")
	assert.Equal(t, c, back)

	// IPv4 only ("") is not the default: it survives desired.json.
	c, err = Parse([]byte("network: {cidr6: ''}"))
	require.NoError(t, err)
	b, err = json.Marshal(c)
	require.NoError(t, err)
	back, err = Parse(b)
	require.NoError(t, err)
	assert.Equal(t, "", *back.Network.CIDR6)
}

func errorsOf(t *testing.T, in string) []string {
	t.Helper()
	_, err := Parse([]byte(in))
	require.Error(t, err)
	var es Errors
	require.ErrorAs(t, err, &es)
	out := make([]string, len(es))
	for i, e := range es {
		out[i] = e.Error()
	}
	return out
}

func TestEveryErrorAtOnceWithItsFieldPath(t *testing.T) {
	got := errorsOf(t, `
network: {cidr: 10.213.0.0/24, mtu: 70000}
hypervisor: {kind: firecracker}
vms:
  - name: ok
    kernel: /k
  - name: Bad_Name
    memory: 12Q
    cpus: 0
    kernel: https://x/k
    power: paused
    restart: sometimes
  - name: ok
    kernel: relative/k
    disk: {source: /d, size: lots, sha256: xyz}
exposures:
  - name: a
    vm: ok
    guestPort: 0
    hostPort: 70000
    protocol: sctp
    mode: fast
    maxConns: -1
  - name: b
    vm: ghost
    target: 10.213.0.9
    guestPort: 1
    hostPort: 1
  - name: c
    target: 10.99.0.9
    guestPort: 1
    hostPort: 5
  - guestPort: 1
    hostPort: 2
    vm: ok
    hostAddress: not-an-ip
  - name: this-name-is-far-too-long-for-a-bpf-slot-because-it-goes-on-and-on
    vm: ok
    guestPort: 1
    hostPort: 3
`)
	want := []string{
		`network.cidr: "10.213.0.0/24" is the network address; give the bridge's own address (like 10.213.0.1/24)`,
		`network.mtu: 70000 is out of range (576..65535)`,
		`hypervisor.kind: "firecracker" is not one of cloud-hypervisor, qemu`,
		`vms[1].name: "Bad_Name" must be 1-32 of a-z 0-9 -`,
		`vms[1].cpus: 0 is out of range (1..256)`,
		`vms[1].memory: "12Q" is not a size (like 256M or 2G)`,
		`vms[1].kernelSha256: is required when kernel is a URL`,
		`vms[1].power: "paused" is not one of running, stopped, suspended`,
		`vms[1].restart: "sometimes" is not one of always, on-failure, never`,
		`vms[2].name: "ok" is already the name of vms[0]`,
		`vms[2].kernel: "relative/k" is neither an absolute path nor an http(s) URL`,
		`vms[2].disk.sha256: "xyz" is not a sha256 (64 lower-case hex digits)`,
		`vms[2].disk.size: "lots" is not a size (like 2G)`,
		`exposures[0].protocol: "sctp" is not one of tcp, udp`,
		`exposures[0].guestPort: 0 is out of range (1..65535)`,
		`exposures[0].hostPort: 70000 is out of range (1..65535)`,
		`exposures[0].mode: "fast" is not one of auto, nat, proxy`,
		`exposures[0].maxConns: -1 is negative (0 = unlimited)`,
		`exposures[1]: vm "ghost" and target "10.213.0.9" are both set; give exactly one`,
		`exposures[2].target: "10.99.0.9" is not inside network.cidr 10.213.0.0/24`,
		`exposures[3].name: is required`,
		`exposures[3].hostAddress: "not-an-ip" is not an IP address`,
		`exposures[4].name: "this-name-is-far-too-long-for-a-bpf-slot-because-it-goes-on-and-on" is longer than 63 bytes`,
	}
	assert.Equal(t, want, got)
}

func TestHostPortOverlap(t *testing.T) {
	base := "vms: [{name: a, kernel: /k}]\nexposures:\n"
	ex := func(name, addr, proto string, port int) string {
		return "  - {name: " + name + ", vm: a, guestPort: 1, hostPort: " + itoa(port) + ", hostAddress: " + addr + ", protocol: " + proto + ", mode: proxy}\n"
	}
	cases := []struct {
		name string
		body string
		ok   bool
	}{
		{"same address and port", ex("x", "127.0.0.1", "tcp", 80) + ex("y", "127.0.0.1", "tcp", 80), false},
		{"wildcard overlaps a specific address", ex("x", "0.0.0.0", "tcp", 80) + ex("y", "127.0.0.1", "tcp", 80), false},
		{"specific then wildcard", ex("x", "10.0.0.1", "tcp", 80) + ex("y", "0.0.0.0", "tcp", 80), false},
		{"ipv6 wildcard overlaps ipv6", ex("x", "'::1'", "tcp", 80) + ex("y", "'::'", "tcp", 80), false},
		{"ipv6 wildcard leaves ipv4 alone (IPV6_V6ONLY)", ex("x", "10.0.0.1", "tcp", 80) + ex("y", "'::'", "tcp", 80), true},
		{"every address overlaps ipv4", ex("x", "10.0.0.1", "tcp", 80) + ex("y", "''", "tcp", 80), false},
		{"every address overlaps ipv6", ex("x", "'::1'", "tcp", 80) + ex("y", "''", "tcp", 80), false},
		{"every address by default", ex("x", "'::'", "tcp", 80) + "  - {name: y, vm: a, guestPort: 1, hostPort: 80, mode: proxy}\n", false},
		{"auto on 0.0.0.0 also takes ::1", ex("x", "'::1'", "tcp", 80) + "  - {name: y, vm: a, guestPort: 1, hostPort: 80, mode: auto}\n", false},
		{"different protocols", ex("x", "0.0.0.0", "tcp", 80) + ex("y", "0.0.0.0", "udp", 80), true},
		{"different addresses", ex("x", "127.0.0.1", "tcp", 80) + ex("y", "127.0.0.2", "tcp", 80), true},
		{"different ports", ex("x", "0.0.0.0", "tcp", 80) + ex("y", "0.0.0.0", "tcp", 81), true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Parse([]byte(base + tc.body))
			if tc.ok {
				assert.NoError(t, err)
			} else {
				require.Error(t, err)
				assert.Contains(t, err.Error(), "exposures[1].hostPort: 80/tcp")
				assert.Contains(t, err.Error(), "overlaps exposures[0]")
			}
		})
	}
}

func itoa(i int) string { return strconv.Itoa(i) }

func TestUnknownKeysAndWrongTypesNameTheirField(t *testing.T) {
	got := errorsOf(t, `
network:
  bridge: br0
  colour: blue
vms:
  - name: a
    kernel: /k
    cpus: many
    maxconns: 3
exposures:
  - name: e
    vm: a
    guestPort: "eighty"
    hostPort: 8080
`)
	assert.Equal(t, []string{
		`network.colour: unknown key "colour"`,
		`vms[0].cpus: "many" is not an integer`,
		`vms[0].maxconns: unknown key "maxconns"`,
		`exposures[0].guestPort: "eighty" is not a port or a range of ports (8080, "30000-30099")`,
	}, got)
}

func TestNotYAMLOrNotAMapping(t *testing.T) {
	for in, want := range map[string]string{
		"vms: [":           "not valid YAML",
		"- a\n- b\n":       "must be a mapping",
		"a: 1\n---\nb: 2":  "more than one YAML document",
		"vms: {name: x}\n": "vms: a mapping is not allowed here (a list is expected)",
		"vms:\n  - [1]\n":  "vms[0]: a list is not allowed here (a mapping is expected)",
		"\t\tbad: indent":  "not valid YAML",
	} {
		_, err := Parse([]byte(in))
		require.Error(t, err, in)
		assert.Contains(t, err.Error(), want, in)
	}
}

func TestParseSize(t *testing.T) {
	for in, want := range map[string]int64{"256M": 256 << 20, "2G": 2 << 30, "1048576": 1 << 20, "512K": 512 << 10,
		"1GiB": 1 << 30, "4MB": 4 << 20, "1T": 1 << 40, "10B": 10} {
		got, err := ParseSize(in)
		require.NoError(t, err, in)
		assert.Equal(t, want, got, in)
	}
	for _, in := range []string{"", "12Q", "-1M", "1.5G", "G", "1 G", "99999999999999999999", "17179869184G", "1iB", "1m"} {
		_, err := ParseSize(in)
		assert.Error(t, err, in)
	}
}

func TestOversizedConfig(t *testing.T) {
	_, err := Parse([]byte(strings.Repeat("#", MaxConfigBytes+1)))
	require.Error(t, err)
	assert.Contains(t, err.Error(), "bytes, more than")
}

func FuzzParse(f *testing.F) {
	f.Add([]byte(designExample))
	f.Add([]byte(""))
	f.Add([]byte("vms: [{name: a, kernel: /k, memory: 1G}]"))
	f.Add([]byte(`{"vms":[{"name":"a","kernel":"/k"}],"exposures":[{"name":"e","vm":"a","guestPort":1,"hostPort":2}]}`))
	f.Add([]byte("exposures: [{name: e, target: 10.213.0.9, guestPort: 1, hostPort: 2, hostAddress: '::'}]"))
	f.Add([]byte("network: {cidr: 10.0.0.1/8, mtu: 9000}\nvms:\n - name: x\n   kernel: /k\n   colour: 1\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		c, err := Parse(data)
		if err != nil {
			var es Errors
			if !errorsAs(err, &es) || len(es) == 0 {
				t.Fatalf("error is not a non-empty Errors: %v", err)
			}
			for _, e := range es {
				if e.Msg == "" {
					t.Fatalf("empty message in %v", es)
				}
			}
			return
		}
		// A valid config must stay valid through its JSON form (desired.json).
		if errs := c.Validate(); len(errs) > 0 {
			t.Fatalf("Parse accepted a config Validate rejects: %v", errs)
		}
		b, err := json.Marshal(c)
		if err != nil {
			t.Fatal(err)
		}
		back, err := Parse(b)
		if err != nil {
			t.Fatalf("JSON form of a valid config does not parse: %v\n%s", err, b)
		}
		b2, _ := json.Marshal(back)
		if string(b) != string(b2) {
			t.Fatalf("JSON round trip changed the config:\n%s\n%s", b, b2)
		}
	})
}

func TestShippedExampleIsValid(t *testing.T) {
	b, err := os.ReadFile("../../dist/brokkr.example.yaml")
	require.NoError(t, err)
	c, err := Parse(b)
	require.NoError(t, err)
	assert.Equal(t, Defaults().Network, c.Network, "the example documents the defaults")
	assert.Equal(t, Defaults().Hypervisor, c.Hypervisor)
}

func TestMetricsListen(t *testing.T) {
	c, err := Parse([]byte("metrics: {listen: 127.0.0.1:9464}\n"))
	require.NoError(t, err)
	assert.Equal(t, "127.0.0.1:9464", c.Metrics.Listen)
	assert.Equal(t, "", Defaults().Metrics.Listen, "off by default")
	for in, want := range map[string]string{
		"nowhere":        `metrics.listen: "nowhere" is not host:port (like 127.0.0.1:9464)`,
		"127.0.0.1:0":    `metrics.listen: "127.0.0.1:0": the port must be 1..65535`,
		"127.0.0.1:http": `metrics.listen: "127.0.0.1:http": the port must be 1..65535`,
		"localhost:9464": `metrics.listen: "localhost:9464": the host must be an IP address (or empty for every address)`,
	} {
		assert.Equal(t, []string{want}, errorsOf(t, "metrics: {listen: \""+in+"\"}\n"), in)
	}
	_, err = Parse([]byte("metrics: {listen: \"[::1]:9464\"}\n"))
	assert.NoError(t, err)
}
