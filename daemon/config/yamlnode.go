package config

import (
	"strings"
	"unicode/utf8"

	"go.yaml.in/yaml/v3"
)

// yamlBlockNode reads a block-style YAML document into the node tree the
// YAML parser makes of it, several times faster
// (BenchmarkReadDocumentYAML): at 100,000 exposures that parser is most of
// an apply's request. Like jsonNode it reads only a plain subset and
// reports false for anything else, which the YAML parser then reads as
// before. The subset: a mapping at the top; block mappings and sequences
// indented with spaces (a "- " item may hold a mapping on its line, a
// key's sequence may sit at the key's own indentation); keys and values on
// one line each; plain scalars of printable ASCII without '#' whose tag is
// certain (see plainTag); quoted scalars without escapes; an empty value
// (null); a value that is a flow collection of such scalars on one line,
// "[a, b]" or "{k: v, l: w}" (see flow); a leading "---"; comments.
// Whatever it accepts, the YAML parser accepts as the same tree (kinds,
// tags, styles, values, lines and columns; FuzzYAMLBlockNodeIsYAMLs checks
// it), so what checkTree and Decode make of a document does not depend on
// which of the two read it.
func yamlBlockNode(data []byte) (*yaml.Node, bool) {
	s := yamlScan{text: string(data), line: 1}
	if !s.nextLine() {
		return nil, false
	}
	if s.indent == 0 && strings.HasPrefix(s.text[s.pos:], "---\n") {
		s.pos += len("---")
		if !s.endLine() || !s.nextLine() {
			return nil, false
		}
	}
	if s.indent < 0 || s.entry() {
		return nil, false // empty, or not a mapping: not a config's shape
	}
	n, ok := s.block(s.indent, 0)
	if !ok || s.indent >= 0 {
		return nil, false // or a line left of the top mapping
	}
	return n, true
}

// maxYAMLDepth bounds the nesting the fast path takes, as maxJSONDepth.
const maxYAMLDepth = 32

// maxKeyBytes: the YAML parser refuses a key longer than 1024 characters;
// the fast path leaves long keys to it.
const maxKeyBytes = 256

// yamlScan reads a document line by line. Between nodes it stands at the
// first non-space byte of a line holding content, indent its column - 1,
// or at the end (indent -1).
type yamlScan struct {
	text      string
	pos       int
	line      int
	lineStart int
	indent    int
	nodes
}

func (s *yamlScan) col() int { return s.pos - s.lineStart + 1 }

func (s *yamlScan) newline() {
	s.pos++
	s.line++
	s.lineStart = s.pos
}

// nextLine goes from the start of a line to the next line with content,
// past blank lines and comments. A tab or any other byte the subset does
// not take there is left to the YAML parser.
func (s *yamlScan) nextLine() bool {
	for {
		for s.pos < len(s.text) && s.text[s.pos] == ' ' {
			s.pos++
		}
		if s.pos == len(s.text) {
			s.indent = -1
			return true
		}
		switch s.text[s.pos] {
		case '\n':
			s.newline()
		case '#':
			if !s.comment() {
				return false
			}
			if s.pos < len(s.text) {
				s.newline()
			}
		default:
			s.indent = s.pos - s.lineStart
			return s.text[s.pos] > ' ' && s.text[s.pos] <= '~'
		}
	}
}

// endLine takes the rest of a line after a node: spaces, a comment after
// at least one of them, the line break.
func (s *yamlScan) endLine() bool {
	start := s.pos
	for s.pos < len(s.text) && s.text[s.pos] == ' ' {
		s.pos++
	}
	if s.pos < len(s.text) && s.text[s.pos] == '#' {
		if s.pos == start || !s.comment() {
			return false
		}
	}
	if s.pos == len(s.text) {
		return true
	}
	if s.text[s.pos] != '\n' {
		return false
	}
	s.newline()
	return true
}

// comment skips a comment up to its line break. Its text may be any
// UTF-8 the YAML parser allows, except its line breaks other than '\n'
// (NEL, LS, PS; a '\r' too): they would start a line of their own.
func (s *yamlScan) comment() bool {
	for s.pos < len(s.text) {
		c := s.text[s.pos]
		if c == '\n' {
			return true
		}
		if c >= ' ' && c <= '~' {
			s.pos++
			continue
		}
		r, size := utf8.DecodeRuneInString(s.text[s.pos:])
		if r == utf8.RuneError && size == 1 {
			return false // not UTF-8
		}
		if !(r >= 0xA0 && r <= 0xD7FF && r != 0x2028 && r != 0x2029 ||
			r >= 0xE000 && r <= 0xFFFD && r != 0xFEFF || r >= 0x10000) {
			return false
		}
		s.pos += size
	}
	return true
}

