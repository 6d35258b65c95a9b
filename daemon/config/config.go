// Package config parses and validates brokkr's configuration file (docs/ARCHITECTURE.md,
// "External contract"). A config is validated as a whole: every problem is reported at once,
// each naming its field path and value, and nothing is used until the whole
// file is valid.
package config

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"strings"

	"go.yaml.in/yaml/v3"

	"github.com/brokkr/brokkr/internal/spec"
)

// Defaults of the contract (docs/ARCHITECTURE.md, "External contract").
const (
	DefaultStateDir    = "/var/lib/brokkr"
	DefaultRunDir      = "/run/brokkr"
	DefaultBPFDir      = "/sys/fs/bpf/brokkr"
	DefaultBridge      = "brokkr0"
	DefaultCIDR        = "10.213.0.1/24"
	DefaultCIDR6       = "fd00:6272:6b72::1/64" // a fixed ULA: "brkr" in ASCII is its global ID
	DefaultMTU         = 1500
	DefaultHypervisor  = "cloud-hypervisor"
	DefaultMaxCreates  = 2
	DefaultCPUs        = 1
	DefaultMemory      = "256M"
	DefaultCmdline     = "console=ttyS0"
	DefaultPower       = string(spec.PowerRunning)
	DefaultRestart     = string(spec.RestartAlways)
	DefaultProtocol    = string(spec.TCP)
	DefaultHostAddress = "" // every host address of both families
	DefaultMode        = string(spec.ModeAuto)
	DefaultMaxConns    = 256
	MaxExposureNameLen = 63
	HypervisorCHV      = "cloud-hypervisor"
	HypervisorQEMU     = "qemu"
	minMTU, maxMTU     = 576, 65535
	// MaxConfigBytes bounds a config document: a desired state at
	// spec.MaxExposures (131,072 exposures, ~85 bytes each as YAML) is
	// ~11 MB; past 32 MiB a document is a mistake, refused before it is
	// parsed.
	MaxConfigBytes         = 32 << 20
	maxConcurrentCreatesUp = 1024
)

// Config is the whole file. After Parse every optional field holds its
// default, so the rest of the daemon never looks for "unset".
type Config struct {
	StateDir   string     `yaml:"stateDir" json:"stateDir"`
	RunDir     string     `yaml:"runDir" json:"runDir"`
	BPFDir     string     `yaml:"bpfDir" json:"bpfDir"`
	Network    Network    `yaml:"network" json:"network"`
	Hypervisor Hypervisor `yaml:"hypervisor" json:"hypervisor"`
	VMs        []VM       `yaml:"vms" json:"vms"`
	Exposures  []Exposure `yaml:"exposures" json:"exposures"`
	// Fleet is the node agent's etcd section (fleet.go). Process-fixed like
	// the directories, and never persisted in desired.json (json:"-"): it
	// holds the etcd password.
	Fleet   *Fleet  `yaml:"fleet" json:"-"`
	Metrics Metrics `yaml:"metrics" json:"metrics"`
}

// WithPower returns a copy of c with VM name's desired power set; false when
// there is no such VM. The copy is a changed desired state: Compile it.
func (c *Config) WithPower(name string, power spec.Power) (*Config, bool) {
	cp := *c
	cp.VMs = append([]VM(nil), c.VMs...)
	found := false
	for i := range cp.VMs {
		if cp.VMs[i].Name == name {
			cp.VMs[i].Power = string(power)
			found = true
		}
	}
	return &cp, found
}

// Metrics is where else /metrics is served. The listener is opened when
// brokkrd starts, so like stateDir the key is fixed for the process.
type Metrics struct {
	// Listen is a TCP host:port ("127.0.0.1:9464"); empty: only on the
	// API socket.
	Listen string `yaml:"listen" json:"listen"`
}

// Network is the guest network section.
type Network struct {
	Bridge        string  `yaml:"bridge" json:"bridge"`
	CIDR          string  `yaml:"cidr" json:"cidr"`
	CIDR6         *string `yaml:"cidr6" json:"cidr6"` // a pointer: "" (IPv4 only) is not the default
	MTU           *int    `yaml:"mtu" json:"mtu"`
	Masquerade    *bool   `yaml:"masquerade" json:"masquerade"`
	DHCP          *bool   `yaml:"dhcp" json:"dhcp"`
	IsolateGuests bool    `yaml:"isolateGuests" json:"isolateGuests"`
}

