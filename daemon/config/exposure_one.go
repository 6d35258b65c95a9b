package config

import (
	"fmt"
	"reflect"
	"slices"
	"strings"

	"go.yaml.in/yaml/v3"
)

// DecodeExposure reads one exposure in the config file's shape (the keys of
// one entry of exposures:, YAML or JSON), for the API's
// PUT /v1/exposures/{name}. Its shape is checked by the same walk as a whole
// file's (unknown keys, wrong types), each error naming its key
// ("guestPort"), and its defaults are filled in as Decode fills them. Its
// values are checked by Compile, against the whole desired state it joins
// (WithExposure).
func DecodeExposure(data []byte) (Exposure, error) {
	doc, err := readDocument(data)
	if err != nil {
		return Exposure{}, err
	}
	if doc == nil {
		return Exposure{}, Errors{{Msg: "no exposure given (one entry of exposures:, like {vm: web, guestPort: 80, hostPort: 8080})"}}
	}
	if doc.Kind != yaml.MappingNode {
		return Exposure{}, Errors{{Msg: fmt.Sprintf("line %d: an exposure must be a mapping (name:, vm:, guestPort:, hostPort:, ...)", doc.Line)}}
	}
	w := &walker{open: map[*yaml.Node]bool{}}
	w.walk(doc, reflect.TypeOf(Exposure{}), nil)
	if len(w.errs) > 0 {
		return Exposure{}, w.errs
	}
	var e Exposure
	if err := doc.Decode(&e); err != nil {
		return Exposure{}, Errors{{Msg: "not valid: " + strings.TrimPrefix(err.Error(), "yaml: ")}}
	}
	// The defaults are the file's, filled by the same code.
	c := &Config{Exposures: []Exposure{e}}
	c.applyDefaults()
	return c.Exposures[0], nil
}

// WithExposure returns a copy of c with e in place of the exposure of the
// same name (replaced), or else appended; pos is where e is in the copy's
// exposures. The copy is a changed desired state: Compile it.
func (c *Config) WithExposure(e Exposure) (next *Config, pos int, replaced bool) {
	cp := *c
	pos = slices.IndexFunc(c.Exposures, func(x Exposure) bool { return x.Name == e.Name })
	if pos >= 0 {
		cp.Exposures = slices.Clone(c.Exposures)
		cp.Exposures[pos] = e
		return &cp, pos, true
	}
	cp.Exposures = make([]Exposure, len(c.Exposures)+1)
	copy(cp.Exposures, c.Exposures)
	cp.Exposures[len(c.Exposures)] = e
	return &cp, len(c.Exposures), false
}

// WithoutExposure returns a copy of c without the named exposure; false
// when there is none. The copy is a changed desired state: Compile it.
func (c *Config) WithoutExposure(name string) (*Config, bool) {
	i := slices.IndexFunc(c.Exposures, func(x Exposure) bool { return x.Name == name })
	if i < 0 {
		return c, false
	}
	cp := *c
	cp.Exposures = slices.Delete(slices.Clone(c.Exposures), i, i+1)
	return &cp, true
}
