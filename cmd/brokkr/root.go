package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"text/tabwriter"

	"github.com/brokkr/brokkr/daemon/api"
	"github.com/brokkr/brokkr/daemon/config"
	"github.com/brokkr/brokkr/internal/spec"
	"github.com/spf13/cobra"
)

// The CLI uses github.com/spf13/cobra: nested verbs (vm ls|start|...),
// per-command flags, generated help and usage errors are what it does, and
// hand-rolled flag dispatch for that many verbs is where CLIs grow bugs.
func newRoot() *cobra.Command {
	root := &cobra.Command{
		Use:   "brokkr",
		Short: "Control brokkrd: VMs and the guest ports they publish",
		Long: `brokkr controls brokkrd, the daemon that runs this host's microVMs and publishes
their ports. It talks to brokkrd over its unix socket (--socket, env BROKKR_SOCKET,
default ` + api.DefaultSocket + `), except validate (offline) and stats (reads the
pinned counter map, so it works with the daemon down).

Exit status: 0 ok, 1 a user error (bad config, unknown VM, bad flags), 2 a daemon or
system error, 3 from status while any VM or exposure is failed.`,
		Example: `  brokkr validate -f brokkr.yaml
  brokkr apply -f brokkr.yaml --dry-run
  brokkr status
  brokkr vm stop web --wait
  source <(brokkr completion bash)   # complete VM and exposure names`,
		SilenceUsage:  true,
		SilenceErrors: true,
		Version:       api.CurrentBuild().String(),
	}
	root.SetVersionTemplate("{{.Name}} {{.Version}}\n")
	root.SetFlagErrorFunc(func(c *cobra.Command, err error) error {
		return userError{fmt.Errorf("%w\n%s", err, c.UsageString())}
	})
	var socket string
	client := func() *api.Client { return api.NewClient(socket) }
	// Only the commands that talk to the daemon take --socket.
	withSocket := func(c *cobra.Command) *cobra.Command {
		def := os.Getenv("BROKKR_SOCKET")
		if def == "" {
			def = api.DefaultSocket
		}
		c.PersistentFlags().StringVar(&socket, "socket", def, "brokkrd's API socket (env BROKKR_SOCKET)")
		return c
	}

	root.AddCommand(validateCmd(), withSocket(applyCmd(client)), withSocket(statusCmd(client)),
		withSocket(vmCmd(client)), withSocket(exposeCmd(client)), statsCmd(), fleetCmd())
	for _, c := range root.Commands() {
		wrapArgs(c)
	}
	return root
}

// socketFirst moves a leading --socket PATH (the spelling from before the
// flag moved onto the commands that use it) behind the command words, so
// "brokkr --socket S status" keeps working. It goes before a "--", and in a
// shell completion request (__complete ARGS... WORD) before the word being
// completed.
func socketFirst(args []string) []string {
	complete := len(args) > 0 && (args[0] == cobra.ShellCompRequestCmd || args[0] == cobra.ShellCompNoDescRequestCmd)
	head, rest := []string(nil), args
	if complete {
		head, rest = args[:1], args[1:]
	}
	n := 0
	switch {
	case len(rest) > 1 && rest[0] == "--socket":
		n = 2
	case len(rest) > 0 && strings.HasPrefix(rest[0], "--socket="):
		n = 1
	default:
		return args
	}
	flag, rest := rest[:n], rest[n:]
	at := len(rest)
	if i := slices.Index(rest, "--"); i >= 0 {
		at = i
	} else if complete && at > 0 {
		at--
	}
	out := append(append([]string{}, head...), rest[:at]...)
	out = append(out, flag...)
	return append(out, rest[at:]...)
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
		b, err = io.ReadAll(io.LimitReader(os.Stdin, config.MaxConfigBytes+1))
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
func loadConfigFile(cmd *cobra.Command, file string) ([]byte, *config.Config, *spec.Desired, error) {
	b, err := readConfigFile(file)
	if err != nil {
		return nil, nil, nil, err
	}
	cfg, model, err := config.Load(b)
	if err != nil {
		printFieldErrors(cmd.ErrOrStderr(), file, err)
		return nil, nil, nil, silentError{1}
	}
	return b, cfg, model, nil
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

// versions is the status header naming both builds, and a warning when the
// CLI and the daemon differ (an upgrade installed but brokkrd not restarted,
// or an old CLI elsewhere on PATH).
func versions(cli api.Build, d *api.Build) (line, warn string) {
	if d == nil {
		return fmt.Sprintf("brokkr %s, brokkrd unknown", cli),
			"brokkrd does not report its version (it is older than this CLI); restart it to run the installed build"
	}
	line = fmt.Sprintf("brokkr %s, brokkrd %s", cli, d)
	if cli.Version != d.Version || cli.Commit != d.Commit {
		warn = fmt.Sprintf("brokkr (CLI) is %s %s but brokkrd is %s %s; restart brokkrd after an upgrade, or check which brokkr is on PATH",
			cli.Version, cli.Commit, d.Version, d.Commit)
	}
	return line, warn
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
	fmt.Fprintln(tw, "VM\tPHASE\tPID\tADDRESS\tADDRESS6\tMAC\tTAP\tRESTARTS\tDETAIL")
	for _, v := range vms {
		pid := "-"
		if v.PID > 0 {
			pid = fmt.Sprint(v.PID)
		}
		detail := v.Detail
		if v.StateBytes > 0 {
			detail = strings.TrimSuffix("state "+human(uint64(v.StateBytes))+" on disk; "+detail, "; ")
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%d\t%s\n", v.Name, v.Phase, pid, dash(v.Address), dash(v.Address6), dash(v.MAC), dash(v.Tap), v.Restarts, detail)
	}
	tw.Flush()
}

// listen is where an exposure's callers dial: "*" for every host address
// of both families.
func listen(e api.Exposure) string {
	a := e.HostAddress
	switch {
	case a == "":
		a = "*"
	case strings.Contains(a, ":"):
		a = "[" + a + "]"
	}
	return fmt.Sprintf("%s:%s/%s", a, e.HostPorts(), e.Protocol)
}

func printExposures(w io.Writer, es []api.Exposure) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "EXPOSURE\tSTATE\tMODE\tLISTEN\tTO\tCAP\tACTIVE\tACCEPTED\tREFUSED\tDROPPED\tDENIED\tIN\tOUT\tREASON")
	for _, e := range es {
		to := e.VM
		if to == "" {
			to = strings.Trim(e.Target+","+e.Target6, ",")
		}
		capS := "none"
		if e.MaxConns > 0 {
			capS = fmt.Sprint(e.MaxConns)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s:%s\t%s\t%d\t%d\t%d\t%d\t%d\t%s\t%s\t%s\n", e.Name, e.State, e.Mode,
			listen(e), to, e.GuestPorts(), capS,
			e.Active, e.Accepted, e.Refused, e.Dropped, e.Denied, human(e.BytesIn), human(e.BytesOut), e.Reason)
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
