/* sparserl simt: guarded memory for untrusted kernels.  Included by runtime.h (after the
 * launch record, the worker and the fault helpers), so it sees SimtLaunch, SimtWorker,
 * simt_claim and simt_escape.
 *
 * Two checks that the per-access bounds checks of GPtr cannot give:
 *
 * 1. Raw-pointer accesses.  `(&x[0])[n_cols + k]` takes a plain pointer out of a checked
 *    element and indexes it unchecked.  In guarded builds every array argument is copied into
 *    its own mapping: the data pages in the middle of `guard_bytes` of PROT_NONE address
 *    space on each side (32 GiB: any int32 index times a 16-byte vector), so such an access
 *    faults.  A SIGSEGV handler, installed for the launch, turns a fault inside one of those
 *    guard regions into an out-of-bounds fault naming the array; any other SIGSEGV goes to
 *    the handler that was there before.  The rest of the data pages around the array is
 *    filled with 0xFF (NaN for every float type, -1 for int) and checked after the launch: a
 *    write there is an out-of-bounds write.  `placement` 0 puts the array at the start of its
 *    pages (an access one byte before it faults), 1 at their end, 16-byte aligned (an access
 *    past its end faults, or lands in fewer than 16 bytes of checked fill); verification runs
 *    both.  Arrays are copied back to the caller's memory after the launch (a kernel that
 *    writes into an input is seen by the caller's hash of it).
 *
 * 2. Races on the output.  Writes through a writable argument (`y`) are recorded per element
 *    (block, thread, barrier interval); an access by another thread that is not ordered after
 *    the write (another block, or the same block with no __syncthreads/warp sync between) is
 *    a `SIMT_F_GRACE` fault.  atomicAdd through `&y[i]` is not recorded: atomics may meet.
 *    Exact with one worker thread (what verification uses); best effort with several.
 *
 * The handler, the mappings and the shadows are per library and per launch; the caller
 * (launch.py) runs one guarded launch at a time in a process, since a signal disposition is
 * process-wide. */
#include <signal.h>
#include <unistd.h>

static inline bool simt_ordered(SimtWorker* w, int other, unsigned other_wep, int me);   /* runtime.h */

struct SimtGuardMap { char* base; size_t len; char* pages; size_t pages_len; char* data; void* orig; };
static SimtGuardMap simt_gm[SIMT_MAX_ARGS];
static SimtLaunch* volatile simt_gL;
static struct sigaction simt_old_segv;
static int simt_segv_installed;

struct SimtGShadow { int blk; int thr; unsigned epoch; unsigned wep; };   /* blk: block + 1, 0 = unwritten */
static SimtGShadow* simt_gsh[SIMT_MAX_ARGS];
static long long simt_gsh_n[SIMT_MAX_ARGS];

static void simt_segv(int sig, siginfo_t* si, void* uctx) {
    (void)uctx;
    SimtLaunch* L = simt_gL;
    SimtWorker* w = simt_w;
    const char* a = (const char*)si->si_addr;
    if (L && w && w->L == L && w->cur) {
        for (int i = 0; i < L->nargs; ++i) {
            const SimtGuardMap* g = &simt_gm[i];
            if (!g->base || a < g->base || a >= g->base + g->len) continue;
            long long el = L->elsize[i] > 0 ? L->elsize[i] : 1;
            long long off = (long long)(a - g->data);
            SimtFaultRec* f = simt_claim(w, SIMT_F_OOB);
            f->array = i;
            f->index = off >= 0 ? off / el : -((-off + el - 1) / el);
            f->extent = L->nbytes[i] / el;
            simt_msg(f, "index %lld is outside [0, %lld): an access through a raw pointer (byte offset %lld) "
                     "reached the guard region around the array", f->index, f->extent, off);
            simt_escape(w);
        }
    }
    (void)sig;
    sigaction(SIGSEGV, &simt_old_segv, 0);   /* not ours: the access faults again under the old handler */
}

