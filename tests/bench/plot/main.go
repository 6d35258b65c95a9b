// Command plot draws the nat scale benchmark's PNGs from the CSV that
// `natscale scale -csv` or `natscale changes -csv` writes
// (tests/bench/nat.sh runs them):
//
//	plot -csv OUT/nat-scale.csv -out OUT
//	plot -csv OUT/nat-changes.csv -out OUT   (OUT/nat-changes.png)
//
// writes OUT/nat-apply.png (whole-table apply and one-more-exposure change
// time against the number of exposures) and OUT/nat-latency.png (connect
// latency p50/p99 through the DNAT map against direct routing). Both x axes
// are logarithmic: the sizes are powers of ten.
package main

import (
	"bytes"
	"encoding/csv"
	"errors"
	"flag"
	"fmt"
	stdcolor "image/color"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
)

// header is what natscale writes (tests/bench/natscale csvHeader).
var header = []string{"exposures", "apply_ms", "one_more_ms", "nat_p50_us", "nat_p99_us", "direct_p50_us", "direct_p99_us"}

// row is one size of a scale run.
type row struct {
	Exposures                            float64
	ApplyMS, OneMoreMS                   float64
	NatP50, NatP99, DirectP50, DirectP99 float64 // µs; 0 = not measured
}

// run is one CSV: the "# ..." lines (when, kernel) and the rows.
type run struct {
	Comment string
	Rows    []row
}

func (r run) hasLatency() bool {
	for _, x := range r.Rows {
		if x.NatP50 <= 0 || x.DirectP50 <= 0 {
			return false
		}
	}
	return len(r.Rows) > 0
}

func parse(rd io.Reader) (run, error) {
	b, err := io.ReadAll(rd)
	if err != nil {
		return run{}, err
	}
	var out run
	var comments []string
	for _, l := range strings.Split(string(b), "\n") {
		if c, ok := strings.CutPrefix(l, "#"); ok {
			comments = append(comments, strings.TrimSpace(c))
		}
	}
	out.Comment = strings.Join(comments, "; ")
	cr := csv.NewReader(bytes.NewReader(b))
	cr.Comment = '#'
	recs, err := cr.ReadAll()
	if err != nil {
		return run{}, err
	}
	if len(recs) == 0 || strings.Join(recs[0], ",") != strings.Join(header, ",") {
		return run{}, fmt.Errorf("header must be %s", strings.Join(header, ","))
	}
	if len(recs) == 1 {
		return run{}, errors.New("no rows")
	}
	for i, rec := range recs[1:] {
		var v [7]float64
		for j, f := range rec {
			if v[j], err = strconv.ParseFloat(f, 64); err != nil || v[j] < 0 {
				return run{}, fmt.Errorf("row %d, %s: %q is not a non-negative number", i+1, header[j], f)
			}
		}
		// The axes are logarithmic: a size or a time of 0 has no place.
		if v[0] < 1 || v[1] <= 0 || v[2] <= 0 {
			return run{}, fmt.Errorf("row %d: exposures, apply_ms and one_more_ms must be positive", i+1)
		}
		out.Rows = append(out.Rows, row{v[0], v[1], v[2], v[3], v[4], v[5], v[6]})
	}
	return out, nil
}

// sizeTicks labels exactly the measured sizes (10, 100, 1k, ...).
func sizeTicks(rows []row) plot.ConstantTicks {
	var t plot.ConstantTicks
	for _, r := range rows {
		l := strconv.FormatFloat(r.Exposures, 'f', -1, 64)
		if r.Exposures >= 1000 && int(r.Exposures)%1000 == 0 {
			l = strconv.Itoa(int(r.Exposures)/1000) + "k"
		}
		t = append(t, plot.Tick{Value: r.Exposures, Label: l})
	}
	return t
}

func newPlot(title string, r run) *plot.Plot {
	p := plot.New()
	p.Title.Text = title
	if r.Comment != "" {
		p.Title.Text += "\n" + r.Comment
	}
	p.X.Label.Text = "exposures (log scale)"
	p.X.Scale = plot.LogScale{}
	p.X.Tick.Marker = sizeTicks(r.Rows)
	p.Legend.Top = true
	p.Legend.Left = true
	p.Legend.Padding = vg.Points(2)
	p.Legend.ThumbnailWidth = vg.Points(24)
	p.Add(plotter.NewGrid())
	return p
}

// plainTicks are gonum's default ticks labelled without trailing zeros
// ("250", not "250.00").
type plainTicks struct{}

func (plainTicks) Ticks(lo, hi float64) []plot.Tick {
	ts := plot.DefaultTicks{}.Ticks(lo, hi)
	for i := range ts {
		if ts[i].Label != "" {
			ts[i].Label = strconv.FormatFloat(ts[i].Value, 'f', -1, 64)
		}
	}
	return ts
}

type series struct {
	name  string
	y     func(row) float64
	color color
	dash  []vg.Length
	shape draw.GlyphDrawer
}

