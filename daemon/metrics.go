package daemon

import (
	"net/http"
	"time"

	"github.com/brokkr/brokkr/supervisor"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// metrics exports the merged status and the loop's own health in the
// Prometheus text format (github.com/prometheus/client_golang: the reference
// implementation of the exposition format, so scrapers parse what we write).
type metrics struct {
	reg      *prometheus.Registry
	duration *prometheus.HistogramVec
	errors   *prometheus.CounterVec
}

var (
	exposureLabels = []string{"exposure", "protocol", "mode"}
	descActive     = prometheus.NewDesc("brokkr_exposure_active_connections", "Connections open through the exposure now (both paths).", exposureLabels, nil)
	descAccepted   = prometheus.NewDesc("brokkr_exposure_accepted_total", "Connections admitted.", exposureLabels, nil)
	descRefused    = prometheus.NewDesc("brokkr_exposure_refused_total", "Connections refused at the connection cap.", exposureLabels, nil)
	descDropped    = prometheus.NewDesc("brokkr_exposure_dropped_total", "Connections admitted that could not be carried to the guest.", exposureLabels, nil)
	descBytesIn    = prometheus.NewDesc("brokkr_exposure_bytes_in_total", "Bytes from callers to the guest.", exposureLabels, nil)
	descBytesOut   = prometheus.NewDesc("brokkr_exposure_bytes_out_total", "Bytes from the guest to callers.", exposureLabels, nil)
	descMaxConns   = prometheus.NewDesc("brokkr_exposure_max_connections", "The exposure's connection cap (0 = unlimited).", exposureLabels, nil)
	descExpState   = prometheus.NewDesc("brokkr_exposure_state", "1 for the exposure's current state (active, pending, failed).", []string{"exposure", "state"}, nil)
	descVMPhase    = prometheus.NewDesc("brokkr_vm_phase", "1 for the VM's current phase.", []string{"vm", "phase"}, nil)
	descVMRestarts = prometheus.NewDesc("brokkr_vm_restarts_total", "Restarts of the VM by its restart policy or an operator.", []string{"vm"}, nil)
)

var vmPhases = []string{supervisor.PhasePending, supervisor.PhaseCreating, supervisor.PhaseStarting, supervisor.PhaseRunning,
	supervisor.PhaseStopping, supervisor.PhaseStopped, supervisor.PhaseFailed}

func newMetrics(d *Daemon) *metrics {
	m := &metrics{
		reg: prometheus.NewRegistry(),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "brokkr_converge_duration_seconds",
			Help:    "Time one engine's pass of the control loop took.",
			Buckets: []float64{.001, .005, .01, .05, .1, .25, .5, 1, 2.5, 5, 10},
		}, []string{"engine"}),
		errors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "brokkr_converge_errors_total",
			Help: "Engine passes that failed or overran their deadline.",
		}, []string{"engine"}),
	}
	for _, e := range []string{"supervisor", "netplane", "proxy"} {
		m.errors.WithLabelValues(e) // present at 0 from the start
	}
	m.reg.MustRegister(m.duration, m.errors, statusCollector{d},
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

func (m *metrics) observe(engine string, took time.Duration, ok bool) {
	m.duration.WithLabelValues(engine).Observe(took.Seconds())
	if !ok {
		m.errors.WithLabelValues(engine).Inc()
	}
}

func (m *metrics) handler() http.Handler {
	return promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{})
}

// statusCollector reads the last merged status at scrape time.
type statusCollector struct{ d *Daemon }

func (c statusCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descActive, descAccepted, descRefused, descDropped, descBytesIn, descBytesOut,
		descMaxConns, descExpState, descVMPhase, descVMRestarts} {
		ch <- d
	}
}

func (c statusCollector) Collect(ch chan<- prometheus.Metric) {
	st := c.d.Status()
	for _, e := range st.Exposures {
		l := []string{e.Name, e.Protocol, e.Mode}
		ch <- prometheus.MustNewConstMetric(descActive, prometheus.GaugeValue, float64(e.Active), l...)
		ch <- prometheus.MustNewConstMetric(descAccepted, prometheus.CounterValue, float64(e.Accepted), l...)
		ch <- prometheus.MustNewConstMetric(descRefused, prometheus.CounterValue, float64(e.Refused), l...)
		ch <- prometheus.MustNewConstMetric(descDropped, prometheus.CounterValue, float64(e.Dropped), l...)
		ch <- prometheus.MustNewConstMetric(descBytesIn, prometheus.CounterValue, float64(e.BytesIn), l...)
		ch <- prometheus.MustNewConstMetric(descBytesOut, prometheus.CounterValue, float64(e.BytesOut), l...)
		ch <- prometheus.MustNewConstMetric(descMaxConns, prometheus.GaugeValue, float64(e.MaxConns), l...)
		for _, s := range []string{"active", "pending", "failed"} {
			v := 0.0
			if e.State == s {
				v = 1
			}
			ch <- prometheus.MustNewConstMetric(descExpState, prometheus.GaugeValue, v, e.Name, s)
		}
	}
	for _, v := range st.VMs {
		for _, p := range vmPhases {
			x := 0.0
			if v.Phase == p {
				x = 1
			}
			ch <- prometheus.MustNewConstMetric(descVMPhase, prometheus.GaugeValue, x, v.Name, p)
		}
		ch <- prometheus.MustNewConstMetric(descVMRestarts, prometheus.CounterValue, float64(v.Restarts), v.Name)
	}
}
