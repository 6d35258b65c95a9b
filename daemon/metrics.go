package daemon

import (
	"net/http"
	"sync"
	"time"

	"github.com/brokkr/brokkr/daemon/api"
	"github.com/brokkr/brokkr/internal/spec"
	"github.com/brokkr/brokkr/supervisor"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// metrics exports the merged status and the loop's own health in the
// Prometheus text format (github.com/prometheus/client_golang: the reference
// implementation of the exposition format, so scrapers parse what we write).
//
// Labels are names only (docs/ARCHITECTURE.md, "External contract"): what describes an exposure (mode,
// protocol, host address and port) sits in brokkr_exposure_info, so changing
// an exposure's mode does not end its counter series and start another.
type metrics struct {
	reg         *prometheus.Registry
	duration    *prometheus.HistogramVec
	errors      *prometheus.CounterVec
	repaired    *prometheus.CounterVec
	lastSuccess prometheus.Gauge
	resume      resumeTimes

	mu        sync.Mutex
	lastPass  time.Time
	firstPass chan struct{} // closed when the first pass has finished
}

var (
	exposureLabels = []string{"exposure"}
	descActive     = prometheus.NewDesc("brokkr_exposure_active_connections", "Connections open through the exposure now (both paths).", exposureLabels, nil)
	descAccepted   = prometheus.NewDesc("brokkr_exposure_accepted_total", "Connections admitted.", exposureLabels, nil)
	descRefused    = prometheus.NewDesc("brokkr_exposure_refused_total", "Connections refused at the connection cap.", exposureLabels, nil)
	descDropped    = prometheus.NewDesc("brokkr_exposure_dropped_total", "Connections admitted that could not be carried to the guest.", exposureLabels, nil)
	descDenied     = prometheus.NewDesc("brokkr_exposure_denied_total", "Callers turned away by the exposure's allowFrom (dropped before admission).", exposureLabels, nil)
	descBytes      = prometheus.NewDesc("brokkr_exposure_bytes_total", "Payload bytes carried: direction in is callers to the guest, out is the guest to callers.", []string{"exposure", "direction"}, nil)
	descMaxConns   = prometheus.NewDesc("brokkr_exposure_max_connections", "The exposure's connection cap (0 = unlimited).", exposureLabels, nil)
	descExpState   = prometheus.NewDesc("brokkr_exposure_state", "1 for the exposure's current state (active, pending, failed).", []string{"exposure", "state"}, nil)
	descExpInfo    = prometheus.NewDesc("brokkr_exposure_info", "Always 1; the labels describe the exposure.", []string{"exposure", "mode", "protocol", "host_address", "host_port"}, nil)
	descVMPhase    = prometheus.NewDesc("brokkr_vm_phase", "1 for the VM's current phase.", []string{"vm", "phase"}, nil)
	descVMRestarts = prometheus.NewDesc("brokkr_vm_restarts_total", "Restarts of the VM by its restart policy or an operator.", []string{"vm"}, nil)
	descVMWakes    = prometheus.NewDesc("brokkr_vm_wakes_total", "Resumes of the suspended VM that a caller asked for.", []string{"vm"}, nil)
	descBuild      = prometheus.NewDesc("brokkr_build_info", "Always 1; the labels say which brokkrd build is running.", []string{"version", "commit", "goversion"}, nil)
)

var vmPhases = []string{supervisor.PhasePending, supervisor.PhaseCreating, supervisor.PhaseStarting, supervisor.PhaseRunning,
	supervisor.PhaseStopping, supervisor.PhaseStopped, supervisor.PhaseFailed,
	supervisor.PhaseSuspending, supervisor.PhaseSuspended, supervisor.PhaseResuming}

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
		repaired: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "brokkr_drift_repaired_total",
			Help: "Things found changed from outside and put back (a deleted rule, a missing tap, a detached port).",
		}, []string{"engine"}),
		lastSuccess: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "brokkr_last_converge_success_timestamp_seconds",
			Help: "Unix time of the end of the last pass in which every engine succeeded (0: none yet).",
		}),
		resume:    resumeTimes{byVM: map[string]*resumeHist{}},
		firstPass: make(chan struct{}),
	}
	for _, e := range []string{"supervisor", "netplane", "proxy"} {
		m.errors.WithLabelValues(e) // present at 0 from the start
	}
	// Only the network plane reports repairs; a series for the others
	// could never move.
	m.repaired.WithLabelValues("netplane")
	m.reg.MustRegister(m.duration, m.errors, m.repaired, m.lastSuccess, statusCollector{d},
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

func (m *metrics) observe(engine string, took time.Duration, ok bool) {
	m.duration.WithLabelValues(engine).Observe(took.Seconds())
	if !ok {
		m.errors.WithLabelValues(engine).Inc()
	}
}

// passDone records the end of a pass: its errors (nil entries are engines
// that succeeded) and how many drifted things netplane put back.
func (m *metrics) passDone(errs []error, netRepaired int) {
	now := time.Now()
	ok := true
	for _, e := range errs {
		ok = ok && e == nil
	}
	if ok {
		m.lastSuccess.Set(float64(now.UnixNano()) / 1e9)
	}
	m.repaired.WithLabelValues("netplane").Add(float64(netRepaired))
	m.mu.Lock()
	first := m.lastPass.IsZero()
	m.lastPass = now
	m.mu.Unlock()
	if first {
		close(m.firstPass)
	}
}

// LastPass is when the control loop last finished a pass (zero: never). The
// systemd watchdog is fed only while it moves.
func (d *Daemon) LastPass() time.Time {
	d.m.mu.Lock()
	defer d.m.mu.Unlock()
	return d.m.lastPass
}

// FirstPass is closed once the first pass has finished (READY=1 waits for
// it, so `systemctl start` returns with the host converged once).
func (d *Daemon) FirstPass() <-chan struct{} { return d.m.firstPass }

func (m *metrics) handler() http.Handler {
	return promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{})
}

