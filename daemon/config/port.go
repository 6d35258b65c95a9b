package config

import (
	"encoding/json"
	"errors"
	"strconv"
	"strings"

	"go.yaml.in/yaml/v3"
)

// Port is a hostPort or guestPort: one port (an integer, 8080) or a range
// of ports (a string "first-last", "30000-30099"), one exposure across all
// of it. A string holding one integer is that port. Its values are checked
// by Compile (1..65535, first ≤ last, spec.MaxPortRange); what Decode
// refuses is only what is neither.
type Port struct {
	First int
	Last  int // 0: a single port (First)
}

// P is the single port n.
func P(n int) Port { return Port{First: n} }

// Range is the ports first to last.
func Range(first, last int) Port { return Port{First: first, Last: last} }

// IsRange reports whether p was written as a range ("8080-8080" is one,
// of one port).
func (p Port) IsRange() bool { return p.Last != 0 }

// String is p as the config writes it.
func (p Port) String() string {
	if p.IsRange() {
		return strconv.Itoa(p.First) + "-" + strconv.Itoa(p.Last)
	}
	return strconv.Itoa(p.First)
}

// quoted is p as messages name it: an integer as it is, a range quoted.
func (p Port) quoted() string {
	if p.IsRange() {
		return strconv.Quote(p.String())
	}
	return p.String()
}

var errPort = errors.New(`not a port or a range of ports (8080, "30000-30099")`)

// parsePort reads a string: "8080" or "30000-30099" (digits only).
func parsePort(s string) (Port, error) {
	digits := func(x string) (int, bool) {
		if x == "" || len(x) > 5 || strings.TrimLeft(x, "0123456789") != "" {
			return 0, false
		}
		n, err := strconv.Atoi(x)
		return n, err == nil
	}
	a, b, isRange := strings.Cut(strings.TrimSpace(s), "-")
	first, ok := digits(strings.TrimSpace(a))
	if !ok {
		return Port{}, errPort
	}
	if !isRange {
		return P(first), nil
	}
	last, ok := digits(strings.TrimSpace(b))
	if !ok || last == 0 {
		return Port{}, errPort
	}
	return Range(first, last), nil
}

// UnmarshalYAML takes an integer or a string.
func (p *Port) UnmarshalYAML(n *yaml.Node) error {
	if n.Kind != yaml.ScalarNode {
		return errPort
	}
	switch n.ShortTag() {
	case "!!int":
		var v int
		if err := n.Decode(&v); err != nil {
			return errPort
		}
		*p = P(v)
		return nil
	case "!!str":
		v, err := parsePort(n.Value)
		if err != nil {
			return err
		}
		*p = v
		return nil
	}
	return errPort
}

// MarshalYAML writes a single port as an integer, a range as a string.
func (p Port) MarshalYAML() (any, error) {
	if p.IsRange() {
		return p.String(), nil
	}
	return p.First, nil
}

// MarshalJSON writes a single port as a number (what desired.json always
// held), a range as a string.
func (p Port) MarshalJSON() ([]byte, error) {
	if p.IsRange() {
		return json.Marshal(p.String())
	}
	return json.Marshal(p.First)
}

// UnmarshalJSON takes a number or a string.
func (p *Port) UnmarshalJSON(b []byte) error {
	var n int
	if err := json.Unmarshal(b, &n); err == nil {
		*p = P(n)
		return nil
	}
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		return errPort
	}
	v, err := parsePort(s)
	if err != nil {
		return err
	}
	*p = v
	return nil
}