/* copy every array argument into a guarded mapping; returns 0, or -1 (fault recorded) */
static int simt_guard_setup(SimtLaunch* L) {
    size_t page = (size_t)sysconf(_SC_PAGESIZE), G = (size_t)L->guard_bytes;
    for (int i = 0; i < L->nargs; ++i) {
        simt_gm[i].base = 0;
        simt_gsh[i] = 0;
        if (L->elsize[i] <= 0) continue;                      /* a scalar */
        size_t nb = (size_t)L->nbytes[i];
        size_t pl = (nb + page) / page * page;                /* at least one byte of fill */
        size_t len = 2 * G + pl;
        void* m = mmap(0, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (m == MAP_FAILED || mprotect((char*)m + G, pl, PROT_READ | PROT_WRITE) != 0) {
            if (m != MAP_FAILED) munmap(m, len);
            L->fault.kind = SIMT_F_INTERNAL;
            snprintf(L->fault.msg, sizeof L->fault.msg, "could not map %zu bytes of guarded memory for argument %d", len, i);
            return -1;
        }
        SimtGuardMap* g = &simt_gm[i];
        g->base = (char*)m; g->len = len; g->pages = (char*)m + G; g->pages_len = pl;
        g->data = L->placement ? (char*)(((uintptr_t)(g->pages + pl - nb)) & ~(uintptr_t)15) : g->pages;
        g->orig = L->ptr[i];
        memset(g->pages, 0xff, pl);
        if (nb) memcpy(g->data, g->orig, nb);
        L->ptr[i] = g->data;
        if (L->writable[i] && L->racecheck && nb) {
            simt_gsh_n[i] = (long long)nb / L->elsize[i];
            simt_gsh[i] = (SimtGShadow*)calloc((size_t)simt_gsh_n[i], sizeof(SimtGShadow));
        }
    }
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = simt_segv;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;   /* left by longjmp or a fiber switch, never returned from */
    sigemptyset(&sa.sa_mask);
    simt_gL = L;
    simt_segv_installed = sigaction(SIGSEGV, &sa, &simt_old_segv) == 0;
    return 0;
}

static int simt_fill_ok(const char* a, const char* b) {
    for (; a < b; ++a) if ((unsigned char)*a != 0xff) return 0;
    return 1;
}

/* after the launch: the fill around each array untouched, arrays copied back, mappings gone */
static void simt_guard_finish(SimtLaunch* L) {
    if (simt_segv_installed) sigaction(SIGSEGV, &simt_old_segv, 0);
    simt_segv_installed = 0;
    simt_gL = 0;
    for (int i = 0; i < L->nargs; ++i) {
        SimtGuardMap* g = &simt_gm[i];
        if (!g->base) continue;
        size_t nb = (size_t)L->nbytes[i];
        const char* end = g->data + nb;
        int before = simt_fill_ok(g->pages, g->data), after = simt_fill_ok(end, g->pages + g->pages_len);
        if ((!before || !after) && L->fault.kind == 0) {
            long long el = L->elsize[i] > 0 ? L->elsize[i] : 1;
            const char* c = g->pages;
            if (before) for (c = end; (unsigned char)*c == 0xff; ++c) {}
            else for (; (unsigned char)*c == 0xff; ++c) {}
            long long off = (long long)(c - g->data);
            L->fault.kind = SIMT_F_OOB; L->fault.array = i;
            L->fault.index = off >= 0 ? off / el : -((-off + el - 1) / el);
            L->fault.extent = (long long)nb / el; L->fault.other_thread = -1;
            snprintf(L->fault.msg, sizeof L->fault.msg,
                     "index %lld is outside [0, %lld): a write landed beside the array (byte offset %lld); "
                     "the writing thread is not known", L->fault.index, L->fault.extent, off);
        }
        if (nb && memcmp(g->orig, g->data, nb) != 0) memcpy(g->orig, g->data, nb);
        L->ptr[i] = g->orig;
        munmap(g->base, g->len);
        g->base = 0;
        free(simt_gsh[i]);
        simt_gsh[i] = 0;
    }
}

/* ------------------------------------------------------------------ races on the output */
__attribute__((noinline, noreturn)) static void simt_grace_fault(int id, long long u, const SimtGShadow* s, int write) {
    SimtWorker* w = simt_w;
    SimtFaultRec* f = simt_claim(w, SIMT_F_GRACE);
    f->array = id; f->index = u; f->extent = simt_gsh_n[id]; f->other_thread = s->thr;
    long long blk = (long long)w->blin;
    simt_msg(f, "element %lld: thread %d of block %d wrote it and thread %d of block %lld %s it with nothing "
             "ordering the two (use atomicAdd, or one thread per output element)",
             u, s->thr, s->blk - 1, w->cur->linear, blk, write ? "writes" : "reads");
    simt_escape(w);
}

static inline void simt_grace(int id, const void* a, size_t sz, int write) {
    if ((unsigned)id >= SIMT_MAX_ARGS || !simt_gsh[id]) return;
    SimtWorker* w = simt_w;
    const SimtLaunch* L = w->L;
    long long el = L->elsize[id], off = (long long)((const char*)a - (const char*)L->ptr[id]);
    if (off < 0 || off >= L->nbytes[id]) return;   /* the bounds check reports it */
    int me = w->cur->linear, blk = (int)w->blin + 1;
    unsigned mywep = w->wep[me >> 5];
    long long u1 = (off + (long long)sz + el - 1) / el;
    if (u1 > simt_gsh_n[id]) u1 = simt_gsh_n[id];
    for (long long u = off / el; u < u1; ++u) {
        SimtGShadow* s = &simt_gsh[id][u];
        if (s->blk && !(s->blk == blk && (s->thr == me || s->epoch != w->epoch ||
                                           simt_ordered(w, s->thr, s->wep, me))))
            simt_grace_fault(id, u, s, write);
        if (write) { s->blk = blk; s->thr = me; s->epoch = w->epoch; s->wep = mywep; }
    }
}

/* an element of a writable argument array: reads and writes are race-checked */
template <class T> struct GRef {
    T* a; int id;
    operator T() const { simt_grace(id, a, sizeof(T), 0); return *a; }
    GRef& operator=(T v) { simt_grace(id, a, sizeof(T), 1); *a = v; return *this; }
    GRef& operator=(const GRef& o) { T v = (T)o; return *this = v; }
    GRef& operator+=(T v) { T c = (T)*this; return *this = (T)(c + v); }
    GRef& operator-=(T v) { T c = (T)*this; return *this = (T)(c - v); }
    GRef& operator*=(T v) { T c = (T)*this; return *this = (T)(c * v); }
    GRef& operator/=(T v) { T c = (T)*this; return *this = (T)(c / v); }
    T* operator&() const { return a; }
};
/* what GPtr<T>::operator[] hands out: read-only elements as plain references, writable scalar
 * elements as GRef, writable vectors (float4 ...) as plain references counted as a write */
template <class T> struct simt_gref { typedef GRef<T> t; static t make(T* a, int id) { t r; r.a = a; r.id = id; return r; } };
template <class T> struct simt_gref<const T> { typedef const T& t; static t make(const T* a, int) { return *a; } };
#define SIMT_VEC_GREF(V) template <> struct simt_gref<V> { typedef V& t; \
    static t make(V* a, int id) { simt_grace(id, a, sizeof(V), 1); return *a; } };
SIMT_VEC_GREF(int2) SIMT_VEC_GREF(int4) SIMT_VEC_GREF(float2) SIMT_VEC_GREF(float4)
SIMT_VEC_GREF(double2) SIMT_VEC_GREF(__half2) SIMT_VEC_GREF(__nv_bfloat162)
