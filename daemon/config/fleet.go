package config

import (
	"bytes"
	"fmt"
	"net/url"
	"os"
	"regexp"
	"strings"

	"go.yaml.in/yaml/v3"
)

// Fleet-mode defaults (docs/ARCHITECTURE.md, "External contract"; README "Fleet mode").
const (
	DefaultFleetPrefix = "/brokkr"
	DefaultLeaseTTL    = 10 // seconds
	maxLeaseTTL        = 3600
	// etcd grants no lease shorter than about 1.5 election timeouts; below
	// 2 s a lease could expire between two renewals of a healthy node.
	minLeaseTTL = 2
)

// Fleet is the `fleet:` section: where this node's desired state comes from
// when it is one of many. Absent: single host (file or `brokkr apply`).
type Fleet struct {
	Endpoints []string `yaml:"endpoints" json:"endpoints"`
	Node      string   `yaml:"node" json:"node"`     // default: hostname
	Prefix    string   `yaml:"prefix" json:"prefix"` // default: /brokkr
	CA        string   `yaml:"ca" json:"ca,omitempty"`
	Cert      string   `yaml:"cert" json:"cert,omitempty"`
	Key       string   `yaml:"key" json:"key,omitempty"`
	User      string   `yaml:"user" json:"user,omitempty"`
	Password  string   `yaml:"password" json:"-"`
	LeaseTTL  *int     `yaml:"leaseTTL" json:"leaseTTL"` // seconds the alive key outlives the last renewal
}

// NodeNameRE is what a node name may be: it becomes one etcd key segment
// (and an etcd user name in scripts/fleet-roles.sh), so no '/'.
var NodeNameRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$`)

func (f *Fleet) applyDefaults() {
	if f == nil {
		return
	}
	if f.Node == "" {
		if h, err := os.Hostname(); err == nil {
			f.Node = h
		}
	}
	if f.Prefix == "" {
		f.Prefix = DefaultFleetPrefix
	}
	// One spelling of the prefix, so keys never hold "//".
	if len(f.Prefix) > 1 {
		f.Prefix = strings.TrimRight(f.Prefix, "/")
	}
	if f.LeaseTTL == nil {
		f.LeaseTTL = intp(DefaultLeaseTTL)
	}
}

func (f *Fleet) validate() Errors {
	if f == nil {
		return nil
	}
	var errs Errors
	add := func(path, format string, a ...any) {
		errs = append(errs, FieldError{Path: path, Msg: fmt.Sprintf(format, a...)})
	}
	if len(f.Endpoints) == 0 {
		add("fleet.endpoints", "is required (like [https://10.0.0.5:2379])")
	}
	for i, e := range f.Endpoints {
		u, err := url.Parse(e)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			add(fmt.Sprintf("fleet.endpoints[%d]", i), "%q is not an http:// or https:// URL with a host", e)
		}
	}
	if !NodeNameRE.MatchString(f.Node) {
		add("fleet.node", "%q must be 1-63 of A-Z a-z 0-9 . _ - (starting with a letter or digit)", f.Node)
	}
	if !strings.HasPrefix(f.Prefix, "/") {
		add("fleet.prefix", "%q must start with /", f.Prefix)
	}
	if (f.Cert == "") != (f.Key == "") {
		add("fleet.cert", "cert and key go together (a client certificate needs its key)")
	}
	if f.User != "" && f.Password == "" {
		add("fleet.password", "is required with fleet.user")
	}
	if f.User == "" && f.Password != "" {
		add("fleet.user", "is required with fleet.password")
	}
	if t := *f.LeaseTTL; t < minLeaseTTL || t > maxLeaseTTL {
		add("fleet.leaseTTL", "%d is out of range (%d..%d seconds)", t, minLeaseTTL, maxLeaseTTL)
	}
	return errs
}

// documentKeys are the top-level keys a fleet document may hold: the
// desired state. The rest of a config (directories, hypervisor, fleet) is
// the node's own, fixed when its brokkrd starts.
var documentKeys = map[string]bool{"network": true, "vms": true, "exposures": true}

// ParseDocument parses a node's desired-state document from etcd (YAML or
// JSON): the config schema's network, vms and exposures, validated as a
// whole like a config file, with the same field-named errors.
func ParseDocument(data []byte) (*Config, error) {
	c, err := DecodeDocument(data)
	if err != nil {
		return nil, err
	}
	if errs := c.Validate(); len(errs) > 0 {
		return nil, errs
	}
	return c, nil
}

// DecodeDocument is ParseDocument without the validation of the values:
// for a node that applies the document, whose Apply validates it (Compile)
// together with the node's own keys.
func DecodeDocument(data []byte) (*Config, error) {
	var root yaml.Node
	if err := yaml.NewDecoder(bytes.NewReader(data)).Decode(&root); err == nil {
		doc := &root
		if doc.Kind == yaml.DocumentNode && len(doc.Content) == 1 {
			doc = doc.Content[0]
		}
		if doc.Kind == yaml.MappingNode {
			var errs Errors
			for i := 0; i+1 < len(doc.Content); i += 2 {
				if k := doc.Content[i].Value; !documentKeys[k] {
					errs = append(errs, FieldError{Path: k, Msg: "not allowed in a fleet document (only network, vms, exposures; the rest is the node's own config)"})
				}
			}
			if len(errs) > 0 {
				return nil, errs
			}
		}
	}
	// Decode reports the rest of the shape (syntax, types, unknown keys).
	return Decode(data)
}
