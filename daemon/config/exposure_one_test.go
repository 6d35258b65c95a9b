package config

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// One exposure decodes as an entry of exposures: does, defaults and all;
// its shape errors name its keys.
func TestDecodeExposure(t *testing.T) {
	e, err := DecodeExposure([]byte(`{"vm": "web", "guestPort": 80, "hostPort": 8080}`))
	require.NoError(t, err)
	c, err := Decode([]byte("exposures: [{vm: web, guestPort: 80, hostPort: 8080}]\n"))
	require.NoError(t, err)
	assert.Equal(t, c.Exposures[0], e, "the file's defaults")

	_, err = DecodeExposure([]byte("vm: web\nhostPort: [1]\nport: 3\n"))
	var ce Errors
	require.ErrorAs(t, err, &ce)
	assert.Equal(t, `hostPort: a list is not a port or a range of ports (8080, "30000-30099"); port: unknown key "port"`,
		ce[0].Error()+"; "+ce[1].Error())

	for _, body := range []string{"", "null", "3", "[]", "a: 1\n---\nb: 2\n"} {
		_, err = DecodeExposure([]byte(body))
		assert.Error(t, err, "%q", body)
	}
}

// WithExposure and WithoutExposure change a copy: the desired state they
// were made from is untouched.
func TestWithAndWithoutExposureCopy(t *testing.T) {
	c, err := Parse([]byte("vms: [{name: web, kernel: /k}]\nexposures:\n  - {name: a, vm: web, guestPort: 80, hostPort: 1}\n  - {name: b, vm: web, guestPort: 80, hostPort: 2}\n"))
	require.NoError(t, err)
	e := c.Exposures[0]
	e.HostPort = P(9)
	next, pos, replaced := c.WithExposure(e)
	assert.True(t, replaced)
	assert.Equal(t, 0, pos)
	assert.Equal(t, P(9), next.Exposures[0].HostPort)
	assert.Equal(t, P(1), c.Exposures[0].HostPort)

	e.Name = "c"
	next, pos, replaced = c.WithExposure(e)
	assert.False(t, replaced)
	assert.Equal(t, 2, pos)
	assert.Len(t, next.Exposures, 3)
	assert.Len(t, c.Exposures, 2)

	less, ok := c.WithoutExposure("a")
	assert.True(t, ok)
	require.Len(t, less.Exposures, 1)
	assert.Equal(t, "b", less.Exposures[0].Name)
	assert.Equal(t, "a", c.Exposures[0].Name)
	_, ok = c.WithoutExposure("zz")
	assert.False(t, ok)
}
