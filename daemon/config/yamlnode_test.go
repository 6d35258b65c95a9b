package config

import (
	"fmt"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.yaml.in/yaml/v3"
)

// yamlTaken are documents yamlBlockNode reads; yamlLeft are documents it
// leaves to the YAML parser. Both seed FuzzYAMLBlockNodeIsYAMLs.
var yamlTaken = []string{
	"a: 1\n",
	"a: 1",
	"---\na: b\n",
	"  a: 1\n  b:\n",
	"a:\nb: 1\n",
	"a:",
	"a:   \n",
	"a:  # c\nb: 1",
	"a:\n- x\n-\n- \n-   # c\nb: 1",
	"a:\n  - x\n  -\n",
	"a:\n -   b: 1\n     c: 2\n",
	"x:\n- k:\n  - a\n  - b\n- c: d\n  e: []\n  f: {}\n- k:\n- l: 1\n",
	"a:\n  -\n    b: 1\n  -\n    - c\n    - d\n",
	"a: b   \nc: 'x'  # q\n",
	"a: 1\n  # c\n\n",
	"# c\n\n  # d\na:\n  # e\n  b: x y  z\n# f\n",
	"s: \"quoted # not a comment\"\nt: 'single \"x\"'\nu: \"\"\nv: ''\n\"k\": 1\n'l': 2\n",
	"nil: null\nyea: true\nnay: false\ni: -12\nz: 0\nm: -0\nbig: 123456789012345678\ntrue: 1\nnull: 2\n",
	"cidr: 10.0.0.1/16\naddr: 127.0.0.1\nlisten: 127.0.0.1:9464\nmem: 256M\nports: 30000-30099\nv6: fd00::1/64\nsha: 0123456789abcdef\n",
	"url: https://example.com/a/b\npath: /var/lib/x\ncmd: console=ttyS0 reboot=k\nrestart: on-failure\nk: a:b\n",
	"words: yesterday\nnow: Nope\ntrue love: 1\nnull-ish: nullable\n",
	"a: b # caf\u00e9 \u2014 \u2264 60\n# \U0001F600\n",
	"a: x,y[z]{w}\n",
	"a: b\nb:\n  c:\n    d:\n      e: []\n",
	"a: #c\n- b\n", "a:\n- 'k': v\n  \"l\": w\n- \"m\":\n  - x\n", strings.Repeat("k", 256) + ": v\n",
	"a:\n# c\n- b\n", "a:\n  # c\n- b\n", "a:\n- b\n# c\n- c\n", "a:\n  - b\n# c\n  - c\n",
	"a:\n  b: 1\n# c\nd: 2\n", "a: 1 # c\n# d\n  # e\nb: 2\n", "x:\n- a: 1 # c\n  b: 2\n",
	"a:\n-\n  # c\n  b: 1\n", "a:   # c\n\n\n  b: 1\n", "a:   \n  b: 1", "a: 'x'   \n", "a: 'x' # c\n",
	"a b: c", "a  b: c", "a: b    c", "a: b \n", "a:b: c", "a: b:c", "a: http://x", "'a: b': c",
	"a: -1", "a: 1-", "a: 1:2", "a: 0:1", "a: 1/2", "a: 1..2", "a: 1.2.3", "a: 1-2-3", "a: 12345-6",
	"a: 0b1-1", "a: 1E5x", "a: 0e1a", "a: 8.8.8.8\n", "a: 1:2:3\n", "a: 10:10\n",
	"a: b\n\n\n", "a:\n\n- b", "# c\n---\na: 1", "a:\n- b:\n  - c\n  d: 1\n",
	"a:\n  - b: 1\n    c:\n    - d\n    e: f\n  - g\n", "a: [] # c\n",
	"-1: a\n-2:\n- 3\n",
	// Flow collections of scalars on one line.
	"a: [b]\n", "a: {b: c}\n", "a: [ ]\n", "a: { }\n", "a: [  ]  # c\n",
	"exposures:\n  - {name: e-1, target: 10.213.0.250, guestPort: 80, hostAddress: 10.99.0.1, hostPort: 30001, mode: nat}\n",
	"allowFrom: [10.0.0.0/8, 192.168.1.0/24]\nports: [80, 443]\n",
	"endpoints: [https://10.0.0.5:2379, https://10.0.0.6:2379]\n", "a: [fd00::/8, 1:2, a:b, a::b]\n", "a: {k: a:b, l: http://x}\n",
	"a: {a: b,c: d}\n", "a: { a: b }\n", "a: {a: b} # c\n", "a: {\"a\": 1}\n", "a: {'a': 1}\n", "a: {a: b, a: c}\n",
	"a: [a b, c  d ,e]\n", "a: [ a ,  b ]\n", "a: ['x, y', \"]\", 'z}']\n", "a: [null, true, false, -1, 0, x]\n",
	"a: {null: true, 1: -2}\n", "a: [b :c]\n", "a: [a!b, c&d, e*f, g|h, i>j, k%l, m@n, o`p, q\"r, s'u]\n",
	"a:\n- [b, c]\n- {d: e}\n- []\n-   {}   # c\n- f\n", "a:\n  - {b: c, d: e}\n  - [1]\nb: [x] # caf\u00e9\n",
	"a: {b: c}\nb:\n  c: [d]\n  e: {f: g}\n",
	"a: [a:, b:]\n", "a: [a:]\n", "a: {a: b:}\n", "a: {a: 1:, b: c}\n", "a: [a :b, a:b:c]\n",
}

