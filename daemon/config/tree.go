package config

import (
	"fmt"
	"reflect"
	"strconv"
	"strings"
	"sync"

	"go.yaml.in/yaml/v3"
)

// maxWork bounds the tree walk (a node visited costs 1, a scalar checked
// its length more): aliases can make a small document a huge tree ("billion
// laughs"; a long string referenced from a million places), and the walk
// expands them. 100,000 exposures cost about 2^24.
const maxWork = 1 << 26

// checkTree walks the document against the Config type and reports, with
// the path of each node, every key Config does not have, every key given
// twice and every value of the wrong kind or type, in file order. What it
// accepts, yaml's Decode into a Config accepts.
func checkTree(doc *yaml.Node) Errors {
	w := &walker{open: map[*yaml.Node]bool{}}
	w.walk(doc, reflect.TypeOf(Config{}), nil)
	return w.errs
}

// at is where a node is: its parent's place (nil: the top level) and its
// key there, or its index in a list. It is made into the path's text
// ("exposures[3].hostPort") only for an error, so a walk of a document
// with nothing wrong builds no string.
type at struct {
	up   *at
	key  string
	idx  int
	item bool
}

func (a *at) field(key string) *at { return &at{up: a, key: key} }
func (a *at) index(i int) *at      { return &at{up: a, idx: i, item: true} }

func (a *at) String() string {
	if a == nil {
		return ""
	}
	path := a.up.String()
	if a.item {
		return path + "[" + strconv.Itoa(a.idx) + "]"
	}
	return keyPath(path, a.key)
}

type walker struct {
	errs Errors
	work int
	// open holds the mappings and lists the walk is inside of. An alias
	// can point at one of them ("&a [*a]", "&b {<<: *b}"): walking into it
	// again would never end (and would overflow the stack, killing the
	// daemon, before the work budget ran out).
	open map[*yaml.Node]bool
}

// enter marks n open, or reports the cycle when it already is.
func (w *walker) enter(n *yaml.Node, path *at) bool {
	if w.open[n] {
		w.add(path, "an alias here refers to a node that contains it (line %d); YAML cannot be infinite", n.Line)
		return false
	}
	w.open[n] = true
	return true
}

func (w *walker) add(where *at, format string, a ...any) {
	path := where.String()
	if path == "" {
		path = "(top level)"
	}
	w.errs = append(w.errs, FieldError{Path: path, Msg: fmt.Sprintf(format, a...)})
}

func kindName(n *yaml.Node) string {
	switch n.Kind {
	case yaml.MappingNode:
		return "a mapping"
	case yaml.SequenceNode:
		return "a list"
	}
	return fmt.Sprintf("%q", n.Value)
}

func typeName(t reflect.Type) string {
	switch t.Kind() {
	case reflect.Struct:
		return "a mapping"
	case reflect.Slice:
		return "a list"
	case reflect.Bool:
		return "true or false"
	case reflect.String:
		return "a string"
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return "an integer"
	}
	return t.String()
}

var portType = reflect.TypeOf(Port{})

func (w *walker) walk(n *yaml.Node, t reflect.Type, path *at) {
	for n.Kind == yaml.AliasNode {
		n = n.Alias
	}
	if w.over(1 + len(n.Value)) {
		return
	}
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	if n.Kind == yaml.ScalarNode && n.Tag == "!!null" {
		return // unset: the default
	}
	if t == portType {
		// A port or a range: an integer or a string (Port.UnmarshalYAML).
		if n.Kind != yaml.ScalarNode || !portFits(n) {
			w.add(path, "%s is not a port or a range of ports (8080, \"30000-30099\")", kindName(n))
		}
		return
	}
	switch t.Kind() {
	case reflect.Struct:
		if n.Kind != yaml.MappingNode {
			w.add(path, "%s is not allowed here (a mapping is expected)", kindName(n))
			return
		}
		w.mapping(n, t, path, &seenKeys{}, false)
	case reflect.Slice:
		if n.Kind != yaml.SequenceNode {
			w.add(path, "%s is not allowed here (a list is expected)", kindName(n))
			return
		}
		if !w.enter(n, path) {
			return
		}
		defer delete(w.open, n)
		for i, e := range n.Content {
			w.walk(e, t.Elem(), path.index(i))
		}
	default:
		if n.Kind != yaml.ScalarNode {
			w.add(path, "%s is not allowed here (%s is expected)", kindName(n), typeName(t))
			return
		}
		// Whether the scalar fits is yaml's decision (what Decode will
		// do), except that an integer must be written as one: yaml would
		// truncate 1.5 to 1. The message is ours, from the node and the type.
		if !scalarFits(n, t) {
			w.add(path, "%q is not %s", n.Value, typeName(t))
		}
	}
}

// over spends work and reports whether the budget is gone (said once).
func (w *walker) over(cost int) bool {
	w.work += cost
	if w.work <= maxWork {
		return false
	}
	if w.work-cost <= maxWork {
		w.errs = append(w.errs, FieldError{Msg: "the document expands to too much through its aliases; write it out"})
	}
	return true
}

