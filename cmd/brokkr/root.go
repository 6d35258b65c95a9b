package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/brokkr/brokkr/bpf"
	"github.com/brokkr/brokkr/daemon/api"
	"github.com/brokkr/brokkr/daemon/config"
	"github.com/spf13/cobra"
)

// The CLI uses github.com/spf13/cobra: nested verbs (vm ls|start|...),
// per-command flags, generated help and usage errors are what it does, and
// hand-rolled flag dispatch for that many verbs is where CLIs grow bugs.
func newRoot() *cobra.Command {
	var socket string
	root := &cobra.Command{
		Use:           "brokkr",
		Short:         "Control brokkrd: VMs and the guest ports they publish",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.SetFlagErrorFunc(func(c *cobra.Command, err error) error {
		return userError{fmt.Errorf("%w\n%s", err, c.UsageString())}
	})
	def := os.Getenv("BROKKR_SOCKET")
	if def == "" {
		def = api.DefaultSocket
	}
	root.PersistentFlags().StringVar(&socket, "socket", def, "brokkrd's API socket (env BROKKR_SOCKET)")
	client := func() *api.Client { return api.NewClient(socket) }

	root.AddCommand(validateCmd(), applyCmd(client), statusCmd(client), vmCmd(client), exposeCmd(client), statsCmd(), fleetCmd())
	for _, c := range root.Commands() {
		wrapArgs(c)
	}
	return root
}

// wrapArgs makes argument-count errors user errors (exit 1).
func wrapArgs(c *cobra.Command) {
	if c.Args != nil {
		check := c.Args
		c.Args = func(cmd *cobra.Command, args []string) error {
			if err := check(cmd, args); err != nil {
				return userError{fmt.Errorf("%s: %w", cmd.CommandPath(), err)}
			}
			return nil
		}
	}
	for _, s := range c.Commands() {
		wrapArgs(s)
	}
}

func readConfigFile(path string) ([]byte, error) {
	if path == "" {
		return nil, userf("-f FILE is required (- reads standard input)")
	}
	var b []byte
	var err error
	if path == "-" {
		b, err = io.ReadAll(io.LimitReader(os.Stdin, 8<<20))
	} else {
		b, err = os.ReadFile(path)
	}
	if err != nil {
		return nil, userError{err}
	}
	return b, nil
}

func printFieldErrors(w io.Writer, name string, err error) {
	fmt.Fprintf(w, "%s: invalid config:\n", name)
	var ce config.Errors
	if ok := asErrors(err, &ce); ok {
		for _, e := range ce {
			fmt.Fprintf(w, "  %s\n", e.Error())
		}
		return
	}
	fmt.Fprintf(w, "  %v\n", err)
}

// loadConfigFile reads and validates a config file offline; a bad file's
// field-named errors go to stderr and the command exits 1.
func loadConfigFile(cmd *cobra.Command, file string) ([]byte, *config.Config, error) {
	b, err := readConfigFile(file)
	if err != nil {
		return nil, nil, err
	}
	cfg, err := config.Parse(b)
	if err != nil {
		printFieldErrors(cmd.ErrOrStderr(), file, err)
		return nil, nil, silentError{1}
	}
	return b, cfg, nil
}

func validateCmd() *cobra.Command {
	var file string
	c := &cobra.Command{
		Use:   "validate -f FILE",
		Short: "Check a config file offline; field-named errors, exit 1 if invalid",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			_, cfg, err := loadConfigFile(cmd, file)
			if err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "%s: valid (%d VMs, %d exposures)\n", file, len(cfg.VMs), len(cfg.Exposures))
			return nil
		},
	}
	c.Flags().StringVarP(&file, "file", "f", "", "config file (- for standard input)")
	return c
}

