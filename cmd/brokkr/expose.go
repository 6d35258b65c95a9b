package main

import (
	"encoding/json"
	"fmt"
	"os"
	"os/signal"
	"reflect"
	"strconv"
	"strings"
	"syscall"

	"github.com/brokkr/brokkr/daemon/api"
	"github.com/brokkr/brokkr/daemon/config"
	"github.com/spf13/cobra"
)

// exposeAddCmd is `brokkr expose add NAME ...`: PUT /v1/exposures/NAME with
// the flags as one entry of exposures: (only the keys given; the daemon
// fills the defaults as for a file).
func exposeAddCmd(client func() *api.Client) *cobra.Command {
	var vm, target, target6, guestPort, hostPort, mode, protocol, hostAddress, out string
	var maxConns int
	var allowFrom []string
	c := &cobra.Command{
		Use:   "add NAME --vm VM|--target ADDR|--target6 ADDR6 --guest-port P --host-port H [--mode M] [--protocol P] [--host-address A] [--max-conns N] [--allow-from CIDR,...]",
		Short: "Create or replace one exposure (validated against the whole desired state, persisted with it)",
		Long: `add publishes one guest port: it creates the exposure NAME, or replaces the one of that
name, without a config file. The flags are the keys of one entry of exposures: in the
config file (vm or target, guestPort, hostPort, mode, protocol, hostAddress, maxConns),
and a key not given takes its default as in a file. brokkrd validates the change
against the whole desired state (a host port another exposure holds, a VM that does
not exist, the limits), persists it (one record in desired.journal, beside desired.json)
and publishes it;
nothing changes unless it is valid.

Refused in fleet mode (the node's desired state is the document in etcd), as a local
apply is. Exit status: 0 done, 1 refused (the fields named), 2 a daemon error.`,
		Example: `  brokkr expose add web-http --vm web --guest-port 80 --host-port 8080
  brokkr expose add ssh-ext --target 10.213.0.200 --guest-port 22 --host-port 2222 --mode proxy --max-conns 8
  brokkr expose add dns --vm ns --protocol udp --guest-port 53 --host-port 5353 --host-address 127.0.0.1
  brokkr expose add games --vm game --protocol udp --guest-port 30000-30099 --host-port 30000-30099 --mode proxy`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := checkOutput(out); err != nil {
				return err
			}
			f := cmd.Flags()
			switch {
			case vm == "" && target == "" && target6 == "":
				return userf("expose add: one of --vm or --target (or --target6) is required")
			case vm != "" && (target != "" || target6 != ""):
				return userf("expose add: --vm %q and --target/--target6 are both given; give one", vm)
			case !f.Changed("guest-port"):
				return userf("expose add: --guest-port is required")
			case !f.Changed("host-port"):
				return userf("expose add: --host-port is required")
			}
			e := map[string]any{"name": args[0], "guestPort": port(guestPort), "hostPort": port(hostPort)}
			for _, k := range []struct {
				flag, key, v string
			}{{"vm", "vm", vm}, {"target", "target", target}, {"target6", "target6", target6}, {"mode", "mode", mode}, {"protocol", "protocol", protocol}, {"host-address", "hostAddress", hostAddress}} {
				if f.Changed(k.flag) {
					e[k.key] = k.v
				}
			}
			if f.Changed("max-conns") {
				e["maxConns"] = maxConns
			}
			if f.Changed("allow-from") {
				if !exposureKey("allowFrom") {
					return userf("expose add: --allow-from: this brokkr's config has no allowFrom key (an exposure's allowed sources); nothing was sent")
				}
				e["allowFrom"] = allowFrom
			}
			body, err := json.Marshal(e)
			if err != nil {
				return err
			}
			// The shape is checked here first, as brokkrd will: a value
			// of the wrong kind is named the same way, daemon or not.
			if _, err := config.DecodeExposure(body); err != nil {
				printFieldErrors(cmd.ErrOrStderr(), "exposure "+args[0], err)
				return silentError{1}
			}
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			plan, err := client().PutExposure(ctx, args[0], body)
			if err != nil {
				return err
			}
			if out == "json" {
				return printJSON(cmd.OutOrStdout(), plan)
			}
			printPlan(cmd.OutOrStdout(), plan)
			return nil
		},
	}
	f := c.Flags()
	f.StringVar(&vm, "vm", "", "the VM whose port is published")
	f.StringVar(&target, "target", "", "instead of --vm: an address on the bridge that brokkr does not run")
	f.StringVar(&target6, "target6", "", "with or instead of --target: that guest's IPv6 address on the bridge")
	f.StringVar(&guestPort, "guest-port", "", "the guest's port (required): one for every host port, or a range the same as --host-port's")
	f.StringVar(&hostPort, "host-port", "", "the host's port (required), or a range of ports: 30000-30099 (one exposure, one cap)")
	f.StringVar(&mode, "mode", "", fmt.Sprintf("auto, nat or proxy (default %s)", config.DefaultMode))
	f.StringVar(&protocol, "protocol", "", fmt.Sprintf("tcp or udp (default %s)", config.DefaultProtocol))
	f.StringVar(&hostAddress, "host-address", "", "the host address to publish on (default: every address of both families; 0.0.0.0 IPv4 only, :: IPv6 only)")
	f.IntVar(&maxConns, "max-conns", 0, fmt.Sprintf("the cap on connections; 0 = unlimited (default %d)", config.DefaultMaxConns))
	f.StringSliceVar(&allowFrom, "allow-from", nil, "CIDRs allowed to connect (repeated or comma-separated), where brokkr's config has allowFrom")
	f.StringVarP(&out, "output", "o", "table", "table or json (the plan as JSON)")
	return c
}

// port is a port flag as the config spells it: a number, or as given (the
// config names what it does not take).
func port(s string) any {
	if n, err := strconv.Atoi(s); err == nil {
		return n
	}
	return s
}

// exposureKey reports whether an entry of exposures: has the key (config's
// yaml tags): a flag for a key this build's config lacks is refused, not
// sent to be rejected or, worse, dropped.
func exposureKey(key string) bool {
	t := reflect.TypeOf(config.Exposure{})
	for i := 0; i < t.NumField(); i++ {
		if name, _, _ := strings.Cut(t.Field(i).Tag.Get("yaml"), ","); name == key {
			return true
		}
	}
	return false
}

// exposeRmCmd is `brokkr expose rm NAME`: DELETE /v1/exposures/NAME.
func exposeRmCmd(client func() *api.Client) *cobra.Command {
	var out string
	c := &cobra.Command{
		Use:   "rm NAME",
		Short: "Remove one exposure (persisted)",
		Long: `rm removes the exposure NAME from the desired state (persisted in desired.journal) and
withdraws it: its port is no longer published and its counters go. Refused in fleet
mode, as a local apply is. Exit status: 0 done, 1 no such exposure (or refused),
2 a daemon error.`,
		Example:           `  brokkr expose rm web-http`,
		Args:              cobra.ExactArgs(1),
		ValidArgsFunction: completeNames(client, exposureNames, 1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := checkOutput(out); err != nil {
				return err
			}
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			plan, err := client().DeleteExposure(ctx, args[0])
			if err != nil {
				return err
			}
			if out == "json" {
				return printJSON(cmd.OutOrStdout(), plan)
			}
			printPlan(cmd.OutOrStdout(), plan)
			return nil
		},
	}
	c.Flags().StringVarP(&out, "output", "o", "table", "table or json (the plan as JSON)")
	return c
}
