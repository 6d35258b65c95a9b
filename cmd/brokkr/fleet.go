package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/brokkr/brokkr/daemon/api"
	"github.com/brokkr/brokkr/daemon/config"
	"github.com/brokkr/brokkr/daemon/fleet"
	"github.com/spf13/cobra"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// etcdFlags are the fleet commands' connection flags, named as etcdctl
// names them so an operator's muscle memory carries over.
type etcdFlags struct {
	endpoints         string
	prefix            string
	cacert, cert, key string
	user, password    string
	timeout           time.Duration
}

func (f *etcdFlags) register(c *cobra.Command) {
	pf := c.PersistentFlags()
	pf.StringVar(&f.endpoints, "etcd", os.Getenv("BROKKR_ETCD"), "etcd endpoints, comma-separated (env BROKKR_ETCD)")
	pf.StringVar(&f.prefix, "prefix", envOr("BROKKR_ETCD_PREFIX", config.DefaultFleetPrefix), "key prefix (env BROKKR_ETCD_PREFIX)")
	pf.StringVar(&f.cacert, "cacert", os.Getenv("BROKKR_ETCD_CACERT"), "CA bundle verifying the etcd servers (env BROKKR_ETCD_CACERT)")
	pf.StringVar(&f.cert, "cert", os.Getenv("BROKKR_ETCD_CERT"), "client certificate (env BROKKR_ETCD_CERT)")
	pf.StringVar(&f.key, "key", os.Getenv("BROKKR_ETCD_KEY"), "client certificate's key (env BROKKR_ETCD_KEY)")
	pf.StringVar(&f.user, "user", os.Getenv("BROKKR_ETCD_USER"), "etcd user (env BROKKR_ETCD_USER)")
	pf.StringVar(&f.password, "password", "", "etcd password (prefer env BROKKR_ETCD_PASSWORD: flags show in ps)")
	pf.DurationVar(&f.timeout, "etcd-timeout", 10*time.Second, "how long to wait for etcd")
}

func envOr(k, def string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return def
}

func (f *etcdFlags) dial() (*clientv3.Client, error) {
	if f.endpoints == "" {
		return nil, userf("--etcd ENDPOINTS (or BROKKR_ETCD) is required")
	}
	pw := f.password
	if pw == "" {
		pw = os.Getenv("BROKKR_ETCD_PASSWORD")
	}
	if (f.cert == "") != (f.key == "") {
		return nil, userf("--cert and --key go together")
	}
	eps := strings.Split(f.endpoints, ",")
	cli, err := fleet.Dial(fleet.ClientConfig{Endpoints: eps, CA: f.cacert, Cert: f.cert, Key: f.key,
		User: f.user, Password: pw, DialTimeout: f.timeout})
	if err != nil {
		return nil, fmt.Errorf("connecting to etcd %s: %w", f.endpoints, err)
	}
	return cli, nil
}

func (f *etcdFlags) ctx(parent context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(parent, f.timeout)
}

func fleetCmd() *cobra.Command {
	f := &etcdFlags{}
	c := &cobra.Command{Use: "fleet", Short: "Many hosts: desired state in etcd, per-node status under leases",
		Long: `fleet drives many brokkrd nodes through etcd. Each node whose config has a fleet:
section watches <prefix>/nodes/<node>/desired (a document with the config file's network,
vms and exposures), applies each new revision as a whole or not at all, writes its status
to <prefix>/nodes/<node>/status and keeps <prefix>/nodes/<node>/alive under a lease.
A node cut off from etcd keeps serving what it last applied.

The etcd endpoints come from --etcd or BROKKR_ETCD, with the TLS flags below.`,
		Example: `  brokkr fleet apply --node host-1 -f host-1.yaml --dry-run
  brokkr fleet apply -f fleet.yaml
  brokkr fleet status
  brokkr fleet rm --node host-1`}
	f.register(c)
	c.AddCommand(fleetApplyCmd(f), fleetStatusCmd(f), fleetRmCmd(f))
	return c
}