func applyCmd(client func() *api.Client) *cobra.Command {
	var file string
	var dry, wait bool
	var timeout time.Duration
	c := &cobra.Command{
		Use:   "apply -f FILE [--dry-run] [--wait]",
		Short: "Make a config the desired state (validated as a whole; nothing applied unless all of it is valid)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			// Checked here first so a bad file is reported the same way,
			// daemon or not.
			b, _, err := loadConfigFile(cmd, file)
			if err != nil {
				return err
			}
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			plan, err := client().Apply(ctx, b, dry)
			if err != nil {
				return err
			}
			printPlan(cmd.OutOrStdout(), plan)
			if wait && !dry {
				return waitConverged(ctx, cmd.OutOrStdout(), client(), timeout)
			}
			return nil
		},
	}
	c.Flags().StringVarP(&file, "file", "f", "", "config file (- for standard input)")
	c.Flags().BoolVar(&dry, "dry-run", false, "only print what would change")
	c.Flags().BoolVar(&wait, "wait", false, "wait until every VM runs and every exposure is active (progress on a terminal)")
	c.Flags().DurationVar(&timeout, "timeout", 10*time.Minute, "how long --wait waits")
	return c
}

func printPlan(w io.Writer, p *api.Plan) {
	verb := "applied"
	if p.DryRun {
		verb = "would change (dry run)"
	}
	if p.VMs.Empty() && p.Exposures.Empty() && !p.NetworkChanged {
		fmt.Fprintf(w, "no changes\n")
	} else {
		fmt.Fprintf(w, "%s:\n", verb)
		if p.NetworkChanged {
			fmt.Fprintf(w, "  ~ network\n")
		}
		for _, sec := range []struct {
			kind string
			c    api.Changes
		}{{"vm", p.VMs}, {"exposure", p.Exposures}} {
			for _, n := range sec.c.Added {
				fmt.Fprintf(w, "  + %s %s\n", sec.kind, n)
			}
			for _, n := range sec.c.Changed {
				fmt.Fprintf(w, "  ~ %s %s\n", sec.kind, n)
			}
			for _, n := range sec.c.Removed {
				fmt.Fprintf(w, "  - %s %s\n", sec.kind, n)
			}
		}
	}
	for _, warn := range p.Warnings {
		fmt.Fprintf(w, "warning: %s\n", warn)
	}
}

func statusCmd(client func() *api.Client) *cobra.Command {
	var out string
	c := &cobra.Command{
		Use:   "status [-o json]",
		Short: "VMs and exposures with their state and counters",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := checkOutput(out); err != nil {
				return err
			}
			st, err := client().Status(cmd.Context())
			if err != nil {
				return err
			}
			if out == "json" {
				return printJSON(cmd.OutOrStdout(), st)
			}
			w := cmd.OutOrStdout()
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
			return nil
		},
	}
	c.Flags().StringVarP(&out, "output", "o", "table", "table or json")
	return c
}

func checkOutput(o string) error {
	if o != "table" && o != "json" {
		return userf("-o %q: want table or json", o)
	}
	return nil
}

func printJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func printVMs(w io.Writer, vms []api.VM) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "VM\tPHASE\tPID\tADDRESS\tMAC\tTAP\tRESTARTS\tDETAIL")
	for _, v := range vms {
		pid := "-"
		if v.PID > 0 {
			pid = fmt.Sprint(v.PID)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%d\t%s\n", v.Name, v.Phase, pid, dash(v.Address), dash(v.MAC), dash(v.Tap), v.Restarts, v.Detail)
	}
	tw.Flush()
}

func printExposures(w io.Writer, es []api.Exposure) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "EXPOSURE\tSTATE\tMODE\tLISTEN\tTO\tCAP\tACTIVE\tACCEPTED\tREFUSED\tDROPPED\tIN\tOUT\tREASON")
	for _, e := range es {
		to := e.VM
		if to == "" {
			to = e.Target
		}
		capS := "none"
		if e.MaxConns > 0 {
			capS = fmt.Sprint(e.MaxConns)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s:%d\t%s\t%d\t%d\t%d\t%d\t%s\t%s\t%s\n", e.Name, e.State, e.Mode,
			fmt.Sprintf("%s:%d/%s", e.HostAddress, e.HostPort, e.Protocol), to, e.GuestPort, capS,
			e.Active, e.Accepted, e.Refused, e.Dropped, human(e.BytesIn), human(e.BytesOut), e.Reason)
	}
	tw.Flush()
}

