package compile

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

type TableSpec struct {
	Family   nftables.TableFamily
	Counters map[string]CounterSpec
	Sets     map[string]*SetSpec
	Chains   map[string]*ChainSpec
}

type CounterSpec struct {
	Name     string
	Exposure string // the exposure it belongs to
}

type HookSpec struct {
	Typ      nftables.ChainType
	Hook     nftables.ChainHook
	Priority int32
}

type ChainSpec struct {
	Name  string
	Hook  *HookSpec // nil: a regular chain reached by jump/goto
	Rules []RuleSpec
	Owner string // exposure name, "" for the fixed chains
}

type RuleSpec struct {
	Exprs   []expr.Any
	Raw     [][]byte // exprs marshalled (for the fingerprint), sent as they are
	Comment string
	Fp      string // fingerprint of exprs + comment, stored in the rule's userdata
}

type SetSpec struct {
	Name    string
	Key     nftables.SetDatatype
	Data    nftables.SetDatatype // zero unless a map
	IsMap   bool
	Dynamic bool
	// Interval: the key's last component is a range (a concatenation with
	// flags interval, the kernel's pipapo set). Each element's Key is its
	// first key followed by its last (NFTA_SET_ELEM_KEY and _KEY_END), so
	// it is one key everywhere here; the runtime splits it on the wire.
	Interval bool
	Counter  bool // every element counts the packets that found it (NFTA_SET_EXPRESSIONS: counter)
	Size     uint32
	Comment  string
	Stateful bool   // elements are runtime state (cap slots): never diffed; seeded when created
	SeedID   uint32 // a stateful set's exposure mark id: it is seeded from that exposure's open connections
	Owner    string // the exposure a set of its own belongs to ("" for the fixed sets)
	// PerExposure: a shared set whose elements come from the exposures'
	// units (the fixed part declares it empty).
	PerExposure bool
	Elems       map[string]ElemSpec // by string(key); nil for stateful sets
}

type ElemSpec struct {
	Key     []byte
	Val     []byte
	Verdict string // goto target for verdict maps
	Comment string
	Owner   string // the exposure whose unit holds it (not in the kernel: "" when observed)
	// Counter: in a set whose elements count (SetSpec.Counter), the value
	// the element starts at (a replace carries what the kernel held).
	Counter CounterValue
}

func (e ElemSpec) Same(o ElemSpec) bool {
	return string(e.Key) == string(o.Key) && string(e.Val) == string(o.Val) && e.Verdict == o.Verdict
}

func (h *HookSpec) Same(o *HookSpec) bool {
	if h == nil || o == nil {
		return h == o
	}
	return *h == *o
}

func NewTableSpec(f nftables.TableFamily) *TableSpec {
	return &TableSpec{Family: f, Counters: map[string]CounterSpec{}, Sets: map[string]*SetSpec{}, Chains: map[string]*ChainSpec{}}
}

func (t *TableSpec) addChain(c *ChainSpec) { t.Chains[c.Name] = c }

func (t *TableSpec) addSet(s *SetSpec) { t.Sets[s.Name] = s }

// rule builds one rule: its fingerprint covers every expression, so a rule
// that differs in any way from the desired one is found and rewritten. This is
// the single place rules are made, for adding as for comparing and deleting.
func rule(family nftables.TableFamily, comment string, exprs ...expr.Any) RuleSpec {
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
	return RuleSpec{Exprs: exprs, Raw: raw, Comment: comment, Fp: hex.EncodeToString(h.Sum(nil)[:8])}
}

func sortedKeys[M ~map[string]V, V any](m M) []string {
	ks := make([]string, 0, len(m))
	for k := range m {
		ks = append(ks, k)
	}
	sort.Strings(ks)
	return ks
}
