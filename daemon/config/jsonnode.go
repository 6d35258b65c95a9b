package config

import (
	"go.yaml.in/yaml/v3"
)

// jsonNode reads a JSON document into the node tree yaml's parser makes of
// it, about seven times faster (BenchmarkReadDocument): at 100,000
// exposures the YAML parser was most of an apply's request. It reads only a plain subset of JSON (ASCII
// strings without escapes, integers of at most 18 digits, true, false,
// null, objects and arrays) and reports false for anything else, which is
// then read by the YAML parser as before: whatever it accepts, that parser
// accepts as the same tree (kinds, tags, styles, values, lines and
// columns; FuzzJSONNodeIsYAMLs checks it), so what checkTree and Decode
// make of a document does not depend on which of the two read it.
func jsonNode(data []byte) (*yaml.Node, bool) {
	s := jsonScan{text: string(data), line: 1}
	s.space()
	if s.pos >= len(s.text) || s.text[s.pos] != '{' {
		return nil, false
	}
	n, ok := s.value(0)
	if !ok {
		return nil, false
	}
	s.space()
	if s.pos != len(s.text) {
		return nil, false
	}
	return n, true
}

// maxJSONDepth bounds the nesting the fast path takes (a Config is four
// deep); deeper documents go to the YAML parser, which has its own bound.
const maxJSONDepth = 32

type jsonScan struct {
	// text is the document, copied once: scalars' values are slices of it,
	// not an allocation each (so a Config read here keeps it alive).
	text      string
	pos       int
	line      int
	lineStart int // offset of the current line's first byte
	nodes
}

// nodes builds a tree for jsonNode and yamlBlockNode. Its nodes come from
// slabs and each container's children are gathered on one stack, then
// copied out at their final size: a document of 100,000 exposures is over
// a million nodes, and their allocations, one by one, were most of the
// reader's time.
type nodes struct {
	slab  []yaml.Node
	stack []*yaml.Node
}

// node is a new node from the current slab, its fields set in place (a
// yaml.Node is 20 words: built and then copied, it cost a third of the
// reader's time).
func (s *nodes) node(kind yaml.Kind, tag string, style yaml.Style, value string, line, col int) *yaml.Node {
	if len(s.slab) == cap(s.slab) {
		// Slabs double up to 4096 nodes: a small document does not pay
		// for a big one.
		s.slab = make([]yaml.Node, 0, min(4096, 2*cap(s.slab)+16))
	}
	s.slab = s.slab[:len(s.slab)+1]
	n := &s.slab[len(s.slab)-1]
	n.Kind, n.Tag, n.Style, n.Value, n.Line, n.Column = kind, tag, style, value, line, col
	return n
}

// children moves what was stacked since mark into n's Content.
func (s *nodes) children(n *yaml.Node, mark int) {
	if len(s.stack) > mark {
		n.Content = append([]*yaml.Node(nil), s.stack[mark:]...)
	}
	s.stack = s.stack[:mark]
}

func (s *jsonScan) col() int { return s.pos - s.lineStart + 1 }

// space skips JSON's whitespace. A tab is left for the YAML parser (YAML
// allows it in fewer places than JSON does).
func (s *jsonScan) space() {
	for s.pos < len(s.text) {
		switch s.text[s.pos] {
		case ' ':
		case '\r':
			if s.pos+1 < len(s.text) && s.text[s.pos+1] == '\n' {
				break // "\r\n" is one line break, counted at its '\n'
			}
			s.line++ // a lone '\r' is a line break of its own in YAML
			s.lineStart = s.pos + 1
		case '\n':
			s.line++
			s.lineStart = s.pos + 1
		default:
			return
		}
		s.pos++
	}
}

func (s *jsonScan) value(depth int) (*yaml.Node, bool) {
	if s.pos >= len(s.text) || depth > maxJSONDepth {
		return nil, false
	}
	line, col := s.line, s.col()
	switch c := s.text[s.pos]; {
	case c == '{':
		return s.object(depth, line, col)
	case c == '[':
		return s.array(depth, line, col)
	case c == '"':
		v, ok := s.str()
		if !ok {
			return nil, false
		}
		return s.node(yaml.ScalarNode, "!!str", yaml.DoubleQuotedStyle, v, line, col), true
	case c == '-' || c >= '0' && c <= '9':
		v, ok := s.integer()
		if !ok {
			return nil, false
		}
		return s.node(yaml.ScalarNode, "!!int", 0, v, line, col), true
	default:
		for _, w := range [...]struct{ word, tag string }{{"true", "!!bool"}, {"false", "!!bool"}, {"null", "!!null"}} {
			if s.word(w.word) {
				return s.node(yaml.ScalarNode, w.tag, 0, w.word, line, col), true
			}
		}
		return nil, false
	}
}

