package config

import (
	"fmt"
	"strings"
	"testing"

	"go.yaml.in/yaml/v3"
)

func configWith(n int) []byte {
	var b strings.Builder
	b.WriteString("network: {cidr: 10.0.0.1/16}\nvms:\n")
	vms := max(1, n/10)
	for i := 0; i < vms; i++ {
		fmt.Fprintf(&b, "  - {name: vm-%d, kernel: /k}\n", i)
	}
	b.WriteString("exposures:\n")
	for i := 0; i < n; i++ {
		fmt.Fprintf(&b, "  - {name: e-%d, vm: vm-%d, guestPort: 80, hostPort: %d, mode: nat}\n", i, i%vms, 1+i%65000)
	}
	return []byte(b.String())
}

// BenchmarkParse measures parsing and validating a whole config; compare
// the per-exposure cost at 100 and 10,000 exposures (it should stay flat).
func BenchmarkParse(b *testing.B) {
	for _, n := range []int{100, 10000} {
		data := configWith(n)
		b.Run(fmt.Sprintf("exposures=%d", n), func(b *testing.B) {
			for i := 0; i < b.N; i++ {
				if _, err := Parse(data); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(n), "ns/exposure")
		})
	}
}

// BenchmarkDecode is Decode alone (the YAML parse, the shape check of the
// tree against Config, and the decode into it) of a desired state of
// 100,000 exposures, the most brokkr apply sends.
func BenchmarkDecode(b *testing.B) {
	data := configWith(100000)
	b.SetBytes(int64(len(data)))
	for i := 0; i < b.N; i++ {
		if _, err := Decode(data); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkDecodeJSON is BenchmarkDecode's desired state as a JSON
// document, which jsonNode reads instead of the YAML parser; yaml-parser is
// the same document read by the YAML parser.
func BenchmarkDecodeJSON(b *testing.B) {
	bothReaders(b, func(doc []byte) error { _, err := Decode(doc); return err })
}

// BenchmarkReadDocument is the parse alone of BenchmarkDecodeJSON's
// document: jsonNode, and the YAML parser it replaces for such documents.
func BenchmarkReadDocument(b *testing.B) {
	bothReaders(b, func(doc []byte) error { _, err := readDocument(doc); return err })
}

// bothReaders runs read on a 100,000-exposure JSON document as jsonNode
// reads it (json-reader) and as the YAML parser does (yaml-parser).
func bothReaders(b *testing.B, read func([]byte) error) {
	data := configJSON(100000)
	for _, r := range []struct {
		name string
		doc  []byte
	}{{"json-reader", data}, {"yaml-parser", viaYAMLParser(data)}} {
		b.Run(r.name, func(b *testing.B) {
			b.SetBytes(int64(len(r.doc)))
			b.ReportAllocs()
			for i := 0; i < b.N; i++ {
				if err := read(r.doc); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkReadDocumentYAML is the parse alone of BenchmarkDecodeJSON's
// desired state as yaml.Marshal writes it: yamlBlockNode, and the YAML
// parser it replaces for such documents.
func BenchmarkReadDocumentYAML(b *testing.B) {
	bothYAMLReaders(b, configYAML(100000), func(*yaml.Node) error { return nil })
}

// BenchmarkReadDocumentYAMLFlow is BenchmarkReadDocumentYAML of the
// document BenchmarkApplyToActive (daemon/put_bench_test.go) applies:
// 100,000 exposures, each a flow mapping on a line of its own.
func BenchmarkReadDocumentYAMLFlow(b *testing.B) {
	bothYAMLReaders(b, []byte(applyYAML(100000)), func(*yaml.Node) error { return nil })
}

// BenchmarkDecodeYAML is BenchmarkReadDocumentYAML's parse with the rest
// of Decode after it.
func BenchmarkDecodeYAML(b *testing.B) {
	bothYAMLReaders(b, configYAML(100000), func(doc *yaml.Node) error { _, err := decodeNode(doc); return err })
}

// bothYAMLReaders runs then on data, a 100,000-exposure YAML document, as
// yamlBlockNode reads it (block-reader) and as the YAML parser does
// (yaml-parser).
func bothYAMLReaders(b *testing.B, data []byte, then func(*yaml.Node) error) {
	if _, ok := yamlBlockNode(data); !ok {
		b.Fatal("yamlBlockNode leaves the document to the YAML parser")
	}
	for _, r := range []struct {
		name string
		read func([]byte) (*yaml.Node, error)
	}{{"block-reader", readDocument}, {"yaml-parser", parseYAML}} {
		b.Run(r.name, func(b *testing.B) {
			b.SetBytes(int64(len(data)))
			b.ReportAllocs()
			for i := 0; i < b.N; i++ {
				doc, err := r.read(data)
				if err == nil {
					err = then(doc)
				}
				if err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
