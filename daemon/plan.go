package daemon

import (
	"reflect"

	"github.com/brokkr/brokkr/daemon/api"
	"github.com/brokkr/brokkr/daemon/config"
)

// diff says what changes between two desired states, by name.
func diff(cur, next *config.Config) api.Plan {
	p := api.Plan{
		NetworkChanged: !reflect.DeepEqual(cur.Network, next.Network),
		VMs:            api.Changes{Added: []string{}, Changed: []string{}, Removed: []string{}},
		Exposures:      api.Changes{Added: []string{}, Changed: []string{}, Removed: []string{}},
	}
	oldVMs := map[string]config.VM{}
	for _, v := range cur.VMs {
		oldVMs[v.Name] = v
	}
	newVMs := map[string]bool{}
	for _, v := range next.VMs {
		newVMs[v.Name] = true
		if o, ok := oldVMs[v.Name]; !ok {
			p.VMs.Added = append(p.VMs.Added, v.Name)
		} else if !reflect.DeepEqual(o, v) {
			p.VMs.Changed = append(p.VMs.Changed, v.Name)
		}
	}
	for _, v := range cur.VMs {
		if !newVMs[v.Name] {
			p.VMs.Removed = append(p.VMs.Removed, v.Name)
		}
	}
	oldEx := map[string]config.Exposure{}
	for _, e := range cur.Exposures {
		oldEx[e.Name] = e
	}
	newEx := map[string]bool{}
	for _, e := range next.Exposures {
		newEx[e.Name] = true
		if o, ok := oldEx[e.Name]; !ok {
			p.Exposures.Added = append(p.Exposures.Added, e.Name)
		} else if !reflect.DeepEqual(o, e) {
			p.Exposures.Changed = append(p.Exposures.Changed, e.Name)
		}
	}
	for _, e := range cur.Exposures {
		if !newEx[e.Name] {
			p.Exposures.Removed = append(p.Exposures.Removed, e.Name)
		}
	}
	return p
}