var yamlLeft = []string{
	"", "\n", "# only\n", "---\n", "---", "- a\n", "a\n", "[a]\n", "{a: 1}\n",
	"a: yes\n", "a: No\n", "a: ON\n", "a: off\n", "a: y\n", "a: N\n", "a: True\n", "a: FALSE\n", "a: Null\n", "a: NULL\n", "a: ~\n",
	"a: 0x1F\n", "a: 0o17\n", "a: 017\n", "a: 08\n", "a: 1_000\n", "a: 1e3\n", "a: .5\n", "a: -.inf\n", "a: .nan\n", "a: +1\n",
	"a: 1.5\n", "a: 2001-12-14\n", "a: 2001-12-14t21:59:43.10-05:00\n", "a: 1234567890123456789\n", "a: 0e1\n", "a: -x\n",
	"<<: {}\n", "a: <<\n", "a: b: c\n", "a : b\n", "a:b\n", "a: b\n  c\n", "a: b\n\n  c\n", "a:\n  b\n",
	"a: 'it''s'\n", "a: \"tab\\t\"\n", "a: \"multi\n  line\"\n", "a: 'x\n", "a: |\n  x\n", "a: >\n  x\n",
	"a: &x 1\nb: *x\n", "a: !!str 1\n", "? a\n: b\n", "%YAML 1.2\n---\na: 1\n", "a: 1\n---\nb: 2\n", "a: 1\n...\n",
	"a:\tb\n", "\ta: b\n", "a: b\r\n", "a: b\rc: d\n", "a: caf\u00e9\n", "\ufeffa: b\n",
	"a: b#c\n", "a: b #c\u2028d: e\n", "a: b #\xff\n", "a:\n  b: 1\n c: 2\n", "a: 1\n b: 2\n",
	"a:\n  - b\n  c: 1\n", "a:\n- b\n- c\n- d: 1\n  e: 2\n   f: 3\n",
	"a: -\n", "a: - b\n", "a:\n  -b\n", "- a: 1\n", "a:\n- - b\n",
	"a: b\n---\n", "a: \"b\"c\n", "a: \"b\":\n", "a: [] x\n",
	"a: \"x\"#c\n", "a: 1:", "a: 1234-5", "a: 0x1:", "a: 0b-1", "a: 0o-7", "a: 1e-5", "a: 'x'y", "a: b\n...\n",
	"a: {}\n- b\n", strings.Repeat("k", 1025) + ": v\n", "  a: 1\nb: 2\n", "  a: 1\n b: 2\n", "  a:\n  - b\n - c\n",
	"a: 9999999999999999999\n", "a: 1.\n", "a: 1.e5\n",
	// Flow collections the subset leaves to the parser.
	"a: {a: [b]}\n", "a: [a, {b: c}]\n", "a: [[]]\n", "a: {a: {}}\n", "a: {a: b}x\n", "a: [a, b]]\n", "a: [a b: c]\n",
	"a: [a: b]\n", "a: [\"a\": b]\n", "a: [\"a\":b]\n", "a: {\"a\":b}\n", "a: {a:b}\n", "a: {a :b}\n", "a: {a : b}\n",
	"a: [-1, 0x1, 1e3, yes, ~]\n", "a: [0x1]\n", "a: [1e3]\n", "a: [yes]\n", "a: [~]\n", "a: [-x]\n",
	"a: [a, b,]\n", "a: {a: 1,}\n", "a: [a,,b]\n", "a: [,a]\n", "a: {a}\n", "a: {a: }\n", "a: {a:}\n", "a: {a, b: c}\n",
	"a: {? a: b}\n", "a: [? a]\n", "a: [a?b]\n", "a: {a: b?c}\n", "a: {a: b: c}\n",
	"a: [a, # c\n  b]\n", "a: [a,\n  b]\n", "a: {a: b,\n  c: d}\n", "a: [a\n", "a: [a\n]\n", "a: [a #c]\n", "a: [a]#c\n",
	"a: [caf\u00e9]\n", "a: ['caf\u00e9']\n", "a: [a\tb]\n", "a: [\ta]\n", "a: [a]: b\n", "- [a]: b\n", "a:\n- [a]: b\n", "[a]: b\n",
	"a: [&x a, *x]\n", "a: [!!str a]\n", "a: ['it''s']\n", "a: [\"a\\\"b\"]\n", "a: ['a'b]\n", "a: [<<]\n", "a: {<<: b}\n",
	"a: [- a]\n", "a: [-]\n", "a: [a] [b]\n", "a: [a], [b]\n", "a: [a]\n  b\n",
}

