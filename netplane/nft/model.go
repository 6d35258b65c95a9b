package nft

import (
	"crypto/sha256"
	"encoding/hex"
	"sort"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
)

// TableName is the name of both brokkr tables (inet and bridge family).
const TableName = "brokkr"

// The model is the desired (or observed) content of brokkr's tables in a form
// that can be diffed: every object is identified by its name and carries a
// fingerprint of everything that makes it what it is.

type tableSpec struct {
	family   nftables.TableFamily
	counters map[string]counterSpec
	sets     map[string]*setSpec
	chains   map[string]*chainSpec
}

type counterSpec struct {
	name     string
	exposure string
}

type hookSpec struct {
	typ      nftables.ChainType
	hook     nftables.ChainHook
	priority int32
}

type chainSpec struct {
	name  string
	hook  *hookSpec // nil: a regular chain reached by jump/goto
	rules []ruleSpec
	owner string // exposure name, "" for the fixed chains
}

type ruleSpec struct {
	exprs   []expr.Any
	raw     [][]byte // exprs marshalled (for the fingerprint), sent as they are
	comment string
	fp      string // fingerprint of exprs + comment, stored in the rule's userdata
}

type setSpec struct {
	name     string
	key      nftables.SetDatatype
	data     nftables.SetDatatype // zero unless a map
	isMap    bool
	dynamic  bool
	size     uint32
	comment  string
	stateful bool // elements are runtime state (cap slots): never diffed; seeded when created
	owner    string
	elems    map[string]elemSpec // by string(key); nil for stateful sets
}

type elemSpec struct {
	key     []byte
	val     []byte
	verdict string // goto target for verdict maps
	comment string
}

func (e elemSpec) same(o elemSpec) bool {
	return string(e.key) == string(o.key) && string(e.val) == string(o.val) && e.verdict == o.verdict
}

func (h *hookSpec) same(o *hookSpec) bool {
	if h == nil || o == nil {
		return h == o
	}
	return *h == *o
}

func newTableSpec(f nftables.TableFamily) *tableSpec {
	return &tableSpec{family: f, counters: map[string]counterSpec{}, sets: map[string]*setSpec{}, chains: map[string]*chainSpec{}}
}

func (t *tableSpec) addChain(c *chainSpec) { t.chains[c.name] = c }

func (t *tableSpec) addSet(s *setSpec) { t.sets[s.name] = s }

// rule builds one rule: its fingerprint covers every expression, so a rule
// that differs in any way from the desired one is found and rewritten. This is
// the single place rules are made, for adding as for comparing and deleting.
func rule(family nftables.TableFamily, comment string, exprs ...expr.Any) ruleSpec {
	h := sha256.New()
	raw := make([][]byte, len(exprs))
	for i, e := range exprs {
		b, err := expr.Marshal(byte(family), e)
		if err != nil {
			// Every expression here is built by this package; a marshal
			// failure is a programming error caught by the unit tests.
			panic("nft: marshal " + err.Error())
		}
		h.Write(b)
		raw[i] = b
	}
	h.Write([]byte(comment))
	return ruleSpec{exprs: exprs, raw: raw, comment: comment, fp: hex.EncodeToString(h.Sum(nil)[:8])}
}

func sortedKeys[M ~map[string]V, V any](m M) []string {
	ks := make([]string, 0, len(m))
	for k := range m {
		ks = append(ks, k)
	}
	sort.Strings(ks)
	return ks
}