// Hypervisor selects and tunes the VMM backend.
type Hypervisor struct {
	Kind                 string `yaml:"kind" json:"kind"`
	Path                 string `yaml:"path" json:"path"`
	MaxConcurrentCreates *int   `yaml:"maxConcurrentCreates" json:"maxConcurrentCreates"`
}

// VM is one guest.
type VM struct {
	Name            string `yaml:"name" json:"name"`
	CPUs            *int   `yaml:"cpus" json:"cpus"`
	Memory          string `yaml:"memory" json:"memory"`
	Kernel          string `yaml:"kernel" json:"kernel"`
	KernelSHA256    string `yaml:"kernelSha256" json:"kernelSha256,omitempty"`
	Initramfs       string `yaml:"initramfs" json:"initramfs,omitempty"`
	InitramfsSHA256 string `yaml:"initramfsSha256" json:"initramfsSha256,omitempty"`
	Cmdline         string `yaml:"cmdline" json:"cmdline"`
	Disk            *Disk  `yaml:"disk" json:"disk,omitempty"`
	Power           string `yaml:"power" json:"power"`
	Restart         string `yaml:"restart" json:"restart"`
	// IdleSuspend is a duration ("10m"); "" or "0" = never (suspend.go).
	IdleSuspend string `yaml:"idleSuspend" json:"idleSuspend,omitempty"`
}

// Disk is a VM's root disk.
type Disk struct {
	Source string `yaml:"source" json:"source"`
	SHA256 string `yaml:"sha256" json:"sha256,omitempty"`
	Size   string `yaml:"size" json:"size,omitempty"`
}

// Exposure is one published guest port.
type Exposure struct {
	Name        string `yaml:"name" json:"name"`
	VM          string `yaml:"vm" json:"vm,omitempty"`
	Target      string `yaml:"target" json:"target,omitempty"`
	Target6     string `yaml:"target6" json:"target6,omitempty"`
	Protocol    string `yaml:"protocol" json:"protocol"`
	GuestPort   Port   `yaml:"guestPort" json:"guestPort"`
	HostPort    Port   `yaml:"hostPort" json:"hostPort"`
	HostAddress string `yaml:"hostAddress" json:"hostAddress"`
	Mode        string `yaml:"mode" json:"mode"`
	MaxConns    *int   `yaml:"maxConns" json:"maxConns"`
	// ProxyProtocol: "" (none), v1 or v2 (spec.ProxyProtocol).
	ProxyProtocol string `yaml:"proxyProtocol" json:"proxyProtocol,omitempty"`
	// AllowFrom: CIDRs (IPv4 or IPv6) whose callers may connect; empty =
	// everyone.
	AllowFrom []string `yaml:"allowFrom" json:"allowFrom,omitempty"`
}

// FieldError is one problem, named by its field path ("vms[1].memory").
type FieldError struct {
	Path string
	Msg  string
}

func (e FieldError) Error() string {
	if e.Path == "" {
		return e.Msg
	}
	return e.Path + ": " + e.Msg
}

// Errors is every problem found in one config, in file order.
type Errors []FieldError

func (es Errors) Error() string {
	lines := make([]string, len(es))
	for i, e := range es {
		lines[i] = e.Error()
	}
	return strings.Join(lines, "\n")
}

// Defaults returns the embedded default config: no VMs, no exposures, the
// contract's directories and network.
func Defaults() *Config {
	c := &Config{}
	c.applyDefaults()
	return c
}

// Parse decodes and validates a config as a whole (Load without the
// model, for callers that need only the file).
func Parse(data []byte) (*Config, error) {
	c, _, err := Load(data)
	return c, err
}

// Load decodes YAML (or JSON, which the YAML decoder reads too) and
// validates it as a whole into the typed model (Compile).
func Load(data []byte) (*Config, *spec.Desired, error) {
	c, err := Decode(data)
	if err != nil {
		return nil, nil, err
	}
	m, errs := Compile(c)
	if len(errs) > 0 {
		return nil, nil, errs
	}
	return c, m, nil
}

// Decode reads a config's shape and fills in its defaults; its values are
// checked by Compile. An empty document is the defaults. Unknown keys are
// errors: a misspelt key ("maxconns") silently falling back to a default is
// exactly the kind of surprise a config file must not hold.
func Decode(data []byte) (*Config, error) {
	doc, err := readDocument(data)
	if err != nil {
		return nil, err
	}
	return decodeNode(doc)
}

