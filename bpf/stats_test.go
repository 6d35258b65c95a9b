package bpf

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"testing"

	"github.com/brokkr/brokkr/internal/nstest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestSlotsSurviveAReopenAndAreZeroedOnDelete(t *testing.T) {
	dir := nstest.PrivateBPFFS(t)
	s, err := Open(dir)
	require.NoError(t, err)
	require.True(t, s.Pinned())

	web, err := s.Attach("web-http", ProtoTCP, 8080)
	require.NoError(t, err)
	dns, err := s.Attach("dns", ProtoUDP, 5353)
	require.NoError(t, err)
	require.NotEqual(t, web.Index(), dns.Index())
	web.Opened()
	web.Opened()
	web.Closed()
	web.AddRefused(3)
	web.AddDropped(1)
	web.AddBytes(100, 4000)
	web.Release(false)
	dns.Release(false)
	require.NoError(t, s.Close())

	// A new process finds the same slot by name and keeps counting.
	s2, err := Open(dir)
	require.NoError(t, err)
	defer s2.Close()
	again, err := s2.Attach("web-http", ProtoTCP, 8080)
	require.NoError(t, err)
	assert.Equal(t, web.Index(), again.Index())
	assert.Equal(t, Counters{Active: 1, Accepted: 2, Refused: 3, Dropped: 1, BytesIn: 100, BytesOut: 4000}, again.Read())
	again.Opened()
	assert.EqualValues(t, 3, again.Read().Accepted)

	// Deleting the exposure zeroes and frees the slot.
	again.Release(true)
	_, ok := s2.Lookup("web-http")
	assert.False(t, ok)
	fresh, err := s2.Attach("web-http", ProtoTCP, 8080)
	require.NoError(t, err)
	assert.Equal(t, Counters{}, fresh.Read())
	fresh.Release(true)
}

func TestBpftoolPrintsNamedFields(t *testing.T) {
	dir := nstest.PrivateBPFFS(t)
	if _, err := exec.LookPath("bpftool"); err != nil {
		t.Skip("bpftool not installed")
	}
	s, err := Open(dir)
	require.NoError(t, err)
	defer s.Close()
	sl, err := s.Attach("web-http", ProtoTCP, 8080)
	require.NoError(t, err)
	defer sl.Release(true)
	sl.Opened()
	sl.AddBytes(7, 9)

	out, err := exec.Command("bpftool", "-j", "map", "dump", "pinned", s.Path()).Output()
	require.NoError(t, err)
	// With BTF, -j prints raw bytes plus a "formatted" view with field names.
	var rows []struct {
		Formatted struct {
			Key   uint32         `json:"key"`
			Value map[string]any `json:"value"`
		} `json:"formatted"`
	}
	require.NoError(t, json.Unmarshal(out, &rows), "%s", out)
	var found map[string]any
	for _, r := range rows {
		if int(r.Formatted.Key) == sl.Index() {
			found = r.Formatted.Value
		}
	}
	require.NotNil(t, found, "slot %d not in bpftool's dump", sl.Index())
	for _, f := range []string{"name", "protocol", "host_port", "active", "accepted", "refused", "dropped", "bytes_in", "bytes_out"} {
		assert.Contains(t, found, f)
	}
	assert.EqualValues(t, 8080, found["host_port"])
	assert.EqualValues(t, 1, found["accepted"])
	assert.EqualValues(t, 9, found["bytes_out"])
	// bpftool prints a char array as a string when BTF says char (a
	// lookup of the one slot: a plain dump of all Slots entries takes
	// bpftool seconds more).
	key := []string{"map", "lookup", "pinned", s.Path(), "key"}
	for _, b := range []int{sl.Index() & 0xff, sl.Index() >> 8 & 0xff, sl.Index() >> 16 & 0xff, 0} {
		key = append(key, strconv.Itoa(b))
	}
	plain, err := exec.Command("bpftool", key...).Output()
	require.NoError(t, err)
	assert.Contains(t, string(plain), `"web-http"`)

	entries, err := Dump(s.Path())
	require.NoError(t, err)
	require.Len(t, entries, 1)
	assert.Equal(t, "web-http", entries[0].Name)
	assert.EqualValues(t, 7, entries[0].BytesIn)
}

func TestInMemoryStoreCountsTheSame(t *testing.T) {
	s := NewInMemory("not root")
	defer s.Close()
	assert.False(t, s.Pinned())
	assert.Equal(t, "not root", s.Reason())
	sl, err := s.Attach("x", ProtoTCP, 1)
	require.NoError(t, err)
	var wg sync.WaitGroup
	for i := 0; i < 8; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := 0; j < 1000; j++ {
				sl.Opened()
				sl.Closed()
			}
		}()
	}
	wg.Wait()
	assert.Equal(t, Counters{Accepted: 8000}, sl.Read())
	sl.Release(true)
	assert.Empty(t, s.Entries())
}

func TestSharedSlotIsZeroedOnlyWhenTheLastHolderDeletes(t *testing.T) {
	s := NewInMemory("test")
	a, err := s.Attach("e", ProtoTCP, 80)
	require.NoError(t, err)
	b, err := s.Attach("e", ProtoTCP, 80)
	require.NoError(t, err)
	require.Equal(t, a.Index(), b.Index())
	a.AddRefused(2)
	a.Release(true)
	c, ok := s.Lookup("e")
	require.True(t, ok, "still held by b")
	assert.EqualValues(t, 2, c.Refused)
	b.Release(true)
	_, ok = s.Lookup("e")
	assert.False(t, ok)
}

