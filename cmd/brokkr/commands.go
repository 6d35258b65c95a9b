package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/signal"
	"slices"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/brokkr/brokkr/bpf"
	"github.com/brokkr/brokkr/daemon/api"
	"github.com/brokkr/brokkr/daemon/config"
	"github.com/brokkr/brokkr/internal/spec"
	"github.com/spf13/cobra"
)

func validateCmd() *cobra.Command {
	var file string
	c := &cobra.Command{
		Use:   "validate -f FILE",
		Short: "Check a config file offline; field-named errors, exit 1 if invalid",
		Long: `validate parses and validates a config file as brokkrd would, without a daemon.
Every problem is reported at once, each naming its field path and value
(vms[1].memory: "12Q" is not a size). Exit 0 valid, 1 invalid.

The network plane's own checks (a host address that is not on this host) run only in
the daemon, on apply.`,
		Example: `  brokkr validate -f /etc/brokkr/brokkr.yaml
  generate-config | brokkr validate -f -`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			_, _, model, err := loadConfigFile(cmd, file)
			if err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "%s: valid (%d VMs, %d exposures)\n", file, len(model.VMs), len(model.Exposures))
			// Against the unit's LimitNOFILE: validate runs offline, without
			// the daemon's own limit.
			if w := config.DescriptorBudget(model, config.DefaultNoFile); w != "" {
				fmt.Fprintln(cmd.ErrOrStderr(), "warning:", w)
			}
			return nil
		},
	}
	c.Flags().StringVarP(&file, "file", "f", "", "config file (- for standard input)")
	return c
}

func applyCmd(client func() *api.Client) *cobra.Command {
	var file, out string
	var dry, wait bool
	var timeout time.Duration
	c := &cobra.Command{
		Use:   "apply -f FILE [--dry-run] [--wait] [-o json]",
		Short: "Make a config the desired state (validated as a whole; nothing applied unless all of it is valid)",
		Long: `apply sends a config file to brokkrd, which validates it as a whole (the config rules
and the network plane's) and, unless --dry-run, persists it as the desired state and
converges towards it. Nothing changes unless all of it is valid.

It prints what changes: + added, ~ changed, - removed, per VM and exposure.
stateDir, runDir, bpfDir, hypervisor and metrics take effect only when brokkrd
restarts; apply warns when they differ from the running daemon's.

With --wait it then follows the VMs and exposures until every VM has its desired
power and every exposure is active (a redrawn view on a terminal, a line per change
otherwise), exiting 2 when something stays failed or --timeout passes.`,
		Example: `  brokkr apply -f brokkr.yaml --dry-run
  brokkr apply -f brokkr.yaml --wait --timeout 5m
  brokkr apply -f brokkr.yaml -o json | jq .vms.added`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := checkOutput(out); err != nil {
				return err
			}
			// Checked here first so a bad file is reported the same way,
			// daemon or not.
			b, _, _, err := loadConfigFile(cmd, file)
			if err != nil {
				return err
			}
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			plan, err := client().Apply(ctx, b, dry)
			if err != nil {
				return err
			}
			if out == "json" {
				if err := printJSON(cmd.OutOrStdout(), plan); err != nil {
					return err
				}
			} else {
				printPlan(cmd.OutOrStdout(), plan)
			}
			if wait && !dry {
				// Progress goes to stderr under -o json: stdout stays one document.
				w := cmd.OutOrStdout()
				if out == "json" {
					w = cmd.ErrOrStderr()
				}
				return waitConverged(ctx, w, client(), timeout)
			}
			return nil
		},
	}
	c.Flags().StringVarP(&file, "file", "f", "", "config file (- for standard input)")
	c.Flags().BoolVar(&dry, "dry-run", false, "only print what would change")
	c.Flags().BoolVar(&wait, "wait", false, "wait until every VM runs and every exposure is active (progress on a terminal)")
	c.Flags().DurationVar(&timeout, "timeout", 10*time.Minute, "how long --wait waits")
	c.Flags().StringVarP(&out, "output", "o", "table", "table or json (the plan as JSON)")
	return c
}

