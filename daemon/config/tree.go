package config

import (
	"fmt"
	"reflect"
	"regexp"
	"strconv"
	"strings"

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
	w.walk(doc, reflect.TypeOf(Config{}), "")
	return w.errs
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
func (w *walker) enter(n *yaml.Node, path string) bool {
	if w.open[n] {
		w.add(path, "an alias here refers to a node that contains it (line %d); YAML cannot be infinite", n.Line)
		return false
	}
	w.open[n] = true
	return true
}

func (w *walker) add(path, format string, a ...any) {
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

func (w *walker) walk(n *yaml.Node, t reflect.Type, path string) {
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
		if n.Kind != yaml.ScalarNode || n.Decode(&Port{}) != nil {
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
		w.mapping(n, t, path, map[string]int{}, false)
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
			w.walk(e, t.Elem(), fmt.Sprintf("%s[%d]", path, i))
		}
	default:
		if n.Kind != yaml.ScalarNode {
			w.add(path, "%s is not allowed here (%s is expected)", kindName(n), typeName(t))
			return
		}
		// Whether the scalar fits is yaml's decision (what Decode will
		// do), except that an integer must be written as one: yaml would
		// truncate 1.5 to 1. The message is ours, from the node and the type.
		isInt := strings.HasPrefix(typeName(t), "an integer")
		if err := n.Decode(reflect.New(t).Interface()); err != nil || (isInt && n.ShortTag() != "!!int") {
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
func (w *walker) mapping(n *yaml.Node, t reflect.Type, path string, seen map[string]int, merged bool) {
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
		p := keyPath(path, k.Value)
		if !merged {
			if line, dup := seen[k.Value]; dup {
				w.add(p, "is given twice (lines %d and %d)", line, k.Line)
				continue
			}
			seen[k.Value] = k.Line
		}
		f, ok := fieldByKey(t, k.Value)
		if !ok {
			w.add(p, "unknown key %q", k.Value)
			continue
		}
		w.walk(v, f.Type, p)
	}
}

func (w *walker) merge(v *yaml.Node, t reflect.Type, path string, seen map[string]int) {
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

var plainKey = regexp.MustCompile(`^[A-Za-z0-9_-]+$`)

// keyPath is path.key, or path["key"] for a key that would make the path
// ambiguous (one holding '.', '[' or a space: always an unknown key).
func keyPath(path, key string) string {
	if !plainKey.MatchString(key) {
		return path + "[" + strconv.Quote(key) + "]"
	}
	if path == "" {
		return key
	}
	return path + "." + key
}

// fieldByKey finds the field of struct t whose yaml tag is key.
func fieldByKey(t reflect.Type, key string) (reflect.StructField, bool) {
	for i := 0; i < t.NumField(); i++ {
		f := t.Field(i)
		name, _, _ := strings.Cut(f.Tag.Get("yaml"), ",")
		if name == key && f.IsExported() {
			return f, true
		}
	}
	return reflect.StructField{}, false
}
