package config

import (
	"github.com/brokkr/brokkr/internal/spec"
)

// LiveExposures is the index Compile checks each exposure against
// (exposureIndex), kept up to date with a desired state across changes of
// one exposure at a time: the daemon's PUT and DELETE /v1/exposures check
// the one exposure against it instead of compiling the whole state again.
// It answers only whether the state with the change would compile; what is
// wrong with one that would not is said by Compile (the messages cite
// positions in the list, which this index does not keep up to date).
//
// It holds because of what Compile checks: given a desired state that
// compiles, the state with exposure e put (replacing the one of its name,
// or appended) compiles exactly when e passes the checks of one exposure
// (check: its fields, its target against the network and the VMs, its
// name and host side against every other exposure) and the count stays
// within spec.MaxExposures; removing an exposure never makes the rest
// invalid. TestLiveExposuresAgreeWithCompile compares the two on random
// changes. Not safe for concurrent use.
type LiveExposures struct {
	ix   *exposureIndex
	keys map[string]bindsAt // name → where its binds are
}

// NewLiveExposures indexes c's exposures; model is c compiled (Compile
// returned no errors), whose exposures are c's in the same order.
func NewLiveExposures(c *Config, model *spec.Desired) *LiveExposures {
	var col collector // c compiled: nothing is reported
	network, cidr := compileNetwork(c.Network, &col)
	_, vms := compileVMs(c.VMs, &col)
	l := &LiveExposures{ix: newExposureIndex(cidr, c.Network.CIDR, network.CIDR6, vms), keys: make(map[string]bindsAt, len(c.Exposures))}
	for i, e := range c.Exposures {
		l.ix.insert(e, model.Exposures[i], i)
		n := len(model.Exposures[i].AllowFrom)
		l.keys[e.Name] = bindsAt{e.Protocol, e.HostPort, sockPortsOf(e, model.Exposures[i]), n}
		l.ix.allowTotal += n
	}
	return l
}

// Len is the number of exposures.
func (l *LiveExposures) Len() int { return len(l.keys) }

// Check reports whether the state with e put would compile, and e's model
// (as Compile would make it) when it would.
func (l *LiveExposures) Check(e Exposure) (spec.Exposure, bool) {
	var col collector
	n := len(l.keys)
	// check counts e's allowFrom into the total; what a Check counted is
	// taken back (Put counts what stays).
	defer func(total int) { l.ix.allowTotal = total }(l.ix.allowTotal)
	if pos, replacing := l.ix.names[e.Name]; replacing {
		// A replacement: its own old name and binds are no clash (check
		// skips binds of the same name), nor its ports on the socket path.
		delete(l.ix.names, e.Name)
		old := l.keys[e.Name].sock
		l.ix.sockPorts -= old
		l.ix.allowTotal -= l.keys[e.Name].allow
		defer func() { l.ix.names[e.Name] = pos; l.ix.sockPorts += old }()
	} else {
		n++
	}
	me := l.ix.check("exposures[0]", e, &col)
	compileCapacity(n, &col)
	return me, len(col.errs) == 0
}

// Put records e (checked: Check said it compiles, me is its model) in
// place of the exposure of its name, or added.
func (l *LiveExposures) Put(e Exposure, me spec.Exposure) {
	pos := len(l.keys)
	if p, ok := l.ix.names[e.Name]; ok {
		pos = p
		l.Remove(e.Name)
	}
	l.ix.insert(e, me, pos)
	l.keys[e.Name] = bindsAt{e.Protocol, e.HostPort, sockPortsOf(e, me), len(me.AllowFrom)}
	l.ix.allowTotal += len(me.AllowFrom)
}

// Remove forgets the named exposure (no-op when there is none).
func (l *LiveExposures) Remove(name string) {
	k, ok := l.keys[name]
	if !ok {
		return
	}
	delete(l.keys, name)
	delete(l.ix.names, name)
	l.ix.forget(name, k.proto, k.port)
	l.ix.sockPorts -= k.sock
	l.ix.allowTotal -= k.allow
}

// bindsAt is where an exposure's binds are in the index.
type bindsAt struct {
	proto string
	port  Port
	sock  int // its ports on the socket path (sockPortsOf)
	allow int // its allowFrom prefixes, counted in the index's total
}