// entry reports whether the line holds a sequence entry: "-" then a space
// or the end of the line.
func (s *yamlScan) entry() bool {
	i := s.pos + 1
	return s.text[s.pos] == '-' && (i == len(s.text) || s.text[i] == ' ' || s.text[i] == '\n')
}

// inlineEnd reports whether nothing but spaces and a comment follow on the
// line.
func (s *yamlScan) inlineEnd() bool {
	i := s.pos
	for i < len(s.text) && s.text[i] == ' ' {
		i++
	}
	return i == len(s.text) || s.text[i] == '\n' || s.text[i] == '#' && i > s.pos
}

// block reads the node whose first line is the current one, at indent.
func (s *yamlScan) block(indent, depth int) (*yaml.Node, bool) {
	if s.entry() {
		return s.sequence(indent, depth)
	}
	k, key, ok := s.scalar(false)
	if !ok || !key {
		return nil, false // a scalar on a line of its own could go on over the next
	}
	return s.mapping(indent, depth, k)
}

// mapping reads a block mapping at indent whose first key, k, is read: s
// stands at its ':'.
func (s *yamlScan) mapping(indent, depth int, k *yaml.Node) (*yaml.Node, bool) {
	if depth > maxYAMLDepth {
		return nil, false
	}
	n := s.node(yaml.MappingNode, "!!map", 0, "", k.Line, k.Column)
	mark := len(s.stack)
	for {
		s.pos++ // ':'
		v, ok := s.value(indent, depth, true)
		if !ok {
			return nil, false
		}
		s.stack = append(s.stack, k, v)
		if s.indent < indent {
			break
		}
		if s.indent > indent {
			return nil, false // a scalar going on over this line, or not YAML
		}
		var key bool
		if k, key, ok = s.scalar(false); !ok || !key {
			return nil, false
		}
	}
	s.children(n, mark)
	return n, true
}

// sequence reads a block sequence at indent; s stands at its first '-'.
func (s *yamlScan) sequence(indent, depth int) (*yaml.Node, bool) {
	if depth > maxYAMLDepth {
		return nil, false
	}
	n := s.node(yaml.SequenceNode, "!!seq", 0, "", s.line, s.col())
	mark := len(s.stack)
	for {
		s.pos++ // '-'
		v, ok := s.value(indent, depth, false)
		if !ok {
			return nil, false
		}
		s.stack = append(s.stack, v)
		if s.indent < indent || s.indent == indent && !s.entry() {
			break // the line is its parent's (a key beside a sequence at the key's indentation)
		}
		if s.indent > indent {
			return nil, false // as in mapping
		}
	}
	s.children(n, mark)
	return n, true
}

// value reads what follows a key's ':' (inMap) or an entry's '-' in a
// collection at indent, and goes to the next line with content.
func (s *yamlScan) value(indent, depth int, inMap bool) (*yaml.Node, bool) {
	// An empty value is a null where the indicator ends.
	line, col := s.line, s.col()
	if s.inlineEnd() {
		if !s.endLine() || !s.nextLine() {
			return nil, false
		}
		switch {
		case s.indent > indent:
			return s.block(s.indent, depth+1)
		case inMap && s.indent == indent && s.entry():
			return s.sequence(indent, depth+1)
		}
		return s.node(yaml.ScalarNode, "!!null", 0, "", line, col), true
	}
	for s.text[s.pos] == ' ' {
		s.pos++
	}
	var v *yaml.Node
	switch s.text[s.pos] {
	case '[', '{':
		var ok bool
		if v, ok = s.flow(); !ok {
			return nil, false
		}
	default:
		var key, ok bool
		if v, key, ok = s.scalar(false); !ok {
			return nil, false
		}
		if key {
			if inMap {
				return nil, false // "a: b: c"
			}
			// "- key: value": a mapping in the entry, at the key's column.
			return s.mapping(v.Column-1, depth+1, v)
		}
	}
	return v, s.endLine() && s.nextLine()
}

