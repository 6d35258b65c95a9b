package kernelfeat

import (
	"bufio"
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestParseVersion(t *testing.T) {
	for rel, want := range map[string]Version{
		"6.1.0-57-cloud-amd64":         {6, 1},
		"5.10.0-32-cloud-amd64":        {5, 10},
		"6.12.117+deb13-cloud-amd64":   {6, 12},
		"6.18.44-fc-v1045":             {6, 18},
		"4.19":                         {4, 19},
		"6.6-rc1":                      {6, 6},
		"5.15.0-91-generic":            {5, 15},
		"5.14.0-362.el9.x86_64":        {5, 14},
		"6.12.95+bpo-cloud-amd64":      {6, 12},
		"6.13.0-0.rc3.20241217git.fc4": {6, 13},
	} {
		got, err := ParseVersion(rel)
		require.NoError(t, err, rel)
		assert.Equal(t, want, got, rel)
	}
	for _, bad := range []string{"", "6", "x.y", "6.x"} {
		_, err := ParseVersion(bad)
		assert.Error(t, err, bad)
	}
	assert.True(t, Version{6, 1}.AtLeast(Version{5, 18}))
	assert.True(t, Version{6, 4}.AtLeast(Version{6, 4}))
	assert.False(t, Version{6, 1}.AtLeast(Version{6, 4}))
	assert.False(t, Version{5, 10}.AtLeast(Version{6, 1}))
}

// Every feature of the table is probed on the running kernel and logged
// (make test-kernels shows the lines per kernel); one missing from a kernel
// at least as new as its Since fails, and so does a README cell of this
// kernel's column that says otherwise.
func TestTheRunningKernelHasWhatItsVersionPromises(t *testing.T) {
	k := Running()
	if _, err := os.Stat("/sys/kernel/btf/vmlinux"); err != nil {
		t.Fatalf("kernel %s has no BTF (/sys/kernel/btf/vmlinux): brokkr's programs need CONFIG_DEBUG_INFO_BTF", k.Release)
	}
	col := readmeColumn(t, k.Version)
	for _, f := range All {
		has, err := k.Has(f)
		require.NoError(t, err, f.Name)
		t.Logf("feature %s (%s): %v", f.Name, f.Since, yesNo(has))
		if !has && k.Version.AtLeast(f.Since) {
			t.Errorf("kernel %s lacks %s, which %s and later have", k.Release, f.Name, f.Since)
		}
		if cell, ok := col[f.Name]; ok && cell != yesNo(has) {
			t.Errorf("README's kernel table says %s for %s on %s; this kernel (%s) says %s", cell, f.Name, k.Version, k.Release, yesNo(has))
		}
	}
	if col == nil {
		t.Logf("README's kernel table has no column for %s", k.Version)
	}
}

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}

// readmeTable is the README's kernel table: its header and rows, split.
func readmeTable(t *testing.T) (head []string, rows [][]string) {
	t.Helper()
	f, err := os.Open("../../README.md")
	require.NoError(t, err)
	defer f.Close()
	sc := bufio.NewScanner(f)
	in := false
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if !in {
			in = strings.HasPrefix(line, "| feature | upstream |")
			if in {
				head = cells(line)
			}
			continue
		}
		if !strings.HasPrefix(line, "|") {
			break
		}
		if strings.HasPrefix(line, "|---") {
			continue
		}
		rows = append(rows, cells(line))
	}
	require.NotNil(t, head, "README.md has no table headed | feature | upstream | ...")
	return head, rows
}

func cells(line string) []string {
	parts := strings.Split(strings.Trim(line, "|"), "|")
	for i := range parts {
		parts[i] = strings.Trim(strings.TrimSpace(parts[i]), "`")
	}
	return parts
}

// readmeColumn is the README's cells for kernel v by feature name (nil when
// the table has no column for v).
func readmeColumn(t *testing.T, v Version) map[string]string {
	head, rows := readmeTable(t)
	for i, h := range head {
		if h == v.String() {
			out := map[string]string{}
			for _, r := range rows {
				require.Greater(t, len(r), i)
				out[r[0]] = r[i]
			}
			return out
		}
	}
	return nil
}

// The README's table is this package's table: the same features, in order,
// with the same upstream versions and uses.
func TestTheREADMEKernelTableIsThisTable(t *testing.T) {
	head, rows := readmeTable(t)
	require.GreaterOrEqual(t, len(head), 3)
	require.Len(t, rows, len(All))
	for i, f := range All {
		r := rows[i]
		require.Len(t, r, len(head), "row %d", i)
		assert.Equal(t, f.Name, r[0])
		assert.Equal(t, f.Since.String(), r[1], f.Name)
		assert.Equal(t, f.Used, r[2], f.Name)
		for j := 3; j < len(r); j++ {
			v, err := ParseVersion(head[j])
			require.NoError(t, err, "column %q", head[j])
			// What upstream promises: a cell may say yes before Since (a
			// backport) but never no after it.
			if v.AtLeast(f.Since) {
				assert.Equal(t, "yes", r[j], "%s on %s", f.Name, v)
			}
			assert.Contains(t, []string{"yes", "no"}, r[j])
		}
	}
}

func TestMissingNamesTheFeatureAndWrapsErrNotSupported(t *testing.T) {
	k := Running()
	if k.err != nil {
		t.Skipf("no kernel BTF: %v", k.err)
	}
	fake := Feature{"a feature from the future", Version{99, 0}, "", kfunc("brk_no_such_kfunc")}
	err := k.Missing(CgroupConnect, fake)
	require.Error(t, err)
	assert.Equal(t, "kernel "+k.Version.String()+" has no a feature from the future (99.0)", err.Error())
	assert.ErrorIs(t, err, ebpf.ErrNotSupported)
	assert.NotContains(t, err.Error(), CgroupConnect.Name)
	assert.Empty(t, k.Overdue(fake))
	assert.NoError(t, k.Missing(CgroupConnect))
	past := Feature{"a feature everyone has", Version{3, 0}, "", kfunc("brk_no_such_kfunc")}
	assert.Equal(t, []Feature{past}, k.Overdue(past))
}

type fakeTB struct{ skipped, failed string }

func (f *fakeTB) Helper()                           {}
func (f *fakeTB) Skipf(format string, args ...any)  { f.skipped = fmt.Sprintf(format, args...) }
func (f *fakeTB) Fatalf(format string, args ...any) { f.failed = fmt.Sprintf(format, args...) }

// Require skips only for a feature newer than the kernel, and fails for
// one the kernel should have.
func TestRequireSkipsForANewerFeatureAndFailsForAnOverdueOne(t *testing.T) {
	if Running().err != nil {
		t.Skipf("no kernel BTF: %v", Running().err)
	}
	var tb fakeTB
	Require(&tb, CgroupConnect)
	assert.Equal(t, fakeTB{}, tb, "a feature the kernel has")
	Require(&tb, Feature{"a feature from the future", Version{99, 0}, "", kfunc("brk_no_such_kfunc")})
	assert.Contains(t, tb.skipped, "has no a feature from the future (99.0)")
	assert.Empty(t, tb.failed)
	tb = fakeTB{}
	Require(&tb, Feature{"a feature everyone has", Version{3, 0}, "", kfunc("brk_no_such_kfunc")})
	assert.Contains(t, tb.failed, "lacks a feature everyone has, which 3.0 and later have")
}