func TestPruneFreesOnlyUnheldUnknownSlots(t *testing.T) {
	s := NewInMemory("test")
	held, _ := s.Attach("held", ProtoTCP, 1)
	left, _ := s.Attach("left-behind", ProtoTCP, 2)
	kept, _ := s.Attach("kept", ProtoTCP, 3)
	left.Release(false)
	kept.Release(false)
	gone := s.Prune(func(n string) bool { return n == "kept" })
	assert.Equal(t, []string{"left-behind"}, gone)
	_, ok := s.Lookup("kept")
	assert.True(t, ok)
	_, ok = s.Lookup("held")
	assert.True(t, ok)
	held.Release(true)
}

func TestBadNamesAreRefused(t *testing.T) {
	s := NewInMemory("test")
	_, err := s.Attach("", ProtoTCP, 1)
	assert.ErrorContains(t, err, "empty")
	long := make([]byte, NameLen)
	for i := range long {
		long[i] = 'a'
	}
	_, err = s.Attach(string(long), ProtoTCP, 1)
	assert.ErrorContains(t, err, "longer than")
}

func TestOpenRefusesADirectoryThatIsNotBPFFS(t *testing.T) {
	_, err := Open(t.TempDir())
	assert.ErrorContains(t, err, "not on a bpffs")
}

// FeedKernelBytes remembers, in the pinned fallback_bytes_fed_v2 map, what
// it fed: a reopened store goes on from there, so the bytes the kernel
// counted while no daemon ran are counted, once. A store pinned by a
// brokkrd before that map (it is made where missing) takes one baseline.
// (Fails with the map's Swap replaced by a process-local memory: the
// reopened store's first feed is a baseline.)
func TestFeedKernelBytesGoesOnFromWhatWasFedAcrossAReopen(t *testing.T) {
	dir := nstest.PrivateBPFFS(t)
	s, sl := openWeb(t, dir)
	sl.FeedKernelTotals(7, 1)
	sl.FeedKernelBytes(100, 1000)
	sl.FeedKernelBytes(150, 1200)
	sl.FeedKernelTotals(9, 1)
	c := sl.Read()
	assert.EqualValues(t, 150, c.BytesIn, "a new exposure's byte counters start with its slot")
	assert.EqualValues(t, 1200, c.BytesOut)
	assert.EqualValues(t, 9, c.Accepted, "the bytes' record is not accepted's")
	sl.Release(false)
	require.NoError(t, s.Close())

	s, sl = openWeb(t, dir)
	sl.FeedKernelBytes(400, 1300) // 250 and 100 while no daemon ran
	c = sl.Read()
	assert.EqualValues(t, 400, c.BytesIn, "no first-read baseline after a reopen")
	assert.EqualValues(t, 1300, c.BytesOut)
	sl.FeedKernelBytes(20, 5) // the table made its counters anew
	assert.EqualValues(t, 420, sl.Read().BytesIn, "a counter that went backwards restarted from zero")
	sl.Release(false)
	require.NoError(t, s.Close())

	// An earlier brokkrd's pins, without the bytes map: one baseline.
	require.NoError(t, os.Remove(filepath.Join(dir, BytesFedMapName)))
	s, sl = openWeb(t, dir)
	defer s.Close()
	defer sl.Release(true)
	sl.FeedKernelBytes(30, 10)
	assert.EqualValues(t, 420, sl.Read().BytesIn, "no record: the first values are a baseline")
	sl.FeedKernelBytes(35, 10)
	assert.EqualValues(t, 425, sl.Read().BytesIn)
}

// FeedKernelTotals remembers, in the pinned fallback_fed_v2 map, what it fed:
// a reopened store (a new daemon) goes on from there.
func TestFeedKernelTotalsGoesOnFromWhatWasFedAcrossAReopen(t *testing.T) {
	dir := nstest.PrivateBPFFS(t)
	s, sl := openWeb(t, dir)
	sl.FeedKernelTotals(10, 1)
	sl.FeedKernelTotals(12, 1)
	assert.EqualValues(t, 12, sl.Read().Accepted)
	sl.Release(false)
	require.NoError(t, s.Close())

	s, sl = openWeb(t, dir)
	defer s.Close()
	sl.FeedKernelTotals(15, 2)
	c := sl.Read()
	assert.EqualValues(t, 15, c.Accepted, "no first-read baseline after a reopen")
	assert.EqualValues(t, 2, c.Refused)

	// A slot an older brokkrd fed without a record: one baseline.
	fedWord(s.fmem, sl.i, offFedValid).Store(0)
	sl.FeedKernelTotals(40, 2)
	assert.EqualValues(t, 15, sl.Read().Accepted, "no record: the first values are a baseline")
	sl.FeedKernelTotals(41, 2)
	assert.EqualValues(t, 16, sl.Read().Accepted)

	// Deleting the exposure zeroes its record with it.
	sl.Release(true)
	sl, err := s.Attach("web", ProtoTCP, 80)
	require.NoError(t, err)
	defer sl.Release(true)
	sl.FeedKernelTotals(3, 0)
	assert.EqualValues(t, 3, sl.Read().Accepted, "a new exposure counts from its counters' zero")
}

// openWeb opens the store pinned in dir and attaches exposure web to it.
func openWeb(t *testing.T, dir string) (*Store, *Slot) {
	t.Helper()
	s, err := Open(dir)
	require.NoError(t, err)
	sl, err := s.Attach("web", ProtoTCP, 80)
	require.NoError(t, err)
	return s, sl
}
