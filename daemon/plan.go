package daemon

import (
	"reflect"

	"github.com/brokkr/brokkr/daemon/api"
	"github.com/brokkr/brokkr/daemon/config"
)

// Diff says what changes between two desired states, by name (the plan
// `apply --dry-run` prints; `brokkr fleet apply` uses it too).
func Diff(cur, next *config.Config) api.Plan { return diff(cur, next) }

// diff says what changes between two desired states, by name.
func diff(cur, next *config.Config) api.Plan {
	return api.Plan{
		NetworkChanged: !reflect.DeepEqual(cur.Network, next.Network),
		VMs:            changes(cur.VMs, next.VMs, func(v config.VM) string { return v.Name }),
		Exposures:      changes(cur.Exposures, next.Exposures, func(e config.Exposure) string { return e.Name }),
	}
}

// changes lists, by name, the items added, changed (any field differs) and
// removed between two lists; empty lists are non-nil so JSON shows [].
func changes[T any](cur, next []T, name func(T) string) api.Changes {
	c := api.Changes{Added: []string{}, Changed: []string{}, Removed: []string{}}
	old := make(map[string]T, len(cur))
	for _, x := range cur {
		old[name(x)] = x
	}
	kept := make(map[string]bool, len(next))
	for _, x := range next {
		n := name(x)
		kept[n] = true
		if o, ok := old[n]; !ok {
			c.Added = append(c.Added, n)
		} else if !reflect.DeepEqual(o, x) {
			c.Changed = append(c.Changed, n)
		}
	}
	for _, x := range cur {
		if n := name(x); !kept[n] {
			c.Removed = append(c.Removed, n)
		}
	}
	return c
}
