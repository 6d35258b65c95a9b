#!/usr/bin/env bash
# Removes brk-* network namespaces a killed test run may have left behind.
# Only namespaces brokkr's own tests create carry that prefix.
for ns in $(ip netns list 2>/dev/null | awk '/^brk-/{print $1}'); do
  for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
  ip netns delete "$ns" 2>/dev/null || true
done
