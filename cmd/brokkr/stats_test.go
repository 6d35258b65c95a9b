package main

import (
	"encoding/binary"
	"encoding/json"
	"testing"

	"github.com/brokkr/brokkr/bpf"
	"github.com/brokkr/brokkr/internal/nstest"
	"github.com/cilium/ebpf"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

type statsRow struct {
	Name     string `json:"name"`
	Slot     int    `json:"slot"`
	HostPort uint32 `json:"hostPort"`
	bpf.Counters
}

func statsJSON(t *testing.T, dir string) []statsRow {
	t.Helper()
	out, errs, code := run(t, "stats", "--bpf-dir", dir, "-o", "json")
	require.Equal(t, 0, code, errs)
	var rows []statsRow
	require.NoError(t, json.Unmarshal([]byte(out), &rows), out)
	return rows
}

// brokkr stats reads an older brokkrd's exposure_stats (16,384 slots) where
// it is all there is, and exposure_stats_v2 once a daemon copied it: the
// same exposure in the same slot with the same counts.
func TestStatsReadsTheV1MapWhereItIsAllThereIs(t *testing.T) {
	dir := nstest.PrivateBPFFS(t)
	v1, err := ebpf.NewMapWithOptions(&ebpf.MapSpec{Name: bpf.V1MapName, Type: ebpf.Array, KeySize: 4, ValueSize: 120,
		MaxEntries: 16384, Flags: unix.BPF_F_MMAPABLE, Pinning: ebpf.PinByName}, ebpf.MapOptions{PinPath: dir})
	require.NoError(t, err)
	val := make([]byte, 120)
	copy(val, "old-web")
	binary.NativeEndian.PutUint32(val[64:], bpf.ProtoTCP)
	binary.NativeEndian.PutUint32(val[68:], 8080)
	binary.NativeEndian.PutUint64(val[80:], 7)  // accepted
	binary.NativeEndian.PutUint64(val[104:], 9) // bytes_in
	require.NoError(t, v1.Update(uint32(16383), val, ebpf.UpdateExist))
	v1.Close()

	want := statsRow{Name: "old-web", Slot: 16383, HostPort: 8080, Counters: bpf.Counters{Accepted: 7, BytesIn: 9}}
	assert.Equal(t, []statsRow{want}, statsJSON(t, dir), "v1, read where it is all there is")

	s, err := bpf.Open(dir) // the copy into v2
	require.NoError(t, err)
	defer s.Close()
	done, err := s.FinishMigration()
	require.NoError(t, err)
	require.True(t, done)
	assert.Equal(t, []statsRow{want}, statsJSON(t, dir), "v2, after the copy")
	sl, err := s.Attach("old-web", bpf.ProtoTCP, 8080)
	require.NoError(t, err)
	defer sl.Release(false)
	sl.AddAccepted(1)
	want.Accepted++
	assert.Equal(t, []statsRow{want}, statsJSON(t, dir), "v2 is the map counted into")
}
