package config

import (
	"bytes"
	"errors"
	"io"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.yaml.in/yaml/v3"
)

func TestShapeErrorsFromTheNodeTree(t *testing.T) {
	for in, want := range map[string][]string{
		"network: {dhcp: maybe}\n":          {`network.dhcp: "maybe" is not true or false`},
		"stateDir: {a: 1}\n":                {`stateDir: a mapping is not allowed here (a string is expected)`},
		"network: {mtu: [1]}\n":             {`network.mtu: a list is not allowed here (an integer is expected)`},
		"vms: 3\n":                          {`vms: "3" is not allowed here (a list is expected)`},
		"network: {bridge: a, bridge: b}\n": {`network.bridge: is given twice (lines 1 and 1)`},
		"vms:\n  - name: a\n    kernel: /k\n    disk: {source: /d, colour: red}\n": {`vms[0].disk.colour: unknown key "colour"`},
		"? [a]\n: 1\n":                  {`(top level): a list is not a key (keys are names)`},
		"network: {<<: 3}\n":            {`network: << merges "3"; only a mapping or a list of mappings can be merged`},
		"exposures: [{guestPort: 1.5}]": {`exposures[0].guestPort: "1.5" is not a port or a range of ports (8080, "30000-30099")`},
		"network: {a.b: 1, \"x y\": 2}": {`network["a.b"]: unknown key "a.b"`, `network["x y"]: unknown key "x y"`},
	} {
		assert.Equal(t, want, errorsOf(t, in), in)
	}
}

func TestAnchorsAndMergesAreFollowed(t *testing.T) {
	c, err := Parse([]byte(`
vms:
  - &base {name: a, kernel: /k, cpus: 2}
  - <<: *base
    name: b
    cpus: 3
`))
	require.NoError(t, err, "a merged key overridden is not a duplicate")
	assert.Equal(t, 3, *c.VMs[1].CPUs)
	assert.Equal(t, "/k", c.VMs[1].Kernel)

	got := errorsOf(t, "vms:\n  - &base {name: a, kernel: /k, colour: 1}\n  - *base\n")
	assert.Equal(t, []string{`vms[0].colour: unknown key "colour"`, `vms[1].colour: unknown key "colour"`}, got,
		"an alias is checked where it is used, under that path")
}

func TestAliasExpansionIsBounded(t *testing.T) {
	// A 1 MB name referenced by 200,000 VMs: 200 GB to look at, expanded.
	var b strings.Builder
	b.WriteString("vms:\n  - &v {name: &s " + strings.Repeat("a", 1<<20) + ", kernel: /k}\n")
	for i := 0; i < 200_000; i++ {
		b.WriteString("  - *v\n")
	}
	start := time.Now()
	_, err := Parse([]byte(b.String()))
	assert.Less(t, time.Since(start), 10*time.Second)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "expands to too much through its aliases")
}

// An alias to a node that contains it is an infinite document. Walking it
// once overflowed the stack: a fatal error no recover stops, so one API
// request or etcd document killed brokkrd. (FuzzTreeErrors found it.)
func TestAnAliasCycleIsAnErrorNotACrash(t *testing.T) {
	for _, doc := range []string{
		"vms: [&b {<<: *b, name: b}]\n",
		"vms: [&b {name: x, <<: [*b, *b]}]\n",
		"exposures: &a [{<<: *a}]\n",
		"network: &n {<<: {<<: *n}}\n",
	} {
		_, err := Parse([]byte(doc))
		require.Error(t, err, doc)
		assert.Contains(t, err.Error(), "refers to a node that contains it", doc)
	}
	// The same mapping merged in twice, or into siblings, is no cycle.
	_, err := Parse([]byte("vms: [&b {name: a, kernel: /k}, {<<: [*b, *b], name: c}, {<<: *b, name: d}]\n"))
	if err != nil {
		assert.NotContains(t, err.Error(), "refers to a node that contains it")
	}
}

// lookup follows a path ("vms[1].disk.source") through mappings, merges,
// lists and aliases; it reports whether a node is there.
func lookup(n *yaml.Node, path string) bool {
	if path == "(top level)" || path == "" {
		return true
	}
	steps := regexp.MustCompile(`\["(?:[^"\\]|\\.)*"\]|\[\d+\]|[^.\[\]]+`).FindAllString(path, -1)
	return find(n, steps, 0)
}

func find(n *yaml.Node, steps []string, depth int) bool {
	for n.Kind == yaml.AliasNode {
		n = n.Alias
	}
	if len(steps) == 0 {
		return true
	}
	if depth > 64 {
		return false
	}
	s := steps[0]
	if strings.HasPrefix(s, `["`) {
		s, _ = strconv.Unquote(s[1 : len(s)-1])
	} else if strings.HasPrefix(s, "[") {
		i, _ := strconv.Atoi(s[1 : len(s)-1])
		return n.Kind == yaml.SequenceNode && i < len(n.Content) && find(n.Content[i], steps[1:], depth+1)
	}
	if n.Kind != yaml.MappingNode {
		return false
	}
	for i := 0; i+1 < len(n.Content); i += 2 {
		k := n.Content[i]
		for k.Kind == yaml.AliasNode {
			k = k.Alias
		}
		if k.Tag == "!!merge" {
			v := n.Content[i+1]
			for v.Kind == yaml.AliasNode {
				v = v.Alias
			}
			cands := []*yaml.Node{v}
			if v.Kind == yaml.SequenceNode {
				cands = v.Content
			}
			for _, m := range cands {
				if find(m, steps, depth+1) {
					return true
				}
			}
			continue
		}
		if k.Value == s && find(n.Content[i+1], steps[1:], depth+1) {
			return true
		}
	}
	return false
}

// FuzzTreeErrors checks the walk's two promises on any input: every error
// names a path that is in the document, and a document it accepts decodes
// into a Config (so Parse never falls back to an error without a path).
func FuzzTreeErrors(f *testing.F) {
	f.Add([]byte(designExample))
	f.Add([]byte("network:\n  bridge: br0\n  colour: blue\nvms:\n  - name: a\n    cpus: many\n"))
	f.Add([]byte("vms: [&b {name: a, kernel: /k}, {<<: *b, name: c}]\n"))
	f.Add([]byte("vms: {name: x}\nexposures: [[1]]\nnetwork: {dhcp: maybe, mtu: 1.5}\n"))
	f.Add([]byte(`{"vms":[{"name":"a","cpus":"2"}],"metrics":{"listen":1}}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		dec := yaml.NewDecoder(bytes.NewReader(data))
		var root yaml.Node
		if err := dec.Decode(&root); err != nil {
			if errors.Is(err, io.EOF) {
				return
			}
			return // not YAML: Parse reports it without a path
		}
		doc := &root
		if doc.Kind == yaml.DocumentNode && len(doc.Content) == 1 {
			doc = doc.Content[0]
		}
		errs := checkTree(doc)
		for _, e := range errs {
			if e.Msg == "" {
				t.Fatalf("empty message: %v", errs)
			}
			if e.Path != "" && !lookup(doc, e.Path) {
				t.Fatalf("error %q names a path that is not in the document", e.Error())
			}
		}
		if len(errs) == 0 && doc.Kind == yaml.MappingNode {
			var c Config
			if err := doc.Decode(&c); err != nil {
				t.Fatalf("checkTree accepted what Decode rejects: %v", err)
			}
		}
	})
}