// counterColumns says what the counter columns of status, expose ls and
// stats count (the same on every path: nat, socket path, proxy).
const counterColumns = `Counters, one set per exposure across every path (nat, socket path, proxy):
  ACTIVE    connections (TCP) or flows (UDP) open now; the cap (CAP) bounds it
  ACCEPTED  connections or flows admitted since the exposure was created
  REFUSED   callers turned away at the cap
  DROPPED   callers admitted but not carried to the guest (no address, no answer)
  DENIED    callers turned away by allowFrom before admission (nat: each
            dropped first packet, so a retransmitted SYN counts again)
  IN        payload bytes from callers to the guest (no headers; a TCP
            retransmission counts once)
  OUT       payload bytes from the guest back to callers
The counters survive daemon restarts and upgrades; they are zeroed only when the
exposure is deleted.`

func statusCmd(client func() *api.Client) *cobra.Command {
	var out string
	c := &cobra.Command{
		Use:   "status [-o json]",
		Short: "VMs and exposures with their state and counters",
		Long: `status prints every VM (phase, pid, address, MAC, tap, restarts, what is in progress
or what failed) and every exposure (state, mode, listen address, target, cap and
counters), with the versions of this CLI and of the daemon; a warning on stderr says
when they differ.

` + counterColumns + `

-o json prints the contract's status document (also GET /v1/status on the socket).

Exit status 3 while any VM is failed or any exposure is failed, as systemctl status
does for a failed unit, so scripts and health checks need not parse the output.`,
		Example: `  brokkr status
  brokkr status -o json | jq '.exposures[] | select(.state != "active")'
  brokkr status >/dev/null || echo "exit $? (3: something failed)"`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := checkOutput(out); err != nil {
				return err
			}
			st, err := client().Status(cmd.Context())
			if err != nil {
				return err
			}
			line, warn := versions(api.CurrentBuild(), st.Daemon)
			if warn != "" {
				// stderr, so that -o json stays one JSON document.
				fmt.Fprintln(cmd.ErrOrStderr(), "warning:", warn)
			}
			if out == "json" {
				if err := printJSON(cmd.OutOrStdout(), st); err != nil {
					return err
				}
				return failedExit(st)
			}
			w := cmd.OutOrStdout()
			fmt.Fprintf(w, "%s\n\n", line)
			printVMs(w, st.VMs)
			fmt.Fprintln(w)
			printExposures(w, st.Exposures)
			for _, warn := range st.Warnings {
				fmt.Fprintf(w, "\nwarning: %s", warn)
			}
			if len(st.Warnings) > 0 {
				fmt.Fprintln(w)
			}
			printSource(w, st.Source)
			return failedExit(st)
		},
	}
	c.Flags().StringVarP(&out, "output", "o", "table", "table or json")
	return c
}

// failedExit is status's exit 3 while anything is failed (docs/ARCHITECTURE.md, "External contract").
func failedExit(st *api.Status) error {
	for _, v := range st.VMs {
		if v.Phase == string(spec.PhaseFailed) {
			return silentError{3}
		}
	}
	for _, e := range st.Exposures {
		if e.State == string(spec.StateFailed) {
			return silentError{3}
		}
	}
	return nil
}

