# prof.py NATPATH_C: instruments bpf/natpath.c (in place; run it on a copy)
# for tests/bench/natprof.sh: brk_nat_pre times itself with bpf_ktime_get_ns
# and adds the time to a per-CPU array by what the packet was (admitted,
# data, first or second FIN, ...). Anchored on the source's text: a change
# of those lines makes it fail loudly, not measure something else.
import sys

p=sys.argv[1]
s=open(p).read()
old0='static __always_inline int account(struct bpf_nf_ctx *ctx, int hook)\n{'
assert s.count(old0) == 1, old0
s=s.replace(old0,
'''struct dbgv { __u64 n, ns; };
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 16);
	__type(key, __u32);
	__type(value, struct dbgv);
} brk_prof SEC(".maps");

static __always_inline int account(struct bpf_nf_ctx *ctx, int hook, __u32 *cat)
{''')
def rep(old,new,count=1,opt=False):
    global s
    if opt and s.count(old)==0: return
    assert s.count(old)==count, (old, s.count(old))
    s=s.replace(old,new)
rep('''	if (!f) {
''','''	if (!f) {
		*cat = 3;
''')
rep('''		brk_wake(slot);
''','''		brk_wake(slot);
		*cat = 2;
''')
rep('''	__u8 fl = p.tcp_flags;
''','''	__u8 fl = p.tcp_flags;
	*cat = (fl & TH_SYN) ? 4 : p.payload ? 5 : 8;
''')
rep('''	if (fl & TH_RST) {
''','''	if (fl & TH_RST) {
		*cat = 9;
''')
rep('''	if (fl & TH_FIN) {
''','''	if (fl & TH_FIN) {
		*cat = 6;
''')
rep('''			release(f, st, lim);
			// Nothing''','''			*cat = 7;
			release(f, st, lim);
			// Nothing''')
rep('''	return account(ctx, NF_INET_PRE_ROUTING);''','''	__u64 t0 = bpf_ktime_get_ns();
	__u32 cat = 0;
	int r = account(ctx, NF_INET_PRE_ROUTING, &cat);
	__u64 dt = bpf_ktime_get_ns() - t0;
	if (cat > 15) cat = 15;
	struct dbgv *d = bpf_map_lookup_elem(&brk_prof, &cat);
	if (d) { d->n++; d->ns += dt; }
	return r;''')
rep('''	return account(ctx, NF_INET_LOCAL_OUT);''','''	__u32 cat = 0;
	return account(ctx, NF_INET_LOCAL_OUT, &cat);''')
open(p,'w').write(s)
