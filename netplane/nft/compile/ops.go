package compile

import "github.com/google/nftables"

// Op is one operation of a batch. A plan's ops are in the order one netlink
// batch must apply them: deletions of what references an object before the
// object, creations of an object before what references it.
type Op interface {
	Family() nftables.TableFamily
}

// The operations. Each names its table by family; the table is always
// TableName.
type (
	// AddTable creates the table (a no-op if it exists).
	AddTable struct{ Fam nftables.TableFamily }
	// DelTable deletes the table and everything in it (it must exist:
	// a replace adds it first).
	DelTable struct{ Fam nftables.TableFamily }
	// DelElems deletes elements of a set.
	DelElems struct {
		Fam   nftables.TableFamily
		Set   string
		Elems []ElemSpec
	}
	// FlushChain deletes every rule of a chain (its rules are added again
	// by an AddRules later in the batch).
	FlushChain struct {
		Fam   nftables.TableFamily
		Chain string
	}
	// DelChain deletes a chain (its rules and the elements that jump to it
	// are deleted before).
	DelChain struct {
		Fam   nftables.TableFamily
		Chain string
	}
	// DelSet deletes a set (the rules that look it up are flushed before).
	DelSet struct {
		Fam nftables.TableFamily
		Set string
	}
	// DelCounter deletes a named counter.
	DelCounter struct {
		Fam  nftables.TableFamily
		Name string
	}
	// AddCounter creates a named counter starting at Value (a replace
	// carries the values the kernel held).
	AddCounter struct {
		Fam   nftables.TableFamily
		Name  string
		Value CounterValue
	}
	// AddSet creates a set, empty. A stateful set (Set.Stateful) is seeded
	// in the same batch from what is open in conntrack: the connections
	// whose mark id is Set.SeedID, at most Set.Size of them.
	AddSet struct {
		Fam nftables.TableFamily
		Set *SetSpec
		// Fresh: a cap set of an exposure new to the kernel, planned
		// against a state the kernel holds exactly (an incremental pass).
		// No connection carries its mark yet, so the runtime does not
		// seed it from conntrack (a dump of the whole conntrack table:
		// half of one PUT's cost under the set-based cap).
		Fresh bool
	}
	// AddChain creates a chain with no rules.
	AddChain struct {
		Fam   nftables.TableFamily
		Chain *ChainSpec
	}
	// AddRules appends every rule of Chain to the chain.
	AddRules struct {
		Fam   nftables.TableFamily
		Chain *ChainSpec
	}
	// AddElems adds elements to a set (Set gives its shape, for encoding).
	AddElems struct {
		Fam   nftables.TableFamily
		Set   *SetSpec
		Elems []ElemSpec
	}
)

func (o AddTable) Family() nftables.TableFamily   { return o.Fam }
func (o DelTable) Family() nftables.TableFamily   { return o.Fam }
func (o DelElems) Family() nftables.TableFamily   { return o.Fam }
func (o FlushChain) Family() nftables.TableFamily { return o.Fam }
func (o DelChain) Family() nftables.TableFamily   { return o.Fam }
func (o DelSet) Family() nftables.TableFamily     { return o.Fam }
func (o DelCounter) Family() nftables.TableFamily { return o.Fam }
func (o AddCounter) Family() nftables.TableFamily { return o.Fam }
func (o AddSet) Family() nftables.TableFamily     { return o.Fam }
func (o AddChain) Family() nftables.TableFamily   { return o.Fam }
func (o AddRules) Family() nftables.TableFamily   { return o.Fam }
func (o AddElems) Family() nftables.TableFamily   { return o.Fam }

// CounterValue is a counter's packets and bytes.
type CounterValue struct{ Packets, Bytes uint64 }

// Counts is what the kernel's counters hold: the named counters, and the
// counters of the elements of counting sets (by set, then string(key)). A
// replace creates them again with these values.
type Counts struct {
	Named map[string]CounterValue
	Elems map[string]map[string]CounterValue
}