// word takes w when it stands alone (not the start of a longer plain
// scalar, which YAML would read differently).
func (s *jsonScan) word(w string) bool {
	end := s.pos + len(w)
	if end > len(s.text) || s.text[s.pos:end] != w || !s.endsScalar(end) {
		return false
	}
	s.pos = end
	return true
}

// endsScalar: what follows a plain scalar in flow context must end it as
// it ends a JSON value; anything else ("1x", "true:") is left to YAML.
func (s *jsonScan) endsScalar(i int) bool {
	if i >= len(s.text) {
		return true
	}
	switch s.text[i] {
	case ',', '}', ']', ' ', '\n', '\r':
		return true
	}
	return false
}

// integer takes -?(0|[1-9][0-9]*) of at most 18 digits, which YAML
// resolves to !!int as JSON means it; fractions, exponents and longer
// numbers go to the YAML parser.
func (s *jsonScan) integer() (string, bool) {
	i := s.pos
	if s.text[i] == '-' {
		i++
	}
	start := i
	for i < len(s.text) && s.text[i] >= '0' && s.text[i] <= '9' {
		i++
	}
	digits := i - start
	if digits == 0 || digits > 18 || (digits > 1 && s.text[start] == '0') || !s.endsScalar(i) {
		return "", false
	}
	v := s.text[s.pos:i]
	s.pos = i
	return v, true
}

// str takes a double-quoted string of printable ASCII with no escape.
func (s *jsonScan) str() (string, bool) {
	i := s.pos + 1
	for ; i < len(s.text); i++ {
		c := s.text[i]
		if c == '"' {
			v := s.text[s.pos+1 : i]
			s.pos = i + 1
			return v, true
		}
		if c < 0x20 || c > 0x7e || c == '\\' {
			return "", false
		}
	}
	return "", false
}

func (s *jsonScan) object(depth, line, col int) (*yaml.Node, bool) {
	n := s.node(yaml.MappingNode, "!!map", yaml.FlowStyle, "", line, col)
	mark := len(s.stack)
	s.pos++ // {
	s.space()
	if s.pos < len(s.text) && s.text[s.pos] == '}' {
		s.pos++
		return n, true
	}
	for {
		if s.pos >= len(s.text) || s.text[s.pos] != '"' {
			return nil, false
		}
		k, ok := s.value(depth + 1)
		if !ok {
			return nil, false
		}
		for s.pos < len(s.text) && s.text[s.pos] == ' ' {
			s.pos++ // a YAML key and its ':' are on one line
		}
		if s.pos >= len(s.text) || s.text[s.pos] != ':' {
			return nil, false
		}
		s.pos++
		s.space()
		v, ok := s.value(depth + 1)
		if !ok {
			return nil, false
		}
		s.stack = append(s.stack, k, v)
		if end, ok := s.after('}'); !ok || end {
			s.children(n, mark)
			return n, ok
		}
	}
}

// after reads what follows a member or an element: a ',' (more to come),
// or the container's closing byte (end), anything else is not plain JSON.
func (s *jsonScan) after(closing byte) (end, ok bool) {
	s.space()
	if s.pos >= len(s.text) {
		return false, false
	}
	switch s.text[s.pos] {
	case ',':
		s.pos++
		s.space()
		return false, true
	case closing:
		s.pos++
		return true, true
	}
	return false, false
}

func (s *jsonScan) array(depth, line, col int) (*yaml.Node, bool) {
	n := s.node(yaml.SequenceNode, "!!seq", yaml.FlowStyle, "", line, col)
	mark := len(s.stack)
	s.pos++ // [
	s.space()
	if s.pos < len(s.text) && s.text[s.pos] == ']' {
		s.pos++
		return n, true
	}
	for {
		v, ok := s.value(depth + 1)
		if !ok {
			return nil, false
		}
		s.stack = append(s.stack, v)
		if end, ok := s.after(']'); !ok || end {
			s.children(n, mark)
			return n, ok
		}
	}
}