// decodeNode is Decode of the document read.
func decodeNode(doc *yaml.Node) (*Config, error) {
	if doc == nil {
		return Defaults(), nil
	}
	if doc.Kind != yaml.MappingNode {
		return nil, Errors{{Msg: fmt.Sprintf("line %d: the config must be a mapping (stateDir:, network:, vms:, ...)", doc.Line)}}
	}

	// Shape errors (unknown keys, wrong types) come from walking the node
	// tree against the Config type, so each carries the path of the node
	// it is about; the decoder's message text is never parsed.
	if errs := checkTree(doc); len(errs) > 0 {
		return nil, errs
	}
	c := &Config{}
	if err := doc.Decode(c); err != nil {
		// checkTree accepts only what decodes; this is a bug in it, not in
		// the file. Report it rather than guess a path.
		return nil, Errors{{Msg: "not valid: " + strings.TrimPrefix(err.Error(), "yaml: ")}}
	}
	c.applyDefaults()
	return c, nil
}

// readDocument reads the one YAML (or JSON) document of data; nil when it
// is empty (or null). jsonNode and yamlBlockNode read the plain documents
// they know, faster; the YAML parser reads the rest.
func readDocument(data []byte) (*yaml.Node, error) {
	if len(data) > MaxConfigBytes {
		return nil, Errors{{Msg: fmt.Sprintf("config is %d bytes, more than the %d allowed", len(data), MaxConfigBytes)}}
	}
	if doc, ok := jsonNode(data); ok {
		return doc, nil
	}
	if doc, ok := yamlBlockNode(data); ok {
		return doc, nil
	}
	return parseYAML(data)
}

// parseYAML is readDocument by the YAML parser, for what the fast paths
// leave to it.
func parseYAML(data []byte) (*yaml.Node, error) {
	var root yaml.Node
	dec := yaml.NewDecoder(bytes.NewReader(data))
	if err := dec.Decode(&root); err != nil {
		if errors.Is(err, io.EOF) {
			return nil, nil
		}
		return nil, Errors{{Msg: "not valid YAML: " + strings.TrimPrefix(err.Error(), "yaml: ")}}
	}
	var extra yaml.Node
	if err := dec.Decode(&extra); !errors.Is(err, io.EOF) {
		return nil, Errors{{Msg: "more than one YAML document; a config is one document"}}
	}
	doc := &root
	if doc.Kind == yaml.DocumentNode && len(doc.Content) == 1 {
		doc = doc.Content[0]
	}
	if doc.Kind == yaml.ScalarNode && doc.Tag == "!!null" {
		return nil, nil
	}
	return doc, nil
}

func intp(v int) *int       { return &v }
func boolp(v bool) *bool    { return &v }
func strp(v string) *string { return &v }

func (c *Config) applyDefaults() {
	def := func(s *string, v string) {
		if *s == "" {
			*s = v
		}
	}
	def(&c.StateDir, DefaultStateDir)
	def(&c.RunDir, DefaultRunDir)
	def(&c.BPFDir, DefaultBPFDir)
	def(&c.Network.Bridge, DefaultBridge)
	def(&c.Network.CIDR, DefaultCIDR)
	if c.Network.CIDR6 == nil {
		c.Network.CIDR6 = strp(DefaultCIDR6)
	}
	if c.Network.MTU == nil {
		c.Network.MTU = intp(DefaultMTU)
	}
	if c.Network.Masquerade == nil {
		c.Network.Masquerade = boolp(true)
	}
	if c.Network.DHCP == nil {
		c.Network.DHCP = boolp(true)
	}
	def(&c.Hypervisor.Kind, DefaultHypervisor)
	if c.Hypervisor.MaxConcurrentCreates == nil {
		c.Hypervisor.MaxConcurrentCreates = intp(DefaultMaxCreates)
	}
	if c.VMs == nil {
		c.VMs = []VM{}
	}
	if c.Exposures == nil {
		c.Exposures = []Exposure{}
	}
	for i := range c.VMs {
		v := &c.VMs[i]
		if v.CPUs == nil {
			v.CPUs = intp(DefaultCPUs)
		}
		def(&v.Memory, DefaultMemory)
		def(&v.Cmdline, DefaultCmdline)
		def(&v.Power, DefaultPower)
		def(&v.Restart, DefaultRestart)
	}
	c.Fleet.applyDefaults()
	for i := range c.Exposures {
		e := &c.Exposures[i]
		def(&e.Protocol, DefaultProtocol)
		def(&e.HostAddress, DefaultHostAddress)
		def(&e.Mode, DefaultMode)
		if e.MaxConns == nil {
			e.MaxConns = intp(DefaultMaxConns)
		}
	}
}