func addSeries(p *plot.Plot, rows []row, ss []series) error {
	for _, s := range ss {
		pts := make(plotter.XYs, len(rows))
		for i, r := range rows {
			pts[i] = plotter.XY{X: r.Exposures, Y: s.y(r)}
		}
		l, sc, err := plotter.NewLinePoints(pts)
		if err != nil {
			return err
		}
		l.Color, l.Dashes, l.Width = s.color, s.dash, vg.Points(1.5)
		sc.Color, sc.Shape, sc.Radius = s.color, s.shape, vg.Points(3)
		p.Add(l, sc)
		p.Legend.Add(s.name, l, sc)
	}
	return nil
}

type color = stdcolor.Color

var (
	blue  = stdcolor.RGBA{R: 0x1f, G: 0x77, B: 0xb4, A: 0xff}
	red   = stdcolor.RGBA{R: 0xd6, G: 0x27, B: 0x28, A: 0xff}
	grey  = stdcolor.RGBA{R: 0x55, G: 0x55, B: 0x55, A: 0xff}
	green = stdcolor.RGBA{R: 0x2c, G: 0xa0, B: 0x2c, A: 0xff}
)

// plotApply: both times on a log y axis, since they span 10 ms to seconds.
func plotApply(r run, path string) error {
	p := newPlot("netplane/nft: apply time vs exposures", r)
	p.Y.Label.Text = "time (ms, log scale)"
	p.Y.Scale = plot.LogScale{}
	p.Y.Tick.Marker = plot.LogTicks{Prec: -1}
	// A decade of headroom for the legend (top left).
	top := 0.0
	for _, x := range r.Rows {
		top = max(top, x.ApplyMS, x.OneMoreMS)
	}
	p.Y.Max = top * 10
	if err := addSeries(p, r.Rows, []series{
		{"whole table, one Converge", func(x row) float64 { return x.ApplyMS }, blue, nil, draw.CircleGlyph{}},
		{"one more exposure (median of 5)", func(x row) float64 { return x.OneMoreMS }, red, []vg.Length{vg.Points(5), vg.Points(3)}, draw.TriangleGlyph{}},
	}); err != nil {
		return err
	}
	return p.Save(18*vg.Centimeter, 12*vg.Centimeter, path)
}

// plotLatency: a linear y axis from 0, so the DNAT path's cost reads as
// the gap between the curves.
func plotLatency(r run, path string) error {
	p := newPlot("connect latency to the last exposure vs exposures", r)
	p.Y.Label.Text = "connect latency (µs)"
	p.Y.Min = 0
	// Headroom above the highest point for the legend (top left).
	top := 0.0
	for _, x := range r.Rows {
		top = max(top, x.NatP99, x.DirectP99, x.NatP50, x.DirectP50)
	}
	p.Y.Max = top * 1.5
	p.Y.Tick.Marker = plainTicks{}
	dash := []vg.Length{vg.Points(5), vg.Points(3)}
	if err := addSeries(p, r.Rows, []series{
		{"DNAT map p50", func(x row) float64 { return x.NatP50 }, blue, nil, draw.CircleGlyph{}},
		{"DNAT map p99", func(x row) float64 { return x.NatP99 }, blue, dash, draw.CircleGlyph{}},
		{"direct (no NAT) p50", func(x row) float64 { return x.DirectP50 }, grey, nil, draw.BoxGlyph{}},
		{"direct (no NAT) p99", func(x row) float64 { return x.DirectP99 }, grey, dash, draw.BoxGlyph{}},
	}); err != nil {
		return err
	}
	return p.Save(18*vg.Centimeter, 12*vg.Centimeter, path)
}

// render writes the PNGs for r into dir and returns their paths.
func render(r run, dir string) ([]string, error) {
	out := []string{filepath.Join(dir, "nat-apply.png")}
	if err := plotApply(r, out[0]); err != nil {
		return nil, err
	}
	if !r.hasLatency() {
		return out, nil // natscale scale -latency=false
	}
	out = append(out, filepath.Join(dir, "nat-latency.png"))
	return out, plotLatency(r, out[1])
}

func main() {
	in := flag.String("csv", "", "natscale scale -csv output")
	dir := flag.String("out", ".", "directory for the PNGs")
	flag.Parse()
	if err := mainErr(*in, *dir); err != nil {
		fmt.Fprintln(os.Stderr, "plot:", err)
		os.Exit(1)
	}
}

func mainErr(in, dir string) error {
	b, err := os.ReadFile(in)
	if err != nil {
		return err
	}
	if isChanges(b) {
		r, err := parseChanges(bytes.NewReader(b))
		if err != nil {
			return fmt.Errorf("%s: %w", in, err)
		}
		paths, err := renderChanges(r, dir)
		for _, p := range paths {
			fmt.Println("wrote", p)
		}
		return err
	}
	r, err := parse(bytes.NewReader(b))
	if err != nil {
		return fmt.Errorf("%s: %w", in, err)
	}
	paths, err := render(r, dir)
	for _, p := range paths {
		fmt.Println("wrote", p)
	}
	return err
}