func fleetApplyCmd(f *etcdFlags) *cobra.Command {
	var node, file string
	var dry bool
	c := &cobra.Command{
		Use:   "apply [--node N] -f FILE [--dry-run]",
		Short: "Write desired state: one node's document, or a fleet file (nodes: {NAME: {...}}) in one transaction",
		Long: `apply validates first, then writes. With --node N, FILE is one node's document (the
config file's network, vms and exposures); without it, FILE is a fleet file with
nodes: {NAME: {...}} and every node's document is written in one etcd transaction, or none.
The write compares and swaps on the revision read, so two operators never silently
overwrite each other: a lost race is an error naming the revision that moved.
--dry-run prints the +/~/- plan against each node's current desired state and writes nothing.`,
		Example: `  brokkr fleet apply --node host-1 -f host-1.yaml --dry-run
  brokkr fleet apply -f fleet.yaml`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			b, err := readConfigFile(file)
			if err != nil {
				return err
			}
			var docs map[string][]byte
			if node != "" {
				if !config.NodeNameRE.MatchString(node) {
					return userf("--node %q is not a node name (1-63 of A-Z a-z 0-9 . _ -)", node)
				}
				if _, err := config.ParseDocument(b); err != nil {
					printFieldErrors(cmd.ErrOrStderr(), file, err)
					return silentError{1}
				}
				docs = map[string][]byte{node: b}
			} else if docs, err = fleet.ParseFleetFile(b); err != nil {
				printFieldErrors(cmd.ErrOrStderr(), file, err)
				return silentError{1}
			}
			cli, err := f.dial()
			if err != nil {
				return err
			}
			defer cli.Close()
			ctx, cancel := f.ctx(cmd.Context())
			defer cancel()
			res, err := fleet.ApplyDocs(ctx, cli, f.prefix, docs, dry)
			var ce *fleet.ConflictError
			if errors.As(err, &ce) {
				return userError{err}
			}
			if err != nil {
				return err
			}
			w := cmd.OutOrStdout()
			for _, np := range res.Nodes {
				fmt.Fprintf(w, "node %s:", np.Node)
				if np.Unchanged {
					fmt.Fprintf(w, " unchanged (revision %d)\n", np.ReadRevision)
					continue
				}
				fmt.Fprintln(w)
				var buf strings.Builder
				printPlan(&buf, &np.Plan)
				for _, line := range strings.SplitAfter(strings.TrimRight(buf.String(), "\n"), "\n") {
					fmt.Fprintf(w, "  %s", line)
				}
				fmt.Fprintln(w)
			}
			if res.Revision != 0 {
				fmt.Fprintf(w, "written at revision %d\n", res.Revision)
			}
			return nil
		},
	}
	c.Flags().StringVar(&node, "node", "", "the node whose document FILE is (without: FILE is a fleet file)")
	c.Flags().StringVarP(&file, "file", "f", "", "document or fleet file (- for standard input)")
	c.Flags().BoolVar(&dry, "dry-run", false, "only print the +/~/- plan against each node's current desired state")
	return c
}

