package compile_test

import (
	"net/netip"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/brokkr/brokkr/internal/nstest"
	"github.com/brokkr/brokkr/netplane/nft"
	"github.com/brokkr/brokkr/netplane/nft/compile"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Every golden file loads with nft -f into a fresh namespace (the kernel
// accepts what the renderer prints), and what it loads is what the runtime
// applies for the same rules over netlink: both namespaces list the same
// tables. The second half proves the text says what the expressions do.
func TestGoldenLoadsAndMatchesRuntime(t *testing.T) {
	nstest.RequireRoot(t)
	for _, c := range compile.GoldenCases() {
		t.Run(c.Name(), func(t *testing.T) {
			fromText := nstest.New(t, "txt")
			path, err := filepath.Abs(compile.GoldenPath(c.Name()))
			require.NoError(t, err)
			fromText.MustRun(t, "nft", "-f", path)

			fromRuntime := nstest.New(t, "rt")
			tb, err := nft.Open(fromRuntime.Path)
			require.NoError(t, err)
			defer tb.Close()
			if c, ok := c.Rules().Cap.(compile.SetBasedCap); ok && c.OverflowPort != 0 {
				// The golden has a slow-path listener: so does the runtime
				// (on a port of its own).
				sc, err := nft.StartSetCap(tb)
				require.NoError(t, err)
				defer sc.Close()
			}
			_, err = tb.Converge(c.Rules())
			require.NoError(t, err)

			for _, fam := range []string{"inet", "bridge"} {
				want := listTable(t, fromText, fam)
				got := listTable(t, fromRuntime, fam)
				require.Equal(t, want, got, "%s table %s: nft -f of the golden file vs the runtime's netlink batch", c.Name(), fam)
			}
		})
	}
}

var (
	countersRE = regexp.MustCompile(`packets [0-9]+ bytes [0-9]+`)
	// The slow-path listener's port is the runtime's own (ephemeral).
	overflowRE = regexp.MustCompile(`(tcp comment "cap slow path" : )[0-9]+`)
)

// listTable is `nft list table` with what differs between two loads of the
// same table taken out: counter values, the listener port, element order,
// and the order of the table's objects (creation order).
func listTable(t *testing.T, ns *nstest.NS, family string) string {
	t.Helper()
	out := ns.MustRun(t, "nft", "list", "table", family, compile.TableName)
	lines := strings.Split(out, "\n")
	var norm []string
	for i := 0; i < len(lines); i++ {
		l := lines[i]
		if open := strings.Index(l, "elements = { "); open >= 0 {
			for !strings.HasSuffix(l, "}") && i+1 < len(lines) {
				i++
				l += " " + strings.TrimSpace(lines[i])
			}
			elems := strings.Split(strings.TrimSuffix(l[open+len("elements = { "):], " }"), ", ")
			slices.Sort(elems)
			l = l[:open] + "elements = { " + strings.Join(elems, ", ") + " }"
		}
		l = countersRE.ReplaceAllString(l, "packets 0 bytes 0")
		l = overflowRE.ReplaceAllString(l, "${1}PORT")
		norm = append(norm, l)
	}
	// One block per object (a line opening at one tab to its closing
	// brace), sorted.
	var blocks []string
	var cur []string
	for _, l := range norm {
		if strings.HasPrefix(l, "\t") && !strings.HasPrefix(l, "\t\t") && strings.HasSuffix(l, "{") {
			cur = []string{l}
			continue
		}
		if cur != nil {
			cur = append(cur, l)
			if l == "\t}" {
				blocks = append(blocks, strings.Join(cur, "\n"))
				cur = nil
			}
		}
	}
	slices.Sort(blocks)
	return norm[0] + "\n" + strings.Join(blocks, "\n")
}

// A table of the previous release (a chain per exposure, dispatched through
// verdict maps; testdata/previous holds its golden files) becomes the
// map-based one in one incremental batch: no replace, nothing flushed (the
// flows go where they went), and it lists what a fresh load lists.
func TestUpgradeFromAChainPerExposureTable(t *testing.T) {
	nstest.RequireRoot(t)
	cases := map[string]compile.GoldenCase{}
	for _, c := range compile.GoldenCases() {
		cases[c.Name()] = c
	}
	for _, name := range []string{"cap-kernel", "cap-tcp-set", "udp", "wildcard-and-specific-same-port"} {
		t.Run(name, func(t *testing.T) {
			c := cases[name]
			old := nstest.New(t, "old")
			path, err := filepath.Abs(filepath.Join("testdata", "previous", name+".nft"))
			require.NoError(t, err)
			old.MustRun(t, "nft", "-f", path)
			tb, err := nft.Open(old.Path)
			require.NoError(t, err)
			defer tb.Close()
			res, err := tb.Converge(c.Rules())
			require.NoError(t, err)
			require.NoError(t, res.Replaced, "one incremental batch")
			for _, ch := range res.Changes {
				assert.False(t, ch.Flush, "%v", ch)
			}
			fresh := nstest.New(t, "new")
			golden, err := filepath.Abs(compile.GoldenPath(name))
			require.NoError(t, err)
			fresh.MustRun(t, "nft", "-f", golden)
			for _, fam := range []string{"inet", "bridge"} {
				require.Equal(t, listTable(t, fresh, fam), listTable(t, old, fam), "%s table %s", name, fam)
			}
		})
	}
}

// The nat path's tables of the release before port ranges (testdata/
// before-ranges) take the interval maps and their rules in place: one
// incremental batch, no set redefined (a set's flags cannot change),
// nothing flushed, and the table lists what a fresh load lists.
func TestUpgradeToPortRanges(t *testing.T) {
	nstest.RequireRoot(t)
	cases := map[string]compile.GoldenCase{}
	for _, c := range compile.GoldenCases() {
		cases[c.Name()] = c
	}
	for _, name := range []string{"cap-kernel", "dual-stack-nat"} {
		t.Run(name, func(t *testing.T) {
			c := cases[name]
			old := nstest.New(t, "old")
			path, err := filepath.Abs(filepath.Join("testdata", "before-ranges", name+".nft"))
			require.NoError(t, err)
			old.MustRun(t, "nft", "-f", path)
			tb, err := nft.Open(old.Path)
			require.NoError(t, err)
			defer tb.Close()
			res, err := tb.Converge(c.Rules())
			require.NoError(t, err)
			require.NoError(t, res.Replaced, "one incremental batch")
			for _, ch := range res.Changes {
				assert.False(t, ch.Flush, "%v", ch)
			}
			fresh := nstest.New(t, "new")
			golden, err := filepath.Abs(compile.GoldenPath(name))
			require.NoError(t, err)
			fresh.MustRun(t, "nft", "-f", golden)
			for _, fam := range []string{"inet", "bridge"} {
				require.Equal(t, listTable(t, fresh, fam), listTable(t, old, fam), "%s table %s", name, fam)
			}
		})
	}
}

// Ranges changed in place: one grown, one moved onto ports another range
// just left, one shifted range made a kept one, one withdrawn. One
// incremental batch (the interval elements deleted with their last key,
// deletions before additions so a range may take ports another left), and
// the table lists what a fresh load of the new rules lists.
func TestPortRangesChangeInPlace(t *testing.T) {
	nstest.RequireRoot(t)
	var before compile.Rules
	for _, c := range compile.GoldenCases() {
		if c.Name() == "port-ranges" {
			before = c.Rules()
		}
	}
	require.NotEmpty(t, before.Exposures)
	ns := nstest.New(t, "rt")
	tb, err := nft.Open(ns.Path)
	require.NoError(t, err)
	defer tb.Close()
	_, err = tb.Converge(before)
	require.NoError(t, err)

	after := before
	after.Exposures = nil
	for _, e := range before.Exposures {
		switch e.Name {
		case "games": // grown
			e.HostPortLast, e.GuestPortLast = 30199, 30199
		case "voice": // moved
			e.HostPort, e.HostPortLast = 41000, 41009
		case "shifted": // onto the ports voice left, kept
			e.HostPort, e.HostPortLast, e.GuestPort, e.GuestPortLast = 40000, 40002, 40000, 40002
			e.HostAddr = netip.MustParseAddr("192.0.2.1")
		case "games6": // withdrawn
			continue
		}
		after.Exposures = append(after.Exposures, e)
	}
	res, err := tb.Converge(after)
	require.NoError(t, err)
	require.NoError(t, res.Replaced, "one incremental batch")
	changed := map[string]bool{}
	for _, ch := range res.Changes {
		if ch.Flush {
			changed[ch.Exposure.Name] = true
		}
	}
	assert.Equal(t, map[string]bool{"games": true, "voice": true, "shifted": true, "games6": true}, changed, "%v", res.Changes)

	inet, bridge, err := compile.Whole(after)
	require.NoError(t, err)
	var text []string
	for _, tab := range []*compile.TableSpec{inet, bridge} {
		s, err := compile.Render(tab)
		require.NoError(t, err)
		text = append(text, s)
	}
	path := filepath.Join(t.TempDir(), "after.nft")
	require.NoError(t, os.WriteFile(path, []byte(strings.Join(text, "\n")), 0o644))
	fresh := nstest.New(t, "new")
	fresh.MustRun(t, "nft", "-f", path)
	for _, fam := range []string{"inet", "bridge"} {
		require.Equal(t, listTable(t, fresh, fam), listTable(t, ns, fam), "table %s", fam)
	}
}

// A batch large enough to be verified (an element looked up after it per
// message, and its last) of interval elements and of a shifted range's
// per-port targets verifies: the lookups send an interval element's last
// key too, and no replace follows.
func TestManyPortRangesVerify(t *testing.T) {
	nstest.RequireRoot(t)
	var r compile.Rules
	for _, c := range compile.GoldenCases() {
		if c.Name() == "port-ranges" {
			r = c.Rules()
		}
	}
	g := r.Exposures[0].GuestAddr
	r.Exposures = nil
	for i := range 1500 {
		first := uint16(10000 + 10*i)
		r.Exposures = append(r.Exposures, compile.Exposure{Name: "r" + strconv.Itoa(i), Protocol: "tcp", HostPort: first, HostPortLast: first + 9,
			GuestAddr: g, GuestPort: first, GuestPortLast: first + 9, MarkID: uint32(i + 1)})
	}
	r.Exposures = append(r.Exposures, compile.Exposure{Name: "shifted", Protocol: "udp", HostPort: 2000, HostPortLast: 3999,
		GuestAddr: g, GuestPort: 5000, GuestPortLast: 6999, MarkID: 2000})
	ns := nstest.New(t, "rt")
	tb, err := nft.Open(ns.Path)
	require.NoError(t, err)
	defer tb.Close()
	res, err := tb.Converge(r)
	require.NoError(t, err)
	require.NoError(t, res.Replaced, "verified, not replaced")
	out := ns.MustRun(t, "nft", "list", "map", "inet", compile.TableName, compile.MapExpAnyRange)
	assert.Equal(t, 1500, strings.Count(out, "comment \"r"), "every range is one element")
	assert.Contains(t, out, "tcp . 24990-24999")
	out = ns.MustRun(t, "nft", "list", "map", "inet", compile.TableName, compile.MapExpTargetPort)
	assert.Equal(t, 2000, strings.Count(out, "comment \"shifted\""), "one target per port")
	assert.Contains(t, out, ". 3999 comment \"shifted\" : ")

	// A new process reads the tables back whole (the interval elements'
	// keys joined again): nothing to repair, nothing flushed.
	tb2, err := nft.Open(ns.Path)
	require.NoError(t, err)
	defer tb2.Close()
	res, err = tb2.Converge(r)
	require.NoError(t, err)
	require.NoError(t, res.Replaced)
	assert.Empty(t, res.Repaired)
	for _, ch := range res.Changes {
		assert.False(t, ch.Flush, "%v", ch)
	}

	// Another program deletes a range's element: the next pass puts it
	// back, a repair.
	ns.MustRun(t, "nft", "delete", "element", "inet", compile.TableName, compile.MapExpAnyRange, "{ tcp . 10010-10019 }")
	res, err = tb2.Converge(r)
	require.NoError(t, err)
	require.NoError(t, res.Replaced)
	require.Len(t, res.Repaired, 1, "%v", res.Repaired)
	assert.Contains(t, res.Repaired[0].String(), compile.MapExpAnyRange)
	out = ns.MustRun(t, "nft", "list", "map", "inet", compile.TableName, compile.MapExpAnyRange)
	assert.Contains(t, out, "tcp . 10010-10019 comment \"r1\"")
}
