package config

import (
	"bytes"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.yaml.in/yaml/v3"
)

// yamlNode is what readDocument made of data before jsonNode: the YAML
// parser's tree, the document node unwrapped.
func yamlNode(data []byte) (*yaml.Node, error) {
	var root yaml.Node
	if err := yaml.NewDecoder(bytes.NewReader(data)).Decode(&root); err != nil {
		return nil, err
	}
	if root.Kind == yaml.DocumentNode && len(root.Content) == 1 {
		return root.Content[0], nil
	}
	return &root, nil
}

// sameTree reports the first place where a and b differ in what checkTree
// and Decode read of a node.
func sameTree(a, b *yaml.Node, path string) error {
	if a.Kind != b.Kind || a.Tag != b.Tag || a.Style != b.Style || a.Value != b.Value ||
		a.Line != b.Line || a.Column != b.Column || a.Anchor != b.Anchor || (a.Alias == nil) != (b.Alias == nil) ||
		len(a.Content) != len(b.Content) {
		return fmt.Errorf("%s: fast reader {kind %d tag %q style %d value %q at %d:%d, %d children} YAML parser {kind %d tag %q style %d value %q at %d:%d, %d children}",
			path, a.Kind, a.Tag, a.Style, a.Value, a.Line, a.Column, len(a.Content), b.Kind, b.Tag, b.Style, b.Value, b.Line, b.Column, len(b.Content))
	}
	for i := range a.Content {
		if err := sameTree(a.Content[i], b.Content[i], fmt.Sprintf("%s/%d", path, i)); err != nil {
			return err
		}
	}
	return nil
}

var jsonSeeds = []string{
	`{}`,
	`{"exposures": []}`,
	"{\n  \"network\": {\"cidr\": \"10.0.0.1/16\", \"mtu\": 1500, \"masquerade\": false, \"cidr6\": null},\n  \"vms\": [{\"name\": \"a\", \"kernel\": \"/k\", \"cpus\": -1}]\n}\n",
	`{"exposures":[{"name":"e","vm":"a","guestPort":80,"hostPort":"30000-30099","maxConns":0}]}`,
	`{"a": {"b": [1, [2, [3]], {"c": true}]}, "a": 0}`,
	`{"x" : 1 , "y":[ ] }`,
	`{"n": 007}`, `{"n": 1.5}`, `{"n": 1e3}`, `{"n": -0}`, `{"n": 1234567890123456789}`,
	`{"s": "tab\there"}`, "{\"s\": \"caf\u00e9\"}", `{"s": "a\"b"}`, `{"s": "#not a comment"}`,
	`{"t": truex}`, `{"t": true}# a comment`, "{\"t\":\ttrue}", `{"k": "v"} {"k": 2}`, `[1]`, `{"a": }`,
	"\r\n{\"a\":\r\n1}\r\n",
}

// Whatever jsonNode takes, the YAML parser takes as the same tree, so
// checkTree and Decode cannot tell which of the two read a document.
func FuzzJSONNodeIsYAMLs(f *testing.F) {
	for _, s := range jsonSeeds {
		f.Add([]byte(s))
	}
	f.Add(configJSON(3))
	f.Fuzz(func(t *testing.T, data []byte) {
		got, ok := jsonNode(data)
		if !ok {
			return
		}
		want, err := yamlNode(data)
		if err != nil {
			t.Fatalf("jsonNode took %q, the YAML parser refuses it: %v", data, err)
		}
		if err := sameTree(got, want, ""); err != nil {
			t.Fatalf("%q: %v", data, err)
		}
	})
}

func TestJSONNodeTakesPlainJSONAndLeavesTheRest(t *testing.T) {
	for _, s := range jsonSeeds {
		got, ok := jsonNode([]byte(s))
		want, err := yamlNode([]byte(s))
		if ok {
			require.NoError(t, err, s)
			require.NoError(t, sameTree(got, want, ""), s)
		}
	}
	for _, s := range []string{`{}`, `{"x" : 1 , "y":[ ] }`, `{"n": -0}`, "\r\n{\"a\":\r\n1}\r\n", `{"a": {"b": [1, [2, [3]], {"c": true}]}, "a": 0}`} {
		_, ok := jsonNode([]byte(s))
		assert.True(t, ok, "plain JSON is read by jsonNode: %s", s)
	}
	for _, s := range []string{`{"n": 1.5}`, `{"n": 1e3}`, `{"n": 007}`, `{"s": "a\"b"}`, "{\"s\": \"caf\u00e9\"}", `{"t": truex}`,
		`{"t": true}# a comment`, "{\"t\":\ttrue}", `{"k": "v"} {"k": 2}`, `[1]`, `{"a": }`, `{"n": 1234567890123456789}`} {
		_, ok := jsonNode([]byte(s))
		assert.False(t, ok, "left to the YAML parser: %s", s)
	}
}

