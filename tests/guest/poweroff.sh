#!/bin/sh
# acpid handler for the power button: PID 1 is a shell, not busybox init, so
# power off directly.
echo "BROKKR-GUEST: power button, powering off uptime=$(cut -d" " -f1 /proc/uptime)" >/dev/console
sync
poweroff -f