// flow reads a flow collection on one line, "[a, 'b', 1]" or
// "{k: v, 'l': 2}", whose entries are scalars; s stands at its '[' or
// '{'. A collection inside, an empty entry, a key without a value, a
// trailing ',', a pair in a sequence ("[a: b]") and a line break are
// left to the YAML parser.
func (s *yamlScan) flow() (*yaml.Node, bool) {
	n := s.node(yaml.SequenceNode, "!!seq", yaml.FlowStyle, "", s.line, s.col())
	closing := byte(']')
	if s.text[s.pos] == '{' {
		n.Kind, n.Tag, closing = yaml.MappingNode, "!!map", '}'
	}
	mark := len(s.stack)
	s.pos++
	s.spaces()
	if s.at(closing) {
		s.pos++
		return n, true // [], { }
	}
	for {
		k, key, ok := s.flowScalar()
		if !ok || key != (closing == '}') {
			return nil, false // "[a: b]", "{a}", "{a, b: c}"
		}
		s.stack = append(s.stack, k)
		if key {
			s.pos++ // ':'
			s.spaces()
			v, _, ok := s.flowScalar()
			if !ok {
				return nil, false // "{a: }"
			}
			s.stack = append(s.stack, v)
		}
		s.spaces()
		switch {
		case s.at(closing):
			s.pos++
			s.children(n, mark)
			return n, true
		case s.at(','):
			s.pos++
			s.spaces()
		default:
			return nil, false // "{a: b: c}", "{a: b # c}", "[a, b" and a line break
		}
	}
}

// flowScalar is scalar in a flow collection, where s may stand at the
// line's end.
func (s *yamlScan) flowScalar() (n *yaml.Node, key, ok bool) {
	if s.pos == len(s.text) {
		return nil, false, false
	}
	return s.scalar(true)
}

func (s *yamlScan) spaces() {
	for s.pos < len(s.text) && s.text[s.pos] == ' ' {
		s.pos++
	}
}

func (s *yamlScan) at(c byte) bool { return s.pos < len(s.text) && s.text[s.pos] == c }

// scalar reads a scalar that starts at s.pos, on its line, in a flow
// collection or not. key: it is followed by ':' and a space or the line's
// end, where s then stands; otherwise s stands just after it.
func (s *yamlScan) scalar(flow bool) (n *yaml.Node, key, ok bool) {
	line, col := s.line, s.col()
	var v, tag string
	style := yaml.Style(0)
	switch q := s.text[s.pos]; q {
	case '"', '\'':
		i := s.pos + 1
		for i < len(s.text) && s.text[i] != q {
			if c := s.text[i]; c < ' ' || c > '~' || c == '\\' {
				return nil, false, false
			}
			i++
		}
		if i == len(s.text) {
			return nil, false, false
		}
		v, tag, style = s.text[s.pos+1:i], "!!str", yaml.DoubleQuotedStyle
		if q == '\'' {
			style = yaml.SingleQuotedStyle
		}
		s.pos = i + 1
	default:
		if v, ok = s.plain(flow); !ok {
			return nil, false, false
		}
		if tag, ok = plainTag(v); !ok {
			return nil, false, false
		}
	}
	key = s.pos < len(s.text) && s.text[s.pos] == ':' &&
		(s.pos+1 == len(s.text) || s.text[s.pos+1] == ' ' || s.text[s.pos+1] == '\n')
	if key && len(v) > maxKeyBytes {
		return nil, false, false
	}
	return s.node(yaml.ScalarNode, tag, style, v, line, col), key, true
}

