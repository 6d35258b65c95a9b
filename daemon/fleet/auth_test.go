package fleet_test

import (
	"context"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/brokkr/brokkr/daemon/fleet"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// TestFleetAuthAndTLS sets etcd up the way the README says (TLS with client
// certificates, auth on, scripts/fleet-roles.sh per node) and checks that
// the roles are enough for a node and no more: h1 cannot read or write h2's
// keys. h1 authenticates by its certificate's CN, h2 by user and password.
func TestFleetAuthAndTLS(t *testing.T) {
	needEnv(t)
	if _, err := exec.LookPath("etcdctl"); err != nil {
		t.Skip("etcdctl is not installed (scripts/deps.sh installs etcd-client)")
	}
	ca := newCerts(t)
	c := newCluster(t, 3, ca)
	rootCert, rootKey := ca.client("root")
	roles := func(args ...string) {
		t.Helper()
		cmd := exec.Command("../../scripts/fleet-roles.sh", args...)
		cmd.Env = append(os.Environ(), "ETCDCTL_ENDPOINTS="+strings.Join(c.endpoints(""), ","),
			"ETCDCTL_CACERT="+ca.ca, "ETCDCTL_CERT="+rootCert, "ETCDCTL_KEY="+rootKey)
		out, err := cmd.CombinedOutput()
		require.NoError(t, err, "fleet-roles.sh %v: %s", args, out)
	}
	roles("enable", "rootpw")
	roles("node", "h1")
	roles("node", "h2", "h2secret")
	roles("admin")
	roles("node", "h1") // a re-run is harmless

	h1Cert, h1Key := ca.client("brokkr-node-h1")
	h1 := newNode(t, c, 1, "  ca: "+ca.ca+"\n  cert: "+h1Cert+"\n  key: "+h1Key+"\n")
	// The TLS layer wants a certificate from everyone; h2's names no user,
	// so h2 is who its password says.
	anyCert, anyKey := ca.client("nobody")
	h2 := newNode(t, c, 2, "  ca: "+ca.ca+"\n  cert: "+anyCert+"\n  key: "+anyKey+"\n  user: brokkr-node-h2\n  password: h2secret\n")

	adminCert, adminKey := ca.client("brokkr-admin")
	admin := []string{"BROKKR_ETCD_CACERT=" + ca.ca, "BROKKR_ETCD_CERT=" + adminCert, "BROKKR_ETCD_KEY=" + adminKey}
	f := writeFile(t, t.TempDir(), "fleet.yaml", fleetFile(indent("h1", h1.doc(9000)), indent("h2", h2.doc(9000))))
	out, errs, code := brokkr(t, c, admin, "fleet", "apply", "-f", f)
	require.Equal(t, 0, code, out+errs)
	adminCli := c.client(t, fleet.ClientConfig{CA: ca.ca, Cert: adminCert, Key: adminKey})
	// Each node watched, applied and reported with only its own role.
	waitConverged(t, adminCli, "h1", 1)
	waitConverged(t, adminCli, "h2", 1)

	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for _, who := range []struct {
		name string
		cfg  fleet.ClientConfig
		own  string
	}{
		{"h1 by certificate", fleet.ClientConfig{CA: ca.ca, Cert: h1Cert, Key: h1Key}, "h1"},
		{"h2 by password", fleet.ClientConfig{CA: ca.ca, Cert: anyCert, Key: anyKey, User: "brokkr-node-h2", Password: "h2secret"}, "h2"},
	} {
		other := map[string]string{"h1": "h2", "h2": "h1"}[who.own]
		cli := c.client(t, who.cfg)
		own, theirs := fleet.NodeKeys("/brokkr", who.own), fleet.NodeKeys("/brokkr", other)
		_, err := cli.Get(ctx, own.Desired)
		assert.NoError(t, err, "%s reads its own desired", who.name)
		_, err = cli.Put(ctx, own.Status, "{}")
		assert.NoError(t, err, "%s writes its own status", who.name)
		_, err = cli.Put(ctx, own.Desired, "exposures: []")
		assert.ErrorIs(t, err, rpctypes.ErrPermissionDenied, "%s cannot write its own desired", who.name)
		for _, k := range []string{theirs.Desired, theirs.Status, theirs.Alive} {
			_, err = cli.Get(ctx, k)
			assert.ErrorIs(t, err, rpctypes.ErrPermissionDenied, "%s reads %s", who.name, k)
			_, err = cli.Put(ctx, k, "x")
			assert.ErrorIs(t, err, rpctypes.ErrPermissionDenied, "%s writes %s", who.name, k)
		}
		_, err = cli.Delete(ctx, theirs.Desired)
		assert.ErrorIs(t, err, rpctypes.ErrPermissionDenied, "%s deletes %s", who.name, theirs.Desired)
		_, err = cli.Get(ctx, fleet.NodesDir("/brokkr"), clientv3.WithPrefix())
		assert.ErrorIs(t, err, rpctypes.ErrPermissionDenied, "%s lists every node", who.name)
	}

	// No client certificate: the TLS handshake itself is refused.
	noCert, err := fleet.Dial(fleet.ClientConfig{Endpoints: c.endpoints(""), CA: ca.ca})
	require.NoError(t, err)
	defer noCert.Close()
	short, cancel2 := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel2()
	_, err = noCert.Get(short, "/brokkr/nodes/h1/desired")
	assert.Error(t, err, "a client without a certificate gets nothing")

	// The CLI without credentials is a clear failure, not a hang.
	_, errs, code = brokkr(t, c, []string{"BROKKR_ETCD_CACERT=" + ca.ca, "BROKKR_ETCD_CERT=" + h1Cert, "BROKKR_ETCD_KEY=" + h1Key},
		"fleet", "status")
	assert.Equal(t, 2, code)
	assert.Contains(t, errs, "permission denied")
}