// statusCollector reads the last merged status at scrape time.
type statusCollector struct{ d *Daemon }

func (c statusCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descActive, descAccepted, descRefused, descDropped, descDenied, descBytes,
		descMaxConns, descExpState, descExpInfo, descVMPhase, descVMRestarts, descVMWakes, descVMResume, descBuild} {
		ch <- d
	}
}

func (c statusCollector) Collect(ch chan<- prometheus.Metric) {
	b := api.CurrentBuild()
	ch <- prometheus.MustNewConstMetric(descBuild, prometheus.GaugeValue, 1, b.Version, b.Commit, b.GoVersion)
	st := c.d.Status()
	for _, e := range st.Exposures {
		n := e.Name
		ch <- prometheus.MustNewConstMetric(descExpInfo, prometheus.GaugeValue, 1, n, e.Mode, e.Protocol, e.HostAddress, e.HostPorts())
		ch <- prometheus.MustNewConstMetric(descActive, prometheus.GaugeValue, float64(e.Active), n)
		ch <- prometheus.MustNewConstMetric(descAccepted, prometheus.CounterValue, float64(e.Accepted), n)
		ch <- prometheus.MustNewConstMetric(descRefused, prometheus.CounterValue, float64(e.Refused), n)
		ch <- prometheus.MustNewConstMetric(descDropped, prometheus.CounterValue, float64(e.Dropped), n)
		ch <- prometheus.MustNewConstMetric(descDenied, prometheus.CounterValue, float64(e.Denied), n)
		ch <- prometheus.MustNewConstMetric(descBytes, prometheus.CounterValue, float64(e.BytesIn), n, "in")
		ch <- prometheus.MustNewConstMetric(descBytes, prometheus.CounterValue, float64(e.BytesOut), n, "out")
		ch <- prometheus.MustNewConstMetric(descMaxConns, prometheus.GaugeValue, float64(e.MaxConns), n)
		for _, s := range []spec.ExposureState{spec.StateActive, spec.StatePending, spec.StateFailed} {
			v := 0.0
			if e.State == string(s) {
				v = 1
			}
			ch <- prometheus.MustNewConstMetric(descExpState, prometheus.GaugeValue, v, n, string(s))
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
		ch <- prometheus.MustNewConstMetric(descVMWakes, prometheus.CounterValue, float64(v.Wakes), v.Name)
		ch <- c.d.m.resume.metric(v.Name)
	}
}
