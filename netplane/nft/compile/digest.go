package compile

// Digest sums a set's elements: their count and the sum of one 64-bit hash
// per element, so adding or removing an element updates it in O(1) and two
// sets holding the same elements have the same digest whatever their order.
// The runtime computes it while it dumps a set; the state keeps it for what
// it applied. Equal digests stand for equal elements: brokkr then skips
// decoding and comparing 100,000 elements when another program's commit
// moved the ruleset generation but left brokkr's maps alone.
type Digest struct {
	Count int
	Sum   uint64
}

func (d Digest) add(e ElemSpec) Digest { return d.Add(ElemHash(e)) }

// Add counts one more element, of hash h (ElemHash, HashParts).
func (d Digest) Add(h uint64) Digest   { return Digest{d.Count + 1, d.Sum + h} }
func (d Digest) sub(e ElemSpec) Digest { return Digest{d.Count - 1, d.Sum - ElemHash(e)} }

// Plus is the digest of the union of two disjoint sets of elements.
func (d Digest) Plus(o Digest) Digest { return Digest{d.Count + o.Count, d.Sum + o.Sum} }

// DigestOf is the digest of elems.
func DigestOf(elems map[string]ElemSpec) Digest {
	var d Digest
	for _, e := range elems {
		d = d.add(e)
	}
	return d
}

// ElemHash is FNV-1a (64 bit) over what makes an element what it is: key,
// value, verdict and comment, each followed by a separator byte.
func ElemHash(e ElemSpec) uint64 { return HashParts(e.Key, e.Val, e.Verdict, e.Comment) }

// HashParts is ElemHash of an element given by its parts, as a dump
// decodes them (no ElemSpec is built for it).
func HashParts[V, C ~string | ~[]byte](key, val []byte, verdict V, comment C) uint64 {
	h := uint64(14695981039346656037)
	for _, b := range key {
		h = (h ^ uint64(b)) * 1099511628211
	}
	h = (h ^ 0xff) * 1099511628211
	for _, b := range val {
		h = (h ^ uint64(b)) * 1099511628211
	}
	h = (h ^ 0xff) * 1099511628211
	for i := 0; i < len(verdict); i++ {
		h = (h ^ uint64(verdict[i])) * 1099511628211
	}
	h = (h ^ 0xff) * 1099511628211
	for i := 0; i < len(comment); i++ {
		h = (h ^ uint64(comment[i])) * 1099511628211
	}
	return (h ^ 0xff) * 1099511628211
}
