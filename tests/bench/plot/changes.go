package main

import (
	"bytes"
	"encoding/csv"
	"errors"
	"fmt"
	"io"
	"path/filepath"
	"strconv"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
)

// The changes benchmark (`natscale changes -csv`): per size, for each
// measurement, the median, lowest and highest wall time of the rounds and
// the median CPU time.
var changesMetrics = []string{"apply", "add", "remove", "more", "nochange", "foreign"}

func changesHeader() []string {
	h := []string{"exposures"}
	for _, m := range changesMetrics {
		h = append(h, m+"_ms", m+"_lo_ms", m+"_hi_ms", m+"_cpu_ms")
	}
	return h
}

// changesRow is one size: per metric, median, low, high (wall) and CPU.
type changesRow struct {
	Exposures float64
	M         map[string][4]float64
}

type changesRun struct {
	Comment string
	Rows    []changesRow
}

func isChanges(b []byte) bool {
	for _, l := range strings.Split(string(b), "\n") {
		if !strings.HasPrefix(l, "#") {
			return strings.HasPrefix(l, strings.Join(changesHeader(), ","))
		}
	}
	return false
}

func parseChanges(rd io.Reader) (changesRun, error) {
	b, err := io.ReadAll(rd)
	if err != nil {
		return changesRun{}, err
	}
	var out changesRun
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
		return changesRun{}, err
	}
	h := changesHeader()
	if len(recs) == 0 || strings.Join(recs[0], ",") != strings.Join(h, ",") {
		return changesRun{}, fmt.Errorf("header must be %s", strings.Join(h, ","))
	}
	if len(recs) == 1 {
		return changesRun{}, errors.New("no rows")
	}
	for i, rec := range recs[1:] {
		if len(rec) != len(h) {
			return changesRun{}, fmt.Errorf("row %d: %d fields, want %d", i+1, len(rec), len(h))
		}
		v := make([]float64, len(rec))
		for j, f := range rec {
			// The axes are logarithmic: every figure must be positive.
			if v[j], err = strconv.ParseFloat(f, 64); err != nil || v[j] <= 0 {
				return changesRun{}, fmt.Errorf("row %d, %s: %q is not a positive number", i+1, h[j], f)
			}
		}
		row := changesRow{Exposures: v[0], M: map[string][4]float64{}}
		for k, m := range changesMetrics {
			row.M[m] = [4]float64{v[1+4*k], v[2+4*k], v[3+4*k], v[4+4*k]}
		}
		out.Rows = append(out.Rows, row)
	}
	return out, nil
}

// plotChanges draws every measurement's median (lines) with the rounds'
// lowest and highest (unjoined marks), on log-log axes.
func plotChanges(r changesRun, path string) error {
	p := plot.New()
	p.Title.Text = "netplane/nft: what a change costs vs exposures"
	if r.Comment != "" {
		p.Title.Text += "\n" + r.Comment
	}
	p.X.Label.Text = "exposures (log scale)"
	p.X.Scale = plot.LogScale{}
	var rows []row
	for _, x := range r.Rows {
		rows = append(rows, row{Exposures: x.Exposures})
	}
	p.X.Tick.Marker = sizeTicks(rows)
	p.Y.Label.Text = "wall time (ms, log scale)"
	p.Y.Scale = plot.LogScale{}
	p.Y.Tick.Marker = plot.LogTicks{Prec: -1}
	p.Legend.Top = true
	p.Legend.Left = true
	p.Legend.Padding = vg.Points(2)
	p.Legend.ThumbnailWidth = vg.Points(24)
	p.Add(plotter.NewGrid())
	top, bottom := 0.0, 1e18
	for _, x := range r.Rows {
		for _, v := range x.M {
			top, bottom = max(top, v[2]), min(bottom, v[1])
		}
	}
	p.Y.Max, p.Y.Min = top*100, bottom/2
	type style struct {
		name  string
		color color
		shape draw.GlyphDrawer
		dash  []vg.Length
	}
	dash := []vg.Length{vg.Points(5), vg.Points(3)}
	styles := map[string]style{
		"apply":    {"whole table into an empty one (Converge)", blue, draw.CircleGlyph{}, nil},
		"add":      {"one more (Update)", red, draw.TriangleGlyph{}, nil},
		"remove":   {"one less (Update)", red, draw.BoxGlyph{}, dash},
		"more":     {"one more (Converge of the whole state)", grey, draw.TriangleGlyph{}, nil},
		"nochange": {"no change (Converge)", grey, draw.CircleGlyph{}, dash},
		"foreign":  {"no change, after another program's commit", green, draw.PlusGlyph{}, dash},
	}
	for _, m := range changesMetrics {
		st := styles[m]
		med := make(plotter.XYs, len(r.Rows))
		var spread plotter.XYs
		for i, x := range r.Rows {
			med[i] = plotter.XY{X: x.Exposures, Y: x.M[m][0]}
			spread = append(spread, plotter.XY{X: x.Exposures, Y: x.M[m][1]}, plotter.XY{X: x.Exposures, Y: x.M[m][2]})
		}
		l, sc, err := plotter.NewLinePoints(med)
		if err != nil {
			return err
		}
		l.Color, l.Dashes, l.Width = st.color, st.dash, vg.Points(1.5)
		sc.Color, sc.Shape, sc.Radius = st.color, st.shape, vg.Points(3)
		ss, err := plotter.NewScatter(spread)
		if err != nil {
			return err
		}
		ss.Color, ss.Shape, ss.Radius = st.color, draw.CrossGlyph{}, vg.Points(1.5)
		p.Add(l, sc, ss)
		p.Legend.Add(st.name, l, sc)
	}
	return p.Save(18*vg.Centimeter, 13*vg.Centimeter, path)
}

func renderChanges(r changesRun, dir string) ([]string, error) {
	out := filepath.Join(dir, "nat-changes.png")
	return []string{out}, plotChanges(r, out)
}
