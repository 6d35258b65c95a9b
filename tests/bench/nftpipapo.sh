#!/bin/bash
# What one element added to an nft interval set of concatenations (pipapo)
# costs as the set grows: the commit of an exposure change if every
# exposure's allowFrom lived in one such set.
set -e
NS=brk-allow-nft
ip netns add $NS
trap 'ip netns del $NS' EXIT
for n in 0 1000 10000 100000; do
  f=$(mktemp)
  {
    printf "table inet t {\n set allowed { type mark . ipv4_addr; flags interval; }\n}\n"
    if [ $n -gt 0 ]; then
      echo -n "add element inet t allowed { "
      python3 -c "
n=$n
print(', '.join(f'{1+i//250} . 10.{(i>>16)&255}.{(i>>8)&255}.{i&255}/32' for i in range(n)))" | tr -d '\n'
      echo " }"
    fi
  } > $f
  ip netns exec $NS nft -f $f
  rm -f $f
  # 20 single-element commits, timed.
  t0=$(date +%s%N)
  for i in $(seq 1 20); do
    ip netns exec $NS nft add element inet t allowed "{ 999999 . 192.0.2.$i/32 }"
  done
  t1=$(date +%s%N)
  # baseline: 20 commits to an unrelated small set
  ip netns exec $NS nft add set inet t small "{ type mark . ipv4_addr; flags interval; }"
  t2=$(date +%s%N)
  for i in $(seq 1 20); do
    ip netns exec $NS nft add element inet t small "{ 999999 . 192.0.2.$i/32 }"
  done
  t3=$(date +%s%N)
  echo "set of $n: one element added: $(( (t1-t0)/20000 )) us per commit; to a small set beside it: $(( (t3-t2)/20000 )) us"
  ip netns exec $NS nft delete table inet t
done