// Whatever yamlBlockNode takes, the YAML parser takes as the same tree, so
// checkTree and Decode cannot tell which of the two read a document.
func FuzzYAMLBlockNodeIsYAMLs(f *testing.F) {
	for _, s := range append(append([]string(nil), yamlTaken...), yamlLeft...) {
		f.Add([]byte(s))
	}
	for _, d := range repoYAML(f) {
		f.Add(d)
	}
	f.Add(configYAML(3))
	f.Add([]byte(designExample))
	f.Add([]byte(applyYAML(3)))
	f.Add(configWith(3))
	f.Add([]byte(allowFromYAML))
	f.Fuzz(func(t *testing.T, data []byte) {
		got, ok := yamlBlockNode(data)
		if !ok {
			return
		}
		if err := sameAsParser(got, data); err != nil {
			t.Fatal(err)
		}
	})
}

// sameAsParser reports how got, yamlBlockNode's tree of data, differs from
// what readDocument made of data before it: the YAML parser's tree, or its
// error (a second document, for one).
func sameAsParser(got *yaml.Node, data []byte) error {
	want, err := parseYAML(data)
	if err != nil {
		return fmt.Errorf("yamlBlockNode took %q, the YAML parser refuses it: %v", data, err)
	}
	if want == nil {
		return fmt.Errorf("yamlBlockNode took %q, the YAML parser reads it as empty", data)
	}
	if err := sameTree(got, want, ""); err != nil {
		return fmt.Errorf("%q: %v", data, err)
	}
	return nil
}

// Every document of up to three lines of these shapes at these
// indentations (and of four lines of fewer shapes; and of three lines of
// flow collections among block lines), which is most of the ways the
// subset's lines can follow each other: what yamlBlockNode takes
// of them, the YAML parser takes as the same tree.
func TestYAMLBlockNodeSmallDocuments(t *testing.T) {
	var taken int
	each := func(shapes, indents []string, lines int) {
		var all []string
		for _, in := range indents {
			for _, sh := range shapes {
				all = append(all, in+sh)
			}
		}
		var fill func(doc []byte, lines int)
		fill = func(doc []byte, lines int) {
			for _, l := range all {
				d := append(append(slices.Clip(doc), l...), '\n')
				if got, ok := yamlBlockNode(d); ok {
					taken++
					require.NoError(t, sameAsParser(got, d))
				}
				if lines > 1 {
					fill(d, lines-1)
				}
			}
		}
		fill(nil, lines)
	}
	each([]string{"a:", "a: b", "b: c # x", "c: d e", "a: 1", "a: []", "'a': \"b\"", "a:b", "---", "# c", "",
		"- a", "- a:", "- a: b", "-", "- - a", "- 'k':", "- {}"}, []string{"", " ", "  ", "    "}, 3)
	each([]string{"a:", "a: b", "- a", "- a:", "- a: b", "-", "# c", ""}, []string{"", "  ", "    "}, 4)
	each([]string{"a:", "a: b", "- a", "- a:", "-", "a: [b]", "a: {b: c}", "a: [ ]", "b: {'c': d, e: f} # x", "- [a, 'b']",
		"- {a: b}", "- {a: [b]}", "a: [b :c]", "a: [b, c", "a: {b: c}:"}, []string{"", " ", "  ", "    "}, 3)
	assert.Greater(t, taken, 45000, "documents taken")
}

