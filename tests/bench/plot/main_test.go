package main

import (
	"image/png"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// testdata/nat-scale.csv is the CSV of a real nat.sh run (2026-12-01, the
// run BENCHMARKS.md quotes), copied as a fixture.
func TestParseFixture(t *testing.T) {
	f, err := os.Open("testdata/nat-scale.csv")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	r, err := parse(f)
	if err != nil {
		t.Fatal(err)
	}
	if len(r.Rows) != 5 || r.Rows[0].Exposures != 10 || r.Rows[4].Exposures != 100000 {
		t.Fatalf("rows: %+v", r.Rows)
	}
	if !strings.HasPrefix(r.Comment, "natscale scale ") {
		t.Errorf("comment %q", r.Comment)
	}
	if !r.hasLatency() {
		t.Error("fixture has latency columns")
	}
	for _, x := range r.Rows {
		if x.ApplyMS <= 0 || x.OneMoreMS <= 0 || x.NatP99 < x.NatP50 || x.DirectP99 < x.DirectP50 {
			t.Errorf("row %+v", x)
		}
	}
}

func TestParseErrors(t *testing.T) {
	h := strings.Join(header, ",") + "\n"
	for name, in := range map[string]string{
		"empty":      "",
		"bad header": "exposures,apply\n10,1\n",
		"no rows":    "# c\n" + h,
		"not number": h + "10,x,1,1,1,1,1\n",
		"negative":   h + "10,1,1,-1,1,1,1\n",
		"zero size":  h + "0,1,1,1,1,1,1\n",
		"zero apply": h + "10,0,1,1,1,1,1\n",
		"short row":  h + "10,1,1\n",
	} {
		if _, err := parse(strings.NewReader(in)); err == nil {
			t.Errorf("%s: no error", name)
		}
	}
}

func TestRender(t *testing.T) {
	dir := t.TempDir()
	if err := mainErr("testdata/nat-scale.csv", dir); err != nil {
		t.Fatal(err)
	}
	for _, n := range []string{"nat-apply.png", "nat-latency.png"} {
		f, err := os.Open(filepath.Join(dir, n))
		if err != nil {
			t.Fatal(err)
		}
		img, err := png.Decode(f)
		f.Close()
		if err != nil {
			t.Fatalf("%s: %v", n, err)
		}
		if b := img.Bounds(); b.Dx() < 400 || b.Dy() < 300 {
			t.Errorf("%s: %v, too small to read", n, b)
		}
	}
}

// Without latency columns (natscale scale -latency=false) only the apply
// plot is drawn.
func TestRenderApplyOnly(t *testing.T) {
	in := strings.Join(header, ",") + "\n10,1.5,0.2,0,0,0,0\n1000,30,2,0,0,0,0\n"
	r, err := parse(strings.NewReader(in))
	if err != nil {
		t.Fatal(err)
	}
	paths, err := render(r, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	if len(paths) != 1 || filepath.Base(paths[0]) != "nat-apply.png" {
		t.Fatalf("paths %v", paths)
	}
}

// testdata/nat-changes.csv is a real `natscale changes` run (2026-12-02,
// a shared machine), copied as a fixture.
func TestRenderChanges(t *testing.T) {
	b, err := os.ReadFile("testdata/nat-changes.csv")
	if err != nil {
		t.Fatal(err)
	}
	if !isChanges(b) {
		t.Fatal("not recognized as a changes CSV")
	}
	r, err := parseChanges(strings.NewReader(string(b)))
	if err != nil {
		t.Fatal(err)
	}
	if len(r.Rows) != 4 || r.Rows[3].Exposures != 100000 {
		t.Fatalf("rows: %+v", r.Rows)
	}
	for _, x := range r.Rows {
		for _, m := range changesMetrics {
			v := x.M[m]
			if !(v[1] <= v[0] && v[0] <= v[2]) {
				t.Errorf("%v exposures, %s: median %v outside [%v, %v]", x.Exposures, m, v[0], v[1], v[2])
			}
		}
	}
	dir := t.TempDir()
	paths, err := renderChanges(r, dir)
	if err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(paths[0])
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	img, err := png.Decode(f)
	if err != nil {
		t.Fatal(err)
	}
	if b := img.Bounds(); b.Dx() < 400 || b.Dy() < 300 {
		t.Errorf("image %v", b)
	}
	if err := mainErr("testdata/nat-changes.csv", dir); err != nil {
		t.Fatal(err)
	}
	if _, err := parseChanges(strings.NewReader(strings.Join(changesHeader(), ",") + "\n10,0,1,1,1" + strings.Repeat(",1", 20) + "\n")); err == nil {
		t.Error("a zero time must be refused (log axes)")
	}
}