func human(b uint64) string {
	const unit = 1024
	if b < unit {
		return fmt.Sprintf("%dB", b)
	}
	div, exp := uint64(unit), 0
	for n := b / unit; n >= unit; n /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f%ciB", float64(b)/float64(div), "KMGTPE"[exp])
}

func vmCmd(client func() *api.Client) *cobra.Command {
	c := &cobra.Command{Use: "vm", Short: "List, start, stop, restart VMs; follow a VM's console"}
	c.AddCommand(listCmd("List VMs", client, func(w io.Writer, st *api.Status, asJSON bool) error {
		if asJSON {
			return printJSON(w, st.VMs)
		}
		printVMs(w, st.VMs)
		return nil
	}))
	for _, a := range []struct{ verb, short string }{
		{"start", "Set a VM's desired power to running (persisted)"},
		{"stop", "Set a VM's desired power to stopped (persisted)"},
		{"restart", "Restart a running VM"},
	} {
		verb := a.verb
		c.AddCommand(&cobra.Command{
			Use: verb + " NAME", Short: a.short, Args: cobra.ExactArgs(1),
			RunE: func(cmd *cobra.Command, args []string) error {
				if err := client().VMAction(cmd.Context(), args[0], verb); err != nil {
					return err
				}
				fmt.Fprintf(cmd.OutOrStdout(), "%s: %s requested\n", args[0], verb)
				return nil
			},
		})
	}
	var noFollow bool
	console := &cobra.Command{
		Use: "console NAME", Short: "Print a VM's serial console log and follow it (Ctrl-C ends)", Args: cobra.ExactArgs(1),
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

func exposeCmd(client func() *api.Client) *cobra.Command {
	c := &cobra.Command{Use: "expose", Short: "Published guest ports"}
	c.AddCommand(listCmd("List exposures with state and counters", client, func(w io.Writer, st *api.Status, asJSON bool) error {
		if asJSON {
			return printJSON(w, st.Exposures)
		}
		printExposures(w, st.Exposures)
		return nil
	}))
	return c
}

// listCmd is an `ls` verb showing one part of the daemon's status, as a
// table or (-o json) as JSON.
func listCmd(short string, client func() *api.Client, show func(w io.Writer, st *api.Status, asJSON bool) error) *cobra.Command {
	var out string
	ls := &cobra.Command{
		Use: "ls", Short: short, Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := checkOutput(out); err != nil {
				return err
			}
			st, err := client().Status(cmd.Context())
			if err != nil {
				return err
			}
			return show(cmd.OutOrStdout(), st, out == "json")
		},
	}
	ls.Flags().StringVarP(&out, "output", "o", "table", "table or json")
	return ls
}

func statsCmd() *cobra.Command {
	var dir, out string
	c := &cobra.Command{
		Use:   "stats [--bpf-dir DIR]",
		Short: "Read the pinned exposure_stats map directly (works with the daemon down)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := checkOutput(out); err != nil {
				return err
			}
			entries, err := bpf.Dump(filepath.Join(dir, bpf.MapName))
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
			fmt.Fprintln(tw, "EXPOSURE\tSLOT\tPORT\tACTIVE\tACCEPTED\tREFUSED\tDROPPED\tIN\tOUT")
			for _, e := range entries {
				fmt.Fprintf(tw, "%s\t%d\t%d/%s\t%d\t%d\t%d\t%d\t%s\t%s\n", e.Name, e.Slot, e.HostPort, bpf.ProtoName(e.Protocol),
					e.Active, e.Accepted, e.Refused, e.Dropped, human(e.BytesIn), human(e.BytesOut))
			}
			return tw.Flush()
		},
	}
	c.Flags().StringVar(&dir, "bpf-dir", config.DefaultBPFDir, "bpfDir of the daemon (where exposure_stats is pinned)")
	c.Flags().StringVarP(&out, "output", "o", "table", "table or json")
	return c
}