// Every flow collection after a key of up to five of these pieces after
// its '[' or '{': most of the ways the bytes that matter in a flow
// collection can follow each other.
func TestYAMLBlockNodeSmallFlows(t *testing.T) {
	pieces := []string{"a", "1", " ", ",", ":", "]", "}", "'b'", " #", "?", "-", "[", "\n"}
	var taken int
	var fill func(doc []byte, n int)
	fill = func(doc []byte, n int) {
		for _, p := range pieces {
			d := append(slices.Clip(doc), p...)
			if got, ok := yamlBlockNode(d); ok {
				taken++
				require.NoError(t, sameAsParser(got, d))
			}
			if n > 1 {
				fill(d, n-1)
			}
		}
	}
	fill([]byte("k: ["), 5)
	fill([]byte("k: {"), 5)
	assert.Greater(t, taken, 7000, "flow collections taken")
}

// repoYAML is the repository's YAML: the example config, the example
// alerting rules, the config snippets of the README.
func repoYAML(t testing.TB) [][]byte {
	var docs [][]byte
	for _, f := range []string{"../../dist/brokkr.example.yaml", "../../dist/brokkr.rules.yml", "../../dist/brokkr.rules.test.yml"} {
		b, err := os.ReadFile(f)
		require.NoError(t, err)
		docs = append(docs, b)
	}
	readme, err := os.ReadFile("../../README.md")
	require.NoError(t, err)
	for _, m := range regexp.MustCompile("(?s)```yaml\n(.*?)```").FindAllSubmatch(readme, -1) {
		docs = append(docs, m[1])
	}
	return docs
}

func TestYAMLBlockNodeTakesPlainBlocksAndLeavesTheRest(t *testing.T) {
	for _, s := range yamlTaken {
		got, ok := yamlBlockNode([]byte(s))
		require.True(t, ok, "yamlBlockNode reads %q", s)
		require.NoError(t, sameAsParser(got, []byte(s)))
	}
	for _, s := range yamlLeft {
		_, ok := yamlBlockNode([]byte(s))
		assert.False(t, ok, "left to the YAML parser: %q", s)
	}
}

// The fast path reads the documents it is for: a generated desired state
// (yaml.Marshal's), and the repository's hand-written YAML.
func TestYAMLBlockNodeTakesConfigs(t *testing.T) {
	_, ok := yamlBlockNode(configYAML(100000))
	require.True(t, ok, "yamlBlockNode reads yaml.Marshal's document of 100,000 exposures")
	data := configYAML(1000) // the same lines, fewer: the YAML parser is slow
	got, ok := yamlBlockNode(data)
	require.True(t, ok)
	require.NoError(t, sameAsParser(got, data))

	example, err := os.ReadFile("../../dist/brokkr.example.yaml")
	require.NoError(t, err)
	// Its placeholder kernelSha256 of 64 zeros is an octal integer to the
	// YAML parser (0), which the fast path leaves to it; a real digest has
	// a letter in it, which makes it a string.
	_, ok = yamlBlockNode(example)
	assert.False(t, ok, "the example's all-zero digest is left to the YAML parser")
	example = []byte(strings.Replace(string(example), "kernelSha256: 00000000", "kernelSha256: 0a000000", 1))
	_, ok = yamlBlockNode(example)
	assert.True(t, ok, "yamlBlockNode reads the example config")
	takes := func(doc []byte, what string) {
		t.Helper()
		got, ok := yamlBlockNode(doc)
		if assert.True(t, ok, "yamlBlockNode reads %s", what) {
			assert.NoError(t, sameAsParser(got, doc), what)
		}
	}
	takes([]byte(designExample), "the design example (disk: {source: /srv/root.img, size: 2G})")
	repo := repoYAML(t)
	takes(repo[1], "the example alerting rules")
	takes(repo[2], "the rules' tests (exp_labels: {severity: warning, ...})")
	for _, r := range repo[3:] {
		takes(r, "the README's snippet (fleet: endpoints: [https://10.0.0.5:2379, ...])")
	}
}