// mapping checks one mapping's keys against struct t. seen (key -> line)
// finds a key given twice; keys merged in ("<<: *base") are checked too but
// may be overridden, as YAML says, so they are not recorded.
func (w *walker) mapping(n *yaml.Node, t reflect.Type, path *at, seen *seenKeys, merged bool) {
	if w.over(1) || !w.enter(n, path) {
		return
	}
	defer delete(w.open, n)
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, v := n.Content[i], n.Content[i+1]
		for k.Kind == yaml.AliasNode {
			k = k.Alias
		}
		if k.Kind == yaml.ScalarNode && k.Tag == "!!merge" {
			w.merge(v, t, path, seen)
			continue
		}
		if k.Kind != yaml.ScalarNode {
			w.add(path, "%s is not a key (keys are names)", kindName(k))
			continue
		}
		p := path.field(k.Value)
		if !merged {
			if line, dup := seen.get(k.Value); dup {
				w.add(p, "is given twice (lines %d and %d)", line, k.Line)
				continue
			}
			seen.put(k.Value, k.Line)
		}
		f, ok := fieldByKey(t, k.Value)
		if !ok {
			w.add(p, "unknown key %q", k.Value)
			continue
		}
		w.walk(v, f.Type, p)
	}
}

func (w *walker) merge(v *yaml.Node, t reflect.Type, path *at, seen *seenKeys) {
	for v.Kind == yaml.AliasNode {
		v = v.Alias
	}
	switch v.Kind {
	case yaml.MappingNode:
		w.mapping(v, t, path, seen, true)
	case yaml.SequenceNode:
		if w.over(1) || !w.enter(v, path) {
			return
		}
		defer delete(w.open, v)
		for _, m := range v.Content {
			w.merge(m, t, path, seen)
		}
	default:
		w.add(path, "<< merges %s; only a mapping or a list of mappings can be merged", kindName(v))
	}
}

// plainKey reports whether key is made of letters, digits, '_' and '-'.
func plainKey(key string) bool {
	for i := 0; i < len(key); i++ {
		c := key[i]
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '_' || c == '-') {
			return false
		}
	}
	return key != ""
}

// keyPath is path.key, or path["key"] for a key that would make the path
// ambiguous (one holding '.', '[' or a space: always an unknown key).
func keyPath(path, key string) string {
	if !plainKey(key) {
		return path + "[" + strconv.Quote(key) + "]"
	}
	if path == "" {
		return key
	}
	return path + "." + key
}

// fieldByKey finds the field of struct t whose yaml tag is key.
func fieldByKey(t reflect.Type, key string) (reflect.StructField, bool) {
	fields, ok := fieldsByKey.Load(t)
	if !ok {
		m := map[string]reflect.StructField{}
		for i := 0; i < t.NumField(); i++ {
			f := t.Field(i)
			name, _, _ := strings.Cut(f.Tag.Get("yaml"), ",")
			if _, dup := m[name]; !dup && f.IsExported() {
				m[name] = f
			}
		}
		fields, _ = fieldsByKey.LoadOrStore(t, m)
	}
	f, ok := fields.(map[string]reflect.StructField)[key]
	return f, ok
}

// fieldsByKey: struct type → its exported fields by yaml key (the walk
// looks a key up for every key of the document).
var fieldsByKey sync.Map

// seenKeys are the keys of one mapping so far, with their lines: a few
// in place (a mapping of the config has at most a dozen or so keys), a
// map past that (a document's mapping can have any number).
type seenKeys struct {
	few [12]struct {
		key  string
		line int
	}
	n    int
	many map[string]int
}

func (s *seenKeys) get(key string) (int, bool) {
	if s.many != nil {
		line, ok := s.many[key]
		return line, ok
	}
	for _, k := range s.few[:s.n] {
		if k.key == key {
			return k.line, true
		}
	}
	return 0, false
}

func (s *seenKeys) put(key string, line int) {
	switch {
	case s.many != nil:
		s.many[key] = line
	case s.n < len(s.few):
		s.few[s.n].key, s.few[s.n].line = key, line
		s.n++
	default:
		s.many = make(map[string]int, 2*len(s.few))
		for _, k := range s.few {
			s.many[k.key] = k.line
		}
		s.many[key] = line
	}
}

// scalarFits reports whether yaml's Decode of scalar n into a value of
// type t succeeds (and, for an integer, that n is written as one: yaml
// would truncate 1.5 to 1). The common cases are decided here, as yaml
// would decide them; the rest by yaml itself.
func scalarFits(n *yaml.Node, t reflect.Type) bool {
	tag := n.ShortTag()
	switch t.Kind() {
	case reflect.String:
		if tag == "!!str" {
			return true
		}
	case reflect.Bool:
		if tag == "!!bool" {
			return true
		}
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		if tag != "!!int" {
			return false
		}
		if plainDecimal(n.Value) {
			var err error
			if t.Kind() >= reflect.Uint {
				_, err = strconv.ParseUint(n.Value, 10, t.Bits())
			} else {
				_, err = strconv.ParseInt(n.Value, 10, t.Bits())
			}
			return err == nil
		}
	}
	return n.Decode(reflect.New(t).Interface()) == nil
}

// portFits reports whether Port.UnmarshalYAML takes scalar n.
func portFits(n *yaml.Node) bool {
	switch n.ShortTag() {
	case "!!int":
		if plainDecimal(n.Value) {
			_, err := strconv.ParseInt(n.Value, 10, strconv.IntSize)
			return err == nil
		}
	case "!!str":
		_, err := parsePort(n.Value)
		return err == nil
	}
	return n.Decode(&Port{}) == nil
}

// plainDecimal reports whether v is an optional '-' and digits with no
// leading zero: an integer yaml and strconv read alike.
func plainDecimal(v string) bool {
	d := strings.TrimPrefix(v, "-")
	if d == "" || d[0] == '0' && len(d) > 1 {
		return false
	}
	for i := 0; i < len(d); i++ {
		if d[i] < '0' || d[i] > '9' {
			return false
		}
	}
	return true
}