// A JSON config decodes as it did through the YAML parser: the same Config,
// the same errors (a key given twice, an unknown key, a wrong type, with
// their lines).
func TestJSONConfigDecodesAsYAMLDid(t *testing.T) {
	docs := []string{
		string(configJSON(20)),
		`{"network": {"cidr": "10.0.0.1/16"}, "vms": [{"name": "a", "kernel": "/k"}], "exposures": [{"name": "e", "vm": "a", "guestPort": 80, "hostPort": 8080, "allowFrom": ["10.0.0.0/8"]}]}`,
		`{"network": {"cidr": "10.0.0.1/16", "cidr": "10.1.0.1/16"}}`,
		"{\n\"network\": {\"cdir\": \"10.0.0.1/16\"}}",
		`{"vms": [{"name": "a", "kernel": "/k", "cpus": "two"}]}`,
		`{"exposures": [{"name": "e", "hostPort": true}]}`,
		`{"stateDir": null}`,
	}
	decodesAsTheParser(t, jsonNode, docs)
}

// decodesAsTheParser requires fast to take every document of docs, and
// Decode (which then reads them with it) to make the same Config, or the
// same error, as the YAML parser's path alone.
func decodesAsTheParser(t *testing.T, fast func([]byte) (*yaml.Node, bool), docs []string) {
	t.Helper()
	slow := func(data []byte) (*Config, error) {
		doc, err := parseYAML(data)
		if err != nil {
			return nil, err
		}
		return decodeNode(doc)
	}
	for _, d := range docs {
		_, ok := fast([]byte(d))
		require.True(t, ok, "the fast path reads %s", d)
		got, gotErr := Decode([]byte(d))
		want, wantErr := slow([]byte(d))
		if wantErr != nil {
			require.Error(t, gotErr, d)
			assert.Equal(t, wantErr.Error(), gotErr.Error(), d)
			continue
		}
		require.NoError(t, gotErr, d)
		assert.Equal(t, want, got, d)
	}
}

func configJSON(n int) []byte {
	b, err := json.MarshalIndent(configDoc(n), "", " ")
	if err != nil {
		panic(err)
	}
	return b
}

// configYAML is configJSON's document as yaml.Marshal writes it
// (TestConfigYAMLIsYAMLMarshals), written here directly: yaml.Marshal of
// 100,000 exposures takes seconds, tens of them under -race.
func configYAML(n int) []byte {
	var b strings.Builder
	b.WriteString("network:\n    cidr: 10.0.0.1/16\nvms:\n")
	vms := max(1, n/10)
	for i := 0; i < vms; i++ {
		fmt.Fprintf(&b, "    - name: vm-%d\n      kernel: /k\n", i)
	}
	b.WriteString("exposures:\n")
	for i := 0; i < n; i++ {
		fmt.Fprintf(&b, "    - name: e-%d\n      vm: vm-%d\n      guestPort: 80\n      hostPort: %d\n      mode: nat\n", i, i%vms, 1+i%65000)
	}
	return []byte(b.String())
}

func TestConfigYAMLIsYAMLMarshals(t *testing.T) {
	for _, n := range []int{1, 25} {
		want, err := yaml.Marshal(configDoc(n))
		require.NoError(t, err)
		assert.Equal(t, string(want), string(configYAML(n)))
	}
}

// configDoc is a desired state of n exposures, to be marshalled.
func configDoc(n int) any {
	type vm struct {
		Name   string `json:"name" yaml:"name"`
		Kernel string `json:"kernel" yaml:"kernel"`
	}
	type exp struct {
		Name      string `json:"name" yaml:"name"`
		VM        string `json:"vm" yaml:"vm"`
		GuestPort int    `json:"guestPort" yaml:"guestPort"`
		HostPort  int    `json:"hostPort" yaml:"hostPort"`
		Mode      string `json:"mode" yaml:"mode"`
	}
	doc := struct {
		Network   map[string]string `json:"network" yaml:"network"`
		VMs       []vm              `json:"vms" yaml:"vms"`
		Exposures []exp             `json:"exposures" yaml:"exposures"`
	}{Network: map[string]string{"cidr": "10.0.0.1/16"}}
	vms := max(1, n/10)
	for i := 0; i < vms; i++ {
		doc.VMs = append(doc.VMs, vm{fmt.Sprintf("vm-%d", i), "/k"})
	}
	for i := 0; i < n; i++ {
		doc.Exposures = append(doc.Exposures, exp{fmt.Sprintf("e-%d", i), fmt.Sprintf("vm-%d", i%vms), 80, 1 + i%65000, "nat"})
	}
	return doc
}

// viaYAMLParser is doc with a comment after it: jsonNode leaves it to the
// YAML parser, which reads the same document, its lines unchanged.
func viaYAMLParser(doc []byte) []byte { return append(slices.Clip(doc), "\n# yaml"...) }