// The fast path reads the flow forms desired states are written in: the
// document BenchmarkApplyToActive (daemon/put_bench_test.go) applies, one
// flow mapping an exposure; BenchmarkParse's (configWith); a config with
// allowFrom and ports lists.
func TestYAMLBlockNodeTakesFlowConfigs(t *testing.T) {
	for _, doc := range [][]byte{
		[]byte(applyYAML(100000)), configWith(100000),
	} {
		_, ok := yamlBlockNode(doc)
		require.True(t, ok, "yamlBlockNode reads %.200s...", doc)
	}
	for _, doc := range [][]byte{
		[]byte(applyYAML(300)), configWith(300), []byte(allowFromYAML),
	} {
		got, ok := yamlBlockNode(doc)
		require.True(t, ok, "yamlBlockNode reads %.200s...", doc)
		require.NoError(t, sameAsParser(got, doc))
	}
}

// allowFromYAML is a config whose exposures carry short flow sequences.
const allowFromYAML = `network:
  cidr: 10.0.0.1/16
vms:
  - {name: a, kernel: /k, memory: 512M}
exposures:
  - name: e
    vm: a
    guestPort: 80
    hostPort: 8080
    allowFrom: [10.0.0.0/8, 192.168.1.0/24]   # the office
  - name: f
    vm: a
    guestPort: 443
    hostPort: 8443
    allowFrom: ['10.0.0.0/8', "fd00::/8"]
`

// applyYAML is exposuresYAML of daemon/put_bench_test.go: the document of
// n exposures BenchmarkApplyToActive applies, one flow mapping each.
func applyYAML(n int) string {
	const block = 40000 // exposureBlock
	var y strings.Builder
	y.WriteString("exposures:\n")
	for i := 0; i < n; i++ {
		fmt.Fprintf(&y, "  - {name: e-%d, target: 10.213.0.250, guestPort: 80, hostAddress: 10.99.%d.1, hostPort: %d, mode: nat}\n",
			i, i/block, 20001+i%block)
	}
	return y.String()
}

// A YAML config decodes as it did through the YAML parser alone: the same
// Config, the same errors (a key given twice, an unknown key, a wrong type,
// with their lines).
func TestYAMLConfigDecodesAsBefore(t *testing.T) {
	example, err := os.ReadFile("../../dist/brokkr.example.yaml")
	require.NoError(t, err)
	docs := []string{
		string(configYAML(20)),
		strings.Replace(string(example), "kernelSha256: 00000000", "kernelSha256: 0a000000", 1),
		"network:\n  cidr: 10.0.0.1/16\nvms:\n- name: a\n  kernel: /k\nexposures:\n- name: e\n  vm: a\n  guestPort: 80\n  hostPort: 8080\n  allowFrom:\n  - 10.0.0.0/8\n",
		"network:\n  cidr: 10.0.0.1/16\n  cidr: 10.1.0.1/16\n",
		"network:\n  cdir: 10.0.0.1/16\n",
		"vms:\n  - name: a\n    kernel: /k\n    cpus: two\n",
		"exposures:\n  - name: e\n    hostPort: true\n",
		"exposures:\n  - name: e\n    hostPort: 30000-30099\n    guestPort: '80'\n",
		"exposures:\n  - name: e\n    hostPort:\n    maxConns: -1\n",
		"stateDir: null\n",
		"stateDir:\n",
		"network: []\n",
		"vms: {}\n",
		"vms:\n  -\n",
		"network:\n  mtu: 123456789012345678\n",
		"unknown: 1\nnetwork:\n  masquerade: nope\n",
		allowFromYAML,
		applyYAML(30),
		string(configWith(20)),
		"exposures:\n  - {name: e, vm: a, guestPort: '80', hostPort: 30000-30099, maxConns: true}\n",
		"exposures:\n  - {name: e, name: f}\n",
		"exposures:\n  - {name: e, allowFrom: 10.0.0.0/8}\n  - name: f\n    allowFrom: {a: b}\n",
		"exposures:\n  - [a, b]\n",
		"network: {cidr: 10.0.0.1/16, mtu: big}\n",
		"vms: [a]\n",
	}
	decodesAsTheParser(t, yamlBlockNode, docs)
}