func vmCmd(client func() *api.Client) *cobra.Command {
	c := &cobra.Command{
		Use:   "vm",
		Short: "List, start, stop, restart, suspend, resume VMs; follow a VM's console",
		Long: `vm lists the VMs brokkrd runs and changes their power. start and stop change the VM's
desired power, which is persisted (a restarted daemon keeps it) until the next apply
of a file that says otherwise; restart restarts a running VM once.

Stopping presses the guest's ACPI power button and gives it 30 s to power off (pressing
again every 5 s) before the hypervisor is told to quit, then SIGTERM, then SIGKILL.
Suspending saves the guest's memory and devices to stateDir/vms/NAME/suspend and ends its
hypervisor process; resuming (or the VM's first caller through an exposure) brings the
same guest back where it was.`,
		Example: `  brokkr vm ls
  brokkr vm stop web --wait
  brokkr vm console web`,
	}
	c.AddCommand(listCmd("vm", "List VMs", client, vmNames, func(w io.Writer, st *api.Status, names []string, asJSON bool) error {
		vms := slices.DeleteFunc(slices.Clone(st.VMs), func(v api.VM) bool { return !want(names, v.Name) })
		if asJSON {
			return printJSON(w, vms)
		}
		printVMs(w, vms)
		return nil
	}))
	for _, a := range []struct{ verb, short, long, until string }{
		{"start", "Set a VM's desired power to running (persisted)",
			"start sets the VM's desired power to running (persisted in desired.json) and returns;\nwith --wait it waits until the VM runs.", "running"},
		{"stop", "Set a VM's desired power to stopped (persisted)",
			"stop sets the VM's desired power to stopped (persisted in desired.json) and returns;\nwith --wait it waits until the VM has stopped (the guest may take up to 30 s to\npower off before it is stopped harder).", "stopped"},
		{"restart", "Restart a running VM",
			"restart stops a running VM and starts it again (a new hypervisor process) and returns;\nwith --wait it waits until the new process runs. A VM whose desired power is\nstopped cannot be restarted: start it.", "restarted"},
		{"suspend", "Suspend a VM to disk: its state saved, no process (persisted)",
			"suspend sets the VM's desired power to suspended (persisted in desired.json): its memory\nand devices are saved under stateDir/vms/NAME/suspend and its hypervisor process ends;\nits exposures stay published, and the first caller through one resumes it. A state\nthat cannot be saved (a full disk) leaves the VM running, the reason in its detail.\nWith --wait it waits until the VM is suspended.", "suspended"},
		{"resume", "Resume a suspended VM (persisted)",
			"resume sets the VM's desired power to running (persisted in desired.json) and wakes a VM\nits idleSuspend suspended: the same guest comes back where it was, in a new process.\nA state that cannot be restored boots the VM cold, with the reason in its detail.\nWith --wait it waits until the VM runs.", "running"},
	} {
		c.AddCommand(vmActionCmd(client, a.verb, a.short, a.long, a.until))
	}
	var noFollow bool
	console := &cobra.Command{
		Use:   "console NAME",
		Short: "Print a VM's serial console log and follow it (Ctrl-C ends)",
		Long: `console prints the VM's serial console log (stateDir/vms/NAME/console.log) and keeps
printing what the guest writes until Ctrl-C, across log rotation. It is read-only:
brokkr gives no interactive console.`,
		Example: `  brokkr vm console web
  brokkr vm console web --no-follow | grep -i panic`,
		Args:              cobra.ExactArgs(1),
		ValidArgsFunction: completeNames(client, vmNames, 1),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			body, err := client().Console(ctx, args[0], !noFollow)
			if err != nil {
				return err
			}
			defer body.Close()
			_, err = io.Copy(cmd.OutOrStdout(), body)
			if ctx.Err() != nil {
				return nil
			}
			return err
		},
	}
	console.Flags().BoolVar(&noFollow, "no-follow", false, "print what is there and exit")
	c.AddCommand(console)
	return c
}

func vmActionCmd(client func() *api.Client, verb, short, long, until string) *cobra.Command {
	var wait bool
	var timeout time.Duration
	c := &cobra.Command{
		Use:   verb + " NAME [--wait [--timeout D]]",
		Short: short,
		Long:  long + "\n\nExit status: 0 done, 1 no such VM (or restart of a stopped VM), 2 a daemon error,\nthe VM failed, or --timeout passed.",
		Example: fmt.Sprintf(`  brokkr vm %s web
  brokkr vm %s web --wait --timeout 2m`, verb, verb),
		Args:              cobra.ExactArgs(1),
		ValidArgsFunction: completeNames(client, vmNames, 1),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			cl := client()
			var before api.VM
			if wait && verb == "restart" {
				// The process to see replaced.
				st, err := cl.Status(ctx)
				if err != nil {
					return err
				}
				before, _ = findVM(st, args[0])
			}
			if err := cl.VMAction(ctx, args[0], verb); err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "%s: %s requested\n", args[0], verb)
			if !wait {
				return nil
			}
			return waitVM(ctx, cmd.OutOrStdout(), cl, args[0], until, before, timeout)
		},
	}
	c.Flags().BoolVar(&wait, "wait", false, "wait until the VM is "+until+", with a progress line")
	c.Flags().DurationVar(&timeout, "timeout", 2*time.Minute, "how long --wait waits")
	return c
}

