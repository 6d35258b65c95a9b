package procfs

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestParseProcStat(t *testing.T) {
	// A command name with spaces and ')' must not shift the fields.
	// Process group 4242, session 4243: the session is field 6, not 5.
	line := "4242 (qemu) x (y)) S 1 4242 4243 0 -1 4194560 100 0 0 0 5 3 0 0 20 0 3 0 987654 100000 500 18446744073709551615\n"
	st, err := ParseProcStat([]byte(line))
	require.NoError(t, err)
	assert.Equal(t, byte('S'), st.State)
	assert.Equal(t, uint64(987654), st.StartTime)
	assert.Equal(t, 4243, st.Session)
	_, err = ParseProcStat([]byte("4242 (qemu) S 1 2"))
	assert.Error(t, err)
	_, err = ParseProcStat([]byte("garbage"))
	assert.Error(t, err)
}

func FuzzParseProcStat(f *testing.F) {
	f.Add([]byte("1 (init) S 0 1 1 0 -1 4194560 1 2 3 4 5 6 7 8 20 0 1 0 17 1000 10 1\n"))
	f.Add([]byte("9 ((a b)) Z 1 2 3"))
	f.Fuzz(func(t *testing.T, b []byte) {
		st, err := ParseProcStat(b)
		if err == nil && st.State == 0 {
			t.Fatal("parsed without a state")
		}
	})
}
