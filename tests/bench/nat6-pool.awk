# Pools the per-round ratios of several tests/bench/nat6.sh runs (their nat6.txt):
#   awk -f tests/bench/nat6-pool.awk RUN1/nat6.txt RUN2/nat6.txt ...
# Medians of the per-round ratios over every round of every run [min..max].
{ k = FILENAME ":" $1; v[k, $2, $3] = $4; r[k] = 1 }
function med(a, n,   i, j, t) { for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (a[j] < a[i]) { t = a[i]; a[i] = a[j]; a[j] = t }; lo = a[1]; hi = a[n]; return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2 }
function ratio(p, b, m,   k, a, n, x) { n = 0; for (k in r) if (v[k, b, m] > 0 && v[k, p, m] != "nan") a[++n] = v[k, p, m] / v[k, b, m]; x = med(a, n); return sprintf("%.3f [%.2f..%.2f] n=%d", x, lo, hi, n) }
END {
  split("p1 rate p50 p99", ms, " ")
  for (i = 1; i <= 4; i++) { m = ms[i]
    printf "%-5s nat6/plain6 %s | direct6/plain6 %s | docker6/plain6 %s | nat4/nat4-old %s | nat4/plain4 %s\n", m, ratio("nat6", "plain6", m), ratio("direct6", "plain6", m), ratio("docker6", "plain6", m), ratio("nat4", "nat4-old", m), ratio("nat4", "plain4", m) }
}