func exposeCmd(client func() *api.Client) *cobra.Command {
	c := &cobra.Command{
		Use:   "expose",
		Short: "Published guest ports: list, add or replace one, remove one",
		Long: `expose lists the exposures: guest ports published on the host, with their state
(active, pending: the guest has no address yet, failed: with the reason), mode, cap
and counters. Exposures are changed through the config (brokkr apply), or one at a
time: expose add creates or replaces one, expose rm removes one (each validated
against the whole desired state and persisted with it; refused in fleet mode).

` + counterColumns,
		Example: `  brokkr expose ls
  brokkr expose ls web-http -o json
  brokkr expose add web-http --vm web --guest-port 80 --host-port 8080
  brokkr expose rm web-http`,
	}
	c.AddCommand(exposeAddCmd(client), exposeRmCmd(client))
	c.AddCommand(listCmd("exposure", "List exposures with state and counters", client, exposureNames, func(w io.Writer, st *api.Status, names []string, asJSON bool) error {
		es := slices.DeleteFunc(slices.Clone(st.Exposures), func(e api.Exposure) bool { return !want(names, e.Name) })
		if asJSON {
			return printJSON(w, es)
		}
		printExposures(w, es)
		return nil
	}))
	return c
}

// want: no names means every row.
func want(names []string, name string) bool { return len(names) == 0 || slices.Contains(names, name) }

// listCmd is an `ls [NAME...]` verb showing one part of the daemon's
// status, as a table or (-o json) as JSON.
func listCmd(kind, short string, client func() *api.Client, names func(*api.Status) []string,
	show func(w io.Writer, st *api.Status, names []string, asJSON bool) error) *cobra.Command {
	var out string
	ls := &cobra.Command{
		Use:   "ls [NAME...] [-o json]",
		Short: short,
		Long: fmt.Sprintf(`ls prints the %ss brokkrd knows, or only those named, as a table or, with
-o json, as a JSON list of the status document's rows. Naming a %s that does not
exist is an error (exit 1).`, kind, kind),
		Example: fmt.Sprintf(`  brokkr %s ls
  brokkr %s ls -o json`, map[string]string{"vm": "vm", "exposure": "expose"}[kind], map[string]string{"vm": "vm", "exposure": "expose"}[kind]),
		ValidArgsFunction: completeNames(client, names, -1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := checkOutput(out); err != nil {
				return err
			}
			st, err := client().Status(cmd.Context())
			if err != nil {
				return err
			}
			have := names(st)
			for _, a := range args {
				if !slices.Contains(have, a) {
					return userf("no such %s %q", kind, a)
				}
			}
			return show(cmd.OutOrStdout(), st, args, out == "json")
		},
	}
	ls.Flags().StringVarP(&out, "output", "o", "table", "table or json")
	return ls
}

func vmNames(st *api.Status) []string {
	out := make([]string, 0, len(st.VMs))
	for _, v := range st.VMs {
		out = append(out, v.Name)
	}
	return out
}

func exposureNames(st *api.Status) []string {
	out := make([]string, 0, len(st.Exposures))
	for _, e := range st.Exposures {
		out = append(out, e.Name)
	}
	return out
}