func fleetStatusCmd(f *etcdFlags) *cobra.Command {
	var out, node string
	c := &cobra.Command{
		Use:   "status [-o json] [--node N]",
		Short: "One row per node (alive or lost, last report, VMs, exposures, errors); --node N: its full status",
		Long: `status lists every node under the prefix: alive (its lease holds) or lost, when it last
reported, VMs running/total, exposures active/total and errors. --node N prints that
node's full status as brokkr status does; -o json prints the documents.`,
		Example: `  brokkr fleet status
  brokkr fleet status --node host-1 -o json`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := checkOutput(out); err != nil {
				return err
			}
			cli, err := f.dial()
			if err != nil {
				return err
			}
			defer cli.Close()
			ctx, cancel := f.ctx(cmd.Context())
			defer cancel()
			w := cmd.OutOrStdout()
			if node != "" {
				r, ok, err := fleet.Node(ctx, cli, f.prefix, node)
				if err != nil {
					return err
				}
				if !ok {
					return userf("node %q has no keys under %s", node, fleet.NodesDir(f.prefix))
				}
				if out == "json" {
					return printJSON(w, r)
				}
				printNodes(w, []fleet.NodeState{r})
				if r.Status != nil {
					fmt.Fprintln(w)
					printVMs(w, r.Status.VMs)
					fmt.Fprintln(w)
					printExposures(w, r.Status.Exposures)
					printSource(w, r.Status.Source)
				}
				return nil
			}
			rows, err := fleet.List(ctx, cli, f.prefix)
			if err != nil {
				return err
			}
			for i := range rows {
				rows[i].Status = nil // the full status is --node's
			}
			if out == "json" {
				return printJSON(w, rows)
			}
			printNodes(w, rows)
			return nil
		},
	}
	c.Flags().StringVarP(&out, "output", "o", "table", "table or json")
	c.Flags().StringVar(&node, "node", "", "show this node's full status")
	return c
}

func printNodes(w io.Writer, rows []fleet.NodeState) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "NODE\tALIVE\tREPORTED\tREVISION\tVMS\tEXPOSURES\tERRORS")
	for _, r := range rows {
		alive := "lost"
		if r.Alive {
			alive = "alive"
		}
		rev := fmt.Sprint(r.Revision)
		if !r.Converged && r.DesiredRevision != 0 {
			rev = fmt.Sprintf("%d (desired %d)", r.Revision, r.DesiredRevision)
		}
		errs := "-"
		if len(r.Errors) > 0 {
			errs = strings.Join(r.Errors, "; ")
		}
		reported := r.ReportedAt
		if ts, err := time.Parse(time.RFC3339Nano, reported); err == nil {
			reported = ts.Format(time.RFC3339) // the table needs seconds; -o json keeps all
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%d/%d\t%d/%d\t%s\n", r.Node, alive, dash(reported), rev,
			r.VMsRunning, r.VMs, r.ExposuresActive, r.Exposures, errs)
	}
	tw.Flush()
}

// printSource is the status table's line about a remote source (fleet mode).
func printSource(w io.Writer, s *api.Source) {
	if s == nil {
		return
	}
	fmt.Fprintf(w, "\nsource: %s node %s, %s, revision %d", s.Kind, s.Node, s.State, s.Revision)
	if s.Detail != "" {
		fmt.Fprintf(w, " (%s)", s.Detail)
	}
	fmt.Fprintln(w)
	for _, e := range s.Errors {
		fmt.Fprintf(w, "  revision %d rejected: %s\n", s.Rejected, e)
	}
}

func fleetRmCmd(f *etcdFlags) *cobra.Command {
	var node string
	c := &cobra.Command{
		Use:   "rm --node N",
		Short: "Remove a node's desired document and status (the node keeps what it runs)",
		Long: `rm deletes a node's desired document and its status from etcd. The node keeps running
what it last applied and reports that it has no desired document; to remove VMs or
exposures, apply a document without them first.`,
		Example: `  brokkr fleet rm --node host-1`,
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if node == "" {
				return userf("--node N is required")
			}
			cli, err := f.dial()
			if err != nil {
				return err
			}
			defer cli.Close()
			ctx, cancel := f.ctx(cmd.Context())
			defer cancel()
			n, alive, err := fleet.Remove(ctx, cli, f.prefix, node)
			if err != nil {
				return err
			}
			if n == 0 {
				return userf("node %q has no desired document or status under %s", node, fleet.NodesDir(f.prefix))
			}
			fmt.Fprintf(cmd.OutOrStdout(), "node %s: removed\n", node)
			if alive {
				fmt.Fprintf(cmd.ErrOrStderr(), "warning: node %s is alive: it keeps running its last state and reports again; stop its brokkrd to retire it\n", node)
			}
			return nil
		},
	}
	c.Flags().StringVar(&node, "node", "", "the node to remove")
	return c
}
