package fleet_test

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// certs is a CA made for one test, with a server certificate for every
// address etcd is reached at here and client certificates on demand.
type certs struct {
	t                     testing.TB
	dir                   string
	ca                    string
	serverCert, serverKey string
	caCert                *x509.Certificate
	caKey                 *ecdsa.PrivateKey
	serial                int64
}

func newCerts(t testing.TB) *certs {
	t.Helper()
	c := &certs{t: t, dir: t.TempDir(), serial: 1}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(c.serial), Subject: pkix.Name{CommonName: "brokkr test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	require.NoError(t, err)
	c.caCert, err = x509.ParseCertificate(der)
	require.NoError(t, err)
	c.caKey = key
	c.ca = filepath.Join(c.dir, "ca.pem")
	writePEM(t, c.ca, "CERTIFICATE", der)
	ips := []net.IP{net.ParseIP("127.0.0.1")}
	for k := 1; k <= 20; k++ {
		ips = append(ips, net.ParseIP(fmt.Sprintf("10.77.%d.1", k)))
	}
	c.serverCert, c.serverKey = c.issue("etcd", ips, []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth})
	return c
}

// client issues a client certificate whose CN etcd takes as the user name.
func (c *certs) client(cn string) (cert, key string) {
	return c.issue(cn, nil, []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth})
}

func (c *certs) issue(cn string, ips []net.IP, usage []x509.ExtKeyUsage) (string, string) {
	c.t.Helper()
	c.serial++
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(c.t, err)
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(c.serial), Subject: pkix.Name{CommonName: cn},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: usage, IPAddresses: ips,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, c.caCert, &key.PublicKey, c.caKey)
	require.NoError(c.t, err)
	kb, err := x509.MarshalECPrivateKey(key)
	require.NoError(c.t, err)
	cert := filepath.Join(c.dir, cn+".pem")
	keyPath := filepath.Join(c.dir, cn+"-key.pem")
	writePEM(c.t, cert, "CERTIFICATE", der)
	writePEM(c.t, keyPath, "EC PRIVATE KEY", kb)
	return cert, keyPath
}

func writePEM(t testing.TB, path, typ string, der []byte) {
	t.Helper()
	require.NoError(t, os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600))
}