// completeNames completes names from the running daemon's status (max
// arguments, -1 for any number). A daemon that does not answer within a
// second completes nothing rather than hanging the shell.
func completeNames(client func() *api.Client, names func(*api.Status) []string, max int) cobra.CompletionFunc {
	return func(cmd *cobra.Command, args []string, prefix string) ([]cobra.Completion, cobra.ShellCompDirective) {
		if max >= 0 && len(args) >= max {
			return nil, cobra.ShellCompDirectiveNoFileComp
		}
		ctx, cancel := context.WithTimeout(cmd.Context(), time.Second)
		defer cancel()
		st, err := client().Status(ctx)
		if err != nil {
			return nil, cobra.ShellCompDirectiveNoFileComp | cobra.ShellCompDirectiveError
		}
		var out []cobra.Completion
		for _, n := range names(st) {
			if !slices.Contains(args, n) && len(n) >= len(prefix) && n[:len(prefix)] == prefix {
				out = append(out, n)
			}
		}
		return out, cobra.ShellCompDirectiveNoFileComp
	}
}

func statsCmd() *cobra.Command {
	var dir, cfgFile, out string
	c := &cobra.Command{
		Use:   "stats [--config FILE | --bpf-dir DIR] [-o json]",
		Short: "Read the pinned exposure_stats_v2 map directly (works with the daemon down)",
		Long: `stats reads the counters from the pinned BPF map exposure_stats_v2 under the daemon's
bpfDir, without the daemon: the kernel path and the proxy add into the same entry,
and the map outlives brokkrd. Where only an older brokkrd's exposure_stats (16,384
slots) is pinned, stats reads that. The directory is --bpf-dir, else the bpfDir of
the config file --config, else ` + config.DefaultBPFDir + `.

bpftool map lookup pinned ` + config.DefaultBPFDir + `/exposure_stats_v2 key 3 0 0 0 prints the
entry of SLOT 3 (its four bytes, least significant first); bpftool map dump prints all
131,072 entries, the free ones too.

` + counterColumns,
		Example: `  brokkr stats
  brokkr stats --config /etc/brokkr/brokkr.yaml -o json`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := checkOutput(out); err != nil {
				return err
			}
			if cfgFile != "" && cmd.Flags().Changed("bpf-dir") {
				return userf("--config and --bpf-dir both say where the map is; give one")
			}
			if cfgFile != "" {
				_, cfg, _, err := loadConfigFile(cmd, cfgFile)
				if err != nil {
					return err
				}
				dir = cfg.BPFDir
			}
			entries, err := bpf.Dump(bpf.StatsPin(dir))
			if err != nil {
				return err
			}
			if out == "json" {
				type row struct {
					Name     string `json:"name"`
					Slot     int    `json:"slot"`
					Protocol string `json:"protocol"`
					HostPort uint32 `json:"hostPort"`
					bpf.Counters
				}
				rows := make([]row, 0, len(entries))
				for _, e := range entries {
					rows = append(rows, row{e.Name, e.Slot, bpf.ProtoName(e.Protocol), e.HostPort, e.Counters})
				}
				return printJSON(cmd.OutOrStdout(), rows)
			}
			tw := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "EXPOSURE\tSLOT\tPORT\tACTIVE\tACCEPTED\tREFUSED\tDROPPED\tDENIED\tIN\tOUT")
			for _, e := range entries {
				fmt.Fprintf(tw, "%s\t%d\t%d/%s\t%d\t%d\t%d\t%d\t%d\t%s\t%s\n", e.Name, e.Slot, e.HostPort, bpf.ProtoName(e.Protocol),
					e.Active, e.Accepted, e.Refused, e.Dropped, e.Denied, human(e.BytesIn), human(e.BytesOut))
			}
			return tw.Flush()
		},
	}
	c.Flags().StringVar(&dir, "bpf-dir", config.DefaultBPFDir, "bpfDir of the daemon (where exposure_stats_v2 is pinned)")
	c.Flags().StringVar(&cfgFile, "config", "", "take bpfDir from this config file")
	c.Flags().StringVarP(&out, "output", "o", "table", "table or json")
	return c
}