// plain reads a plain scalar: printable ASCII but '#', up to a ':' that
// a space or the line's end follows (a key's), or to the spaces before the
// line's end or a comment. Single spaces and runs of them inside are its
// own. Its first byte is a letter, a digit, '/', '_', or the '-' of a
// negative number; the rest is plainTag's to judge. In a flow collection
// (flow) ',', ']' and '}' end it too, and the spaces before them; a '[',
// '{' or '?' in it is left to the YAML parser, whose scanner ends a plain
// scalar there too ("[a?b]" is a, then "?b"). A ':' that no space follows
// is the scalar's, there as in a block ("[https://h:2379]", "[a:]").
func (s *yamlScan) plain(flow bool) (string, bool) {
	start, i := s.pos, s.pos
	if c := s.text[i]; !(isLetter(c) || isDigit(c) || c == '/' || c == '_' ||
		c == '-' && i+1 < len(s.text) && isDigit(s.text[i+1])) {
		return "", false
	}
	for i < len(s.text) {
		switch c := s.text[i]; {
		case c == ':' && (i+1 == len(s.text) || s.text[i+1] == ' ' || s.text[i+1] == '\n'):
			if s.text[i-1] == ' ' {
				return "", false // "a : b"
			}
			s.pos = i
			return s.text[start:i], true
		case c == ' ':
			j := i
			for j < len(s.text) && s.text[j] == ' ' {
				j++
			}
			if j == len(s.text) || s.text[j] == '\n' || s.text[j] == '#' || flow && flowEnd(s.text[j]) {
				s.pos = i
				return s.text[start:i], true
			}
			i = j
		case c == '\n' || flow && flowEnd(c):
			s.pos = i
			return s.text[start:i], true
		case c == '#' || c < ' ' || c > '~':
			return "", false
		case flow && (c == '[' || c == '{' || c == '?'):
			return "", false
		default:
			i++
		}
	}
	s.pos = i
	return s.text[start:i], true
}

// plainTag is the tag the YAML parser resolves plain scalar v to, when it
// is certain (resolve.go in yaml.v3): a string whose first byte cannot
// start anything else; true, false and null in lower case (their other
// spellings, and yes, no, on, off, y and n, which YAML 1.1 made booleans,
// are left to the parser); a decimal integer of at most 18 digits; and a
// string starting with a digit that no rule of the parser can read as a
// number or a date (plainDigitsStr).
func plainTag(v string) (string, bool) {
	switch c := v[0]; {
	case isDigit(c) || c == '-':
		if plainInt(v) {
			return "!!int", true
		}
		if c != '-' && plainDigitsStr(v) {
			return "!!str", true
		}
		return "", false
	case strings.IndexByte("yYnNtTfFoO", c) >= 0:
		switch v {
		case "true", "false":
			return "!!bool", true
		case "null":
			return "!!null", true
		}
		for _, w := range [...]string{"true", "false", "null", "yes", "no", "on", "off", "y", "n"} {
			if strings.EqualFold(v, w) {
				return "", false
			}
		}
	}
	return "!!str", true
}

// plainInt reports whether v is -?(0|[1-9][0-9]*) of at most 18 digits.
func plainInt(v string) bool {
	d := strings.TrimPrefix(v, "-")
	if d == "" || len(d) > 18 || d[0] == '0' && len(d) > 1 {
		return false
	}
	for i := 0; i < len(d); i++ {
		if !isDigit(d[i]) {
			return false
		}
	}
	return true
}

// plainDigitsStr reports whether v, starting with a digit, is certainly a
// string to the YAML parser: it is not a date (four digits and a '-'), and
// it holds what none of the parser's integer and float syntaxes (decimal,
// 0777, 0x, 0o, 0b, 1e3, 1.5, with '_' dropped) has: a '/' or ':', a
// second '.', a '-' right after a digit, or a letter other than e and E
// where no 0x, 0o or 0b allows more (10.0.0.1/16, 127.0.0.1, 256M,
// 30000-30099, a SHA-256 in hex). '_' and ' ' are left to the parser.
func plainDigitsStr(v string) bool {
	if len(v) > 4 && isDigit(v[1]) && isDigit(v[2]) && isDigit(v[3]) && v[4] == '-' {
		return false
	}
	prefixed := len(v) > 1 && v[0] == '0' && strings.IndexByte("xXoObB", v[1]) >= 0
	dots, str := 0, false
	for i := 0; i < len(v); i++ {
		switch c := v[i]; {
		case c == '_' || c == ' ':
			return false
		case c == '/' || c == ':':
			str = true
		case c == '.':
			dots++
		case c == '-':
			str = str || isDigit(v[i-1])
		case isLetter(c):
			str = str || !prefixed && c != 'e' && c != 'E'
		}
	}
	return str || dots > 1
}

// flowEnd reports whether c ends a plain scalar in a flow collection.
func flowEnd(c byte) bool { return c == ',' || c == ']' || c == '}' }

func isDigit(c byte) bool  { return c >= '0' && c <= '9' }
func isLetter(c byte) bool { return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' }
