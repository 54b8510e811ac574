/* sparserl simt runtime: the CUDA built-ins of the kernel language, for running one kernel
 * on the CPU.  Included (by sparserl_compile/simt/build.py) in front of a kernel that
 * sparserl_compile/simt/rewrite.py has prepared; see sparserl_compile/simt/__init__.py for
 * what is and is not modelled.
 *
 * One kernel + this header = one shared library exporting `simt_launch(SimtLaunch*)`.
 * Blocks are spread over `workers` OS threads.  Inside a block, kernels that use
 * __syncthreads / __syncwarp / __shfl_*_sync run every CUDA thread as a fiber (a stack of
 * its own and a 6-register context switch, x86-64; ucontext elsewhere); other kernels run
 * the threads one after the other as plain calls.  Faults are recorded in the launch record
 * and abandon the launch: the fiber (or plain loop) is left, never resumed.
 *
 * SIMT_GUARDED (set by the build) selects the checked pointer, shared-array and local-array
 * types that rewrite.py substitutes for raw ones. */
#include <stdint.h>
#include <stddef.h>
#include <string.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdarg.h>
#include <setjmp.h>
#include <pthread.h>
#include <time.h>
#include <sys/mman.h>
#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#ifndef SIMT_GUARDED
#define SIMT_GUARDED 0
#endif
#ifndef SIMT_FIBERS
#define SIMT_FIBERS 0
#endif

/* libm, declared here rather than through <math.h>: the C++ <math.h> costs more compile
 * time than a whole kernel */
extern "C" {
float fmaf(float, float, float); double fma(double, double, double);
float fminf(float, float); float fmaxf(float, float); double fmin(double, double); double fmax(double, double);
float sqrtf(float); double sqrt(double); float fabsf(float); double fabs(double);
float expf(float); double exp(double); float logf(float); double log(double);
float floorf(float); double floor(double); float ceilf(float); double ceil(double);
float powf(float, float); double pow(double, double); float tanhf(float); double tanh(double);
}
static inline bool isnan(float v) { return __builtin_isnan(v); }
static inline bool isnan(double v) { return __builtin_isnan(v); }
static inline bool isinf(float v) { return __builtin_isinf(v); }
static inline bool isinf(double v) { return __builtin_isinf(v); }
static inline float rsqrtf(float v) { return 1.0f / sqrtf(v); }
#define INFINITY (__builtin_inff())
#define NAN (__builtin_nanf(""))

/* ------------------------------------------------------------------ qualifiers */
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define warpSize 32

/* ------------------------------------------------------------------ launch record */
enum {
    SIMT_OK = 0, SIMT_F_OOB = 1, SIMT_F_MISALIGNED = 2, SIMT_F_BARRIER = 3, SIMT_F_WARP = 4,
    SIMT_F_STEPS = 5, SIMT_F_TIMEOUT = 6, SIMT_F_RACE = 7, SIMT_F_SMEM = 8, SIMT_F_INTERNAL = 9,
    SIMT_F_GRACE = 10
};
#define SIMT_MAX_ARGS 24
#define SIMT_MAX_SHARED 64
#define SIMT_SMEM_LIMIT (227 * 1024)

struct SimtFaultRec {          /* mirrored by launch.py (_FaultRec) */
    int kind; int array;       /* array: parameter index, or 64+ for shared/local arrays */
    long long index; long long extent;
    unsigned thread[3]; unsigned block[3];
    int other_thread; int line; unsigned mask; int pad;
    char msg[512];
};

struct SimtLaunch {            /* mirrored by launch.py (_Launch) */
    unsigned grid[3]; unsigned block[3];
    long long smem; long long step_limit; double time_limit_s;
    int workers; int racecheck; int nargs; int fibers;
    long long ival[SIMT_MAX_ARGS]; void* ptr[SIMT_MAX_ARGS]; long long nbytes[SIMT_MAX_ARGS];
    long long max_steps; long long switches; long long blocks_done;
    int claimed; int abort_flag;
    int placement; int pad2;     /* guarded builds: arrays at the start (0) or end (1) of their pages */
    long long guard_bytes;       /* PROT_NONE bytes on each side of every array (0: no mappings) */
    long long elsize[SIMT_MAX_ARGS];   /* element bytes of each array argument (0: a scalar) */
    int writable[SIMT_MAX_ARGS];       /* 1 for arrays the kernel may write (race-checked) */
    SimtFaultRec fault;
};

struct uint3 { unsigned x, y, z; };
typedef uint3 dim3;

enum { T_READY = 0, T_BAR = 1, T_WARP = 2, T_DONE = 3 };
enum { W_SHFL = 1, W_UP = 2, W_DOWN = 3, W_XOR = 4, W_SYNC = 5 };

struct SimtThread {
    void* sp;
    uint3 tid; int linear; int state;
    long long steps;
    int wkind; unsigned wmask; int wline; int warg; int wwidth; int bline;
    uint64_t wval; uint64_t wres;
#if !defined(__x86_64__)
    ucontext_t uc;
#endif
};

struct SimtShadow { unsigned wep; int writer; unsigned wwep; unsigned rep; int r1; unsigned r1w; int r2; unsigned r2w; };

struct SimtWorker {
    SimtLaunch* L;
    uint3 bid, bdim, gdim;
    SimtThread* cur;
    long long steps, budget, step_cap, step_limit;
    long long blin;            /* linear index of the block being run */
    double deadline;
    int fibers, in_fiber, faulted, nth;
    void* sched_sp;
#if !defined(__x86_64__)
    ucontext_t sched_uc;
#endif
    jmp_buf jmp;
    SimtThread* th;
    char* stacks; size_t stack_sz, stacks_len;
    int bar_arrived, bar_line, n_done;
    char* arena; long long arena_cap, dyn, static_top;
    long long st_off[SIMT_MAX_SHARED], st_len[SIMT_MAX_SHARED];
    SimtShadow* shadow; unsigned epoch, wclock; unsigned* wep;
    long long switches, max_steps;
    SimtFaultRec scratch;
};

static __thread SimtWorker* simt_w;
static void simt_entry(const SimtLaunch* L);   /* defined after the kernel by build.py */

#define threadIdx (simt_w->cur->tid)
#define blockIdx (simt_w->bid)
#define blockDim (simt_w->bdim)
#define gridDim (simt_w->gdim)

static double simt_now(void) {
    struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ------------------------------------------------------------------ context switch */
#if defined(__x86_64__)
extern "C" void simt_swap(void** save_sp, void* to_sp) __attribute__((visibility("hidden")));
__asm__(
    ".text\n"
    ".globl simt_swap\n"
    ".hidden simt_swap\n"
    ".type simt_swap,@function\n"
    "simt_swap:\n"
    "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
    "  movq %rsp, (%rdi)\n"
    "  movq %rsi, %rsp\n"
    "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n"
    "  ret\n"
    ".size simt_swap, .-simt_swap\n");
#endif

static void simt_fiber_main(void);

static void simt_to_sched(SimtWorker* w) {          /* fiber -> scheduler */
    w->in_fiber = 0;
#if defined(__x86_64__)
    simt_swap(&w->cur->sp, w->sched_sp);
#else
    swapcontext(&w->cur->uc, &w->sched_uc);
#endif
}

static void simt_to_fiber(SimtWorker* w, SimtThread* t) {   /* scheduler -> fiber */
    w->cur = t; w->steps = t->steps; w->in_fiber = 1; w->switches++;
#if defined(__x86_64__)
    simt_swap(&w->sched_sp, t->sp);
#else
    swapcontext(&w->sched_uc, &t->uc);
#endif
    t->steps = w->steps;
}

static void simt_fiber_init(SimtWorker* w, SimtThread* t, int i) {
    char* base = w->stacks + (size_t)i * w->stack_sz;      /* lowest page is the guard */
#if defined(__x86_64__)
    uintptr_t top = ((uintptr_t)(base + w->stack_sz)) & ~(uintptr_t)15;
    void** sp = (void**)top;
    *--sp = 0;                               /* fake return address of simt_fiber_main */
    *--sp = (void*)&simt_fiber_main;         /* popped by simt_swap's ret */
    for (int k = 0; k < 6; ++k) *--sp = 0;   /* rbp rbx r12 r13 r14 r15 */
    t->sp = (void*)sp;
#else
    getcontext(&t->uc);
    t->uc.uc_stack.ss_sp = base + 4096;
    t->uc.uc_stack.ss_size = w->stack_sz - 4096;
    t->uc.uc_link = 0;
    makecontext(&t->uc, (void (*)(void))simt_fiber_main, 0);
#endif
}

/* ------------------------------------------------------------------ faults */
static SimtFaultRec* simt_claim(SimtWorker* w, int kind) {
    SimtLaunch* L = w->L;
    int expected = 0;
    __atomic_store_n(&L->abort_flag, 1, __ATOMIC_RELEASE);
    SimtFaultRec* f = &w->scratch;
    if (__atomic_compare_exchange_n(&L->claimed, &expected, 1, false, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
        f = &L->fault;
    memset(f, 0, sizeof *f);
    f->kind = kind; f->array = -1; f->other_thread = -1;
    if (w->cur) { f->thread[0] = w->cur->tid.x; f->thread[1] = w->cur->tid.y; f->thread[2] = w->cur->tid.z; }
    f->block[0] = w->bid.x; f->block[1] = w->bid.y; f->block[2] = w->bid.z;
    return f;
}

__attribute__((noreturn)) static void simt_escape(SimtWorker* w) {
    w->faulted = 1;
    if (w->in_fiber) { simt_to_sched(w); __builtin_trap(); }   /* never resumed */
    longjmp(w->jmp, 1);
}

__attribute__((format(printf, 2, 3))) static void simt_msg(SimtFaultRec* f, const char* fmt, ...) {
    va_list ap; va_start(ap, fmt); vsnprintf(f->msg, sizeof f->msg, fmt, ap); va_end(ap);
}

__attribute__((noinline, noreturn)) static void simt_fault_oob(int id, long long index, long long extent,
                                                                int misaligned, long long align) {
    SimtWorker* w = simt_w;
    SimtFaultRec* f = simt_claim(w, misaligned ? SIMT_F_MISALIGNED : SIMT_F_OOB);
    f->array = id; f->index = index; f->extent = extent;
    if (misaligned)
        simt_msg(f, "misaligned access: element offset is not a multiple of the %lld-byte vector alignment", align);
    else
        simt_msg(f, "index %lld is outside [0, %lld)", index, extent);
    simt_escape(w);
}

__attribute__((noinline)) static void simt_tick_slow(SimtWorker* w) {
    if (w->step_limit > 0 && w->steps > w->step_limit) {
        SimtFaultRec* f = simt_claim(w, SIMT_F_STEPS);
        f->index = w->steps;
        simt_msg(f, "a thread ran more than %lld loop iterations (step_limit); an endless loop?", w->step_limit);
        simt_escape(w);
    }
    if (__atomic_load_n(&w->L->abort_flag, __ATOMIC_ACQUIRE)) { w->faulted = 1; simt_escape(w); }
    if (w->deadline > 0 && simt_now() > w->deadline) {
        SimtFaultRec* f = simt_claim(w, SIMT_F_TIMEOUT);
        f->index = w->steps;
        simt_msg(f, "the launch ran past its time limit of %.3g s (this thread was at %lld loop iterations); an endless loop?",
                 w->L->time_limit_s, w->steps);
        simt_escape(w);
    }
    w->budget = 65536;
}

/* counted at every loop-condition evaluation (rewrite.py inserts it) */
static inline __attribute__((always_inline)) bool simt_tick(void) {
    SimtWorker* w = simt_w;
    if (__builtin_expect(++w->steps > w->step_cap || --w->budget < 0, 0)) simt_tick_slow(w);
    return true;
}

/* ------------------------------------------------------------------ vector types */
struct __align__(8) int2 { int x, y; };
struct __align__(16) int4 { int x, y, z, w; };
struct __align__(8) float2 { float x, y; };
struct __align__(16) float4 { float x, y, z, w; };
struct __align__(16) double2 { double x, y; };
static inline int2 make_int2(int x, int y) { int2 r = {x, y}; return r; }
static inline int4 make_int4(int x, int y, int z, int w) { int4 r = {x, y, z, w}; return r; }
static inline float2 make_float2(float x, float y) { float2 r = {x, y}; return r; }
static inline float4 make_float4(float x, float y, float z, float w) { float4 r = {x, y, z, w}; return r; }
static inline uint3 make_uint3(unsigned x, unsigned y, unsigned z) { uint3 r = {x, y, z}; return r; }

/* ------------------------------------------------------------------ half / bfloat16 */
static inline float simt_bits2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t simt_f2bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

static inline uint16_t simt_f2h(float f) {            /* IEEE binary16, round to nearest even */
    uint32_t x = simt_f2bits(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return 0x7fffu;             /* NaN: canonical, as CUDA */
    if (ax >= 0x477ff000u) return sign | 0x7c00u;     /* >= 65520 rounds to infinity */
    if (ax >= 0x38800000u) {                          /* normal */
        uint32_t m = ax + 0xfffu + ((ax >> 13) & 1u);
        return sign | (uint16_t)((m - 0x38000000u) >> 13);
    }
    if (ax <= 0x33000000u) return sign;               /* <= 2^-25 rounds to zero */
    uint32_t e = ax >> 23, mant = (ax & 0x7fffffu) | 0x800000u, shift = 126 - e;
    uint32_t q = mant >> shift, rem = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1u))) q++;
    return sign | (uint16_t)q;
}

static inline float simt_h2f(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0x1f) return simt_bits2f(sign | 0x7f800000u | (m << 13));
    if (e == 0) { float v = (float)m * 5.9604644775390625e-08f; return sign ? -v : v; }
    return simt_bits2f(sign | ((e + 112u) << 23) | (m << 13));
}

static inline uint16_t simt_f2bf(float f) {
    uint32_t u = simt_f2bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
static inline float simt_bf2f(uint16_t b) { return simt_bits2f((uint32_t)b << 16); }

struct __half {
    uint16_t __x;
    __half() = default;
    __half(float f) : __x(simt_f2h(f)) {}
    __half(double f) : __x(simt_f2h((float)f)) {}
    __half(int i) : __x(simt_f2h((float)i)) {}
    operator float() const { return simt_h2f(__x); }
};
struct __nv_bfloat16 {
    uint16_t __x;
    __nv_bfloat16() = default;
    __nv_bfloat16(float f) : __x(simt_f2bf(f)) {}
    __nv_bfloat16(double f) : __x(simt_f2bf((float)f)) {}
    __nv_bfloat16(int i) : __x(simt_f2bf((float)i)) {}
    operator float() const { return simt_bf2f(__x); }
};
typedef __half half;
typedef __nv_bfloat16 nv_bfloat16;
struct __align__(4) __half2 { __half x, y; };
struct __align__(4) __nv_bfloat162 { __nv_bfloat16 x, y; };
typedef __half2 half2;
typedef __nv_bfloat162 nv_bfloat162;

/* sums and products of two 16-bit values are exact in float, so one rounding matches the
 * GPU's native half/bfloat16 arithmetic bit for bit */
#define SIMT_H_OPS(H)                                                                          \
    static inline H operator+(H a, H b) { return H((float)a + (float)b); }                     \
    static inline H operator-(H a, H b) { return H((float)a - (float)b); }                     \
    static inline H operator*(H a, H b) { return H((float)a * (float)b); }                     \
    static inline H operator/(H a, H b) { return H((float)a / (float)b); }                     \
    static inline H operator-(H a) { H r; r.__x = (uint16_t)(a.__x ^ 0x8000u); return r; }     \
    static inline H& operator+=(H& a, H b) { a = a + b; return a; }                            \
    static inline H& operator-=(H& a, H b) { a = a - b; return a; }                            \
    static inline H& operator*=(H& a, H b) { a = a * b; return a; }                            \
    static inline bool operator==(H a, H b) { return (float)a == (float)b; }                   \
    static inline bool operator!=(H a, H b) { return (float)a != (float)b; }                   \
    static inline bool operator<(H a, H b) { return (float)a < (float)b; }                     \
    static inline bool operator>(H a, H b) { return (float)a > (float)b; }                     \
    static inline bool operator<=(H a, H b) { return (float)a <= (float)b; }                   \
    static inline bool operator>=(H a, H b) { return (float)a >= (float)b; }
SIMT_H_OPS(__half)
SIMT_H_OPS(__nv_bfloat16)

static inline float __half2float(__half h) { return simt_h2f(h.__x); }
static inline __half __float2half(float f) { return __half(f); }
static inline __half __float2half_rn(float f) { return __half(f); }
static inline __half __int2half_rn(int i) { return __half((float)i); }
static inline __half __hadd(__half a, __half b) { return a + b; }
static inline __half __hsub(__half a, __half b) { return a - b; }
static inline __half __hmul(__half a, __half b) { return a * b; }
static inline __half __hfma(__half a, __half b, __half c) { return __half((float)((double)(float)a * (double)(float)b + (double)(float)c)); }
static inline float __low2float(__half2 h) { return (float)h.x; }
static inline float __high2float(__half2 h) { return (float)h.y; }
static inline __half __low2half(__half2 h) { return h.x; }
static inline __half __high2half(__half2 h) { return h.y; }
static inline __half2 __halves2half2(__half a, __half b) { __half2 r; r.x = a; r.y = b; return r; }
static inline __half2 __floats2half2_rn(float a, float b) { __half2 r; r.x = __half(a); r.y = __half(b); return r; }
static inline __half2 __float22half2_rn(float2 f) { return __floats2half2_rn(f.x, f.y); }
static inline __half2 __float2half2_rn(float a) { return __floats2half2_rn(a, a); }
static inline float2 __half22float2(__half2 h) { return make_float2((float)h.x, (float)h.y); }
static inline __half2 __hadd2(__half2 a, __half2 b) { return __halves2half2(a.x + b.x, a.y + b.y); }
static inline __half2 __hmul2(__half2 a, __half2 b) { return __halves2half2(a.x * b.x, a.y * b.y); }
static inline __half2 __hfma2(__half2 a, __half2 b, __half2 c) { return __halves2half2(__hfma(a.x, b.x, c.x), __hfma(a.y, b.y, c.y)); }

static inline float __bfloat162float(__nv_bfloat16 h) { return simt_bf2f(h.__x); }
static inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }
static inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
static inline float __low2float(__nv_bfloat162 h) { return (float)h.x; }
static inline float __high2float(__nv_bfloat162 h) { return (float)h.y; }
static inline __nv_bfloat162 __halves2bfloat162(__nv_bfloat16 a, __nv_bfloat16 b) { __nv_bfloat162 r; r.x = a; r.y = b; return r; }
static inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { __nv_bfloat162 r; r.x = __nv_bfloat16(a); r.y = __nv_bfloat16(b); return r; }
static inline __nv_bfloat162 __float22bfloat162_rn(float2 f) { return __floats2bfloat162_rn(f.x, f.y); }
static inline float2 __bfloat1622float2(__nv_bfloat162 h) { return make_float2((float)h.x, (float)h.y); }

/* ------------------------------------------------------------------ math */
#define SIMT_MINMAX(T)                                                  \
    static inline T min(T a, T b) { return b < a ? b : a; }            \
    static inline T max(T a, T b) { return a < b ? b : a; }
SIMT_MINMAX(int)
SIMT_MINMAX(unsigned)
SIMT_MINMAX(long long)
SIMT_MINMAX(unsigned long long)
static inline float min(float a, float b) { return fminf(a, b); }
static inline float max(float a, float b) { return fmaxf(a, b); }
static inline double min(double a, double b) { return fmin(a, b); }
static inline double max(double a, double b) { return fmax(a, b); }
static inline unsigned min(int a, unsigned b) { return min((unsigned)a, b); }
static inline unsigned min(unsigned a, int b) { return min(a, (unsigned)b); }
static inline unsigned max(int a, unsigned b) { return max((unsigned)a, b); }
static inline unsigned max(unsigned a, int b) { return max(a, (unsigned)b); }
static inline long long min(long long a, int b) { return min(a, (long long)b); }
static inline long long min(int a, long long b) { return min((long long)a, b); }
static inline long long max(long long a, int b) { return max(a, (long long)b); }
static inline long long max(int a, long long b) { return max((long long)a, b); }
static inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fmul_rn(float a, float b) { return a * b; }

/* ------------------------------------------------------------------ bit counting (bitmap formats) */
static inline int __popc(unsigned v) { return __builtin_popcount(v); }
static inline int __ffs(int v) { return __builtin_ffs(v); }     /* 1 + index of the lowest set bit, 0 for 0 */

/* ------------------------------------------------------------------ atomics (really atomic) */
static inline float simt_atomic_addf(float* a, float v) {
    uint32_t old = __atomic_load_n((uint32_t*)a, __ATOMIC_RELAXED), nw;
    do { nw = simt_f2bits(simt_bits2f(old) + v); }
    while (!__atomic_compare_exchange_n((uint32_t*)a, &old, nw, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
    return simt_bits2f(old);
}
static inline float atomicAdd(float* a, float v) { return simt_atomic_addf(a, v); }
static inline double atomicAdd(double* a, double v) {
    uint64_t old = __atomic_load_n((uint64_t*)a, __ATOMIC_RELAXED), nw; double d;
    do { memcpy(&d, &old, 8); d += v; memcpy(&nw, &d, 8); }
    while (!__atomic_compare_exchange_n((uint64_t*)a, &old, nw, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
    memcpy(&d, &old, 8); return d;
}
static inline int atomicAdd(int* a, int v) { return __atomic_fetch_add(a, v, __ATOMIC_RELAXED); }
static inline unsigned atomicAdd(unsigned* a, unsigned v) { return __atomic_fetch_add(a, v, __ATOMIC_RELAXED); }
static inline unsigned long long atomicAdd(unsigned long long* a, unsigned long long v) { return __atomic_fetch_add(a, v, __ATOMIC_RELAXED); }
#define SIMT_ATOMIC16(H)                                                                        \
    static inline H atomicAdd(H* a, H v) {                                                      \
        uint16_t old = __atomic_load_n(&a->__x, __ATOMIC_RELAXED), nw;                          \
        do { H o; o.__x = old; nw = (o + v).__x; }                                              \
        while (!__atomic_compare_exchange_n(&a->__x, &old, nw, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)); \
        H r; r.__x = old; return r;                                                             \
    }
SIMT_ATOMIC16(__half)
SIMT_ATOMIC16(__nv_bfloat16)

/* ------------------------------------------------------------------ guarded memory */
#include "guard.h"

template <bool B, class R = int> struct simt_enable_if {};
template <class R> struct simt_enable_if<true, R> { typedef R type; };
template <class A, class B> struct simt_conv { enum { v = 0 }; };
template <class A> struct simt_conv<A, A> { enum { v = 1 }; };
template <class A> struct simt_conv<A, const A> { enum { v = 1 }; };
template <class T> struct simt_rc { typedef T t; };
template <class T> struct simt_rc<const T> { typedef T t; };

template <class T> static inline T __ldg(const T* p) { return *p; }

/* the region (parameter array or shared-memory array) that holds address a, if any */
static void simt_region(const void* a, const char** lo, const char** hi, int* id) {
    SimtWorker* w = simt_w;
    const char* c = (const char*)a;
    *lo = 0; *hi = 0; *id = -1;
    if (!w || !c) return;
    const SimtLaunch* L = w->L;
    for (int i = 0; i < L->nargs; ++i) {
        const char* b = (const char*)L->ptr[i];
        if (b && c >= b && c <= b + L->nbytes[i]) { *lo = b; *hi = b + L->nbytes[i]; *id = i; return; }
    }
    if (w->arena && c >= w->arena && c < w->arena + w->arena_cap) {
        if (c < w->arena + w->dyn) { *lo = w->arena; *hi = w->arena + w->dyn; *id = 64; return; }
        for (int s = 0; s < SIMT_MAX_SHARED; ++s) {
            if (w->st_off[s] < 0) continue;
            const char* b = w->arena + w->st_off[s];
            if (c >= b && c <= b + w->st_len[s]) { *lo = b; *hi = b + w->st_len[s]; *id = 65 + s; return; }
        }
    }
}

template <class T> struct GPtr {
    typedef T elem;
    T* p; const char* lo; const char* hi; int id;
    GPtr() : p(0), lo(0), hi(0), id(-1) {}
    GPtr(T* q, const char* l, const char* h, int i) : p(q), lo(l), hi(h), id(i) {}
    GPtr(decltype(nullptr)) : p(0), lo(0), hi(0), id(-1) {}
    GPtr(T* q) : p(q) { simt_region((const void*)q, &lo, &hi, &id); }
    template <class U> explicit GPtr(U* q, typename simt_enable_if<!simt_conv<U, T>::v>::type = 0) : p((T*)q) {
        simt_region((const void*)q, &lo, &hi, &id);
    }
    template <class U> GPtr(const GPtr<U>& o, typename simt_enable_if<simt_conv<U, T>::v>::type = 0)
        : p(o.p), lo(o.lo), hi(o.hi), id(o.id) {}
    template <class U> explicit GPtr(const GPtr<U>& o, typename simt_enable_if<!simt_conv<U, T>::v>::type = 0)
        : p((T*)o.p), lo(o.lo), hi(o.hi), id(o.id) {}
    inline void chk(const T* a) const {
        if (lo) {
            const char* c = (const char*)a;
            if (__builtin_expect(c < lo || c + sizeof(T) > hi || (size_t)(c - lo) % alignof(T), 0)) {
                long long off = (long long)(c - lo);
                simt_fault_oob(id, off >= 0 ? off / (long long)sizeof(T) : -((-off + (long long)sizeof(T) - 1) / (long long)sizeof(T)),
                               (long long)(hi - lo) / (long long)sizeof(T),
                               c >= lo && c + sizeof(T) <= hi, (long long)alignof(T));
            }
        }
    }
    template <class I> typename simt_gref<T>::t operator[](I i) const { T* a = p + i; chk(a); return simt_gref<T>::make(a, id); }
    typename simt_gref<T>::t operator*() const { chk(p); return simt_gref<T>::make(p, id); }
    T* operator->() const { chk(p); return p; }
    template <class I> GPtr operator+(I i) const { return GPtr(p + i, lo, hi, id); }
    template <class I> GPtr operator-(I i) const { return GPtr(p - i, lo, hi, id); }
    long long operator-(const GPtr& o) const { return (long long)(p - o.p); }
    template <class I> GPtr& operator+=(I i) { p += i; return *this; }
    template <class I> GPtr& operator-=(I i) { p -= i; return *this; }
    GPtr& operator++() { ++p; return *this; }
    GPtr& operator--() { --p; return *this; }
    GPtr operator++(int) { GPtr r = *this; ++p; return r; }
    GPtr operator--(int) { GPtr r = *this; --p; return r; }
    bool operator==(const GPtr& o) const { return p == o.p; }
    bool operator!=(const GPtr& o) const { return p != o.p; }
    bool operator<(const GPtr& o) const { return p < o.p; }
    bool operator>(const GPtr& o) const { return p > o.p; }
    bool operator<=(const GPtr& o) const { return p <= o.p; }
    bool operator>=(const GPtr& o) const { return p >= o.p; }
    explicit operator bool() const { return p != 0; }
};
template <class I, class T> static inline GPtr<T> operator+(I i, const GPtr<T>& q) { return q + i; }
template <class T> static inline typename simt_rc<T>::t __ldg(const GPtr<T>& q) { return *q; }
template <class To, class U> static inline To simt_cast(const GPtr<U>& f) {
    return To((typename To::elem*)f.p, f.lo, f.hi, f.id);
}
template <class To, class U> static inline To simt_cast(U* raw) { return simt_cast<To>(GPtr<U>(raw)); }
template <class T, class V> static inline T atomicAdd(const GPtr<T>& q, V v) { q.chk(q.p); return atomicAdd(q.p, (T)v); }

/* local arrays, bounds-checked */
template <class T, long long N, int ID> struct LArr {
    T v[N];
    template <class I> T& operator[](I i) {
        if (__builtin_expect((unsigned long long)(long long)i >= (unsigned long long)N, 0)) simt_fault_oob(ID, (long long)i, N, 0, 0);
        return v[i];
    }
    template <class I> const T& operator[](I i) const {
        if (__builtin_expect((unsigned long long)(long long)i >= (unsigned long long)N, 0)) simt_fault_oob(ID, (long long)i, N, 0, 0);
        return v[i];
    }
    operator T*() { return v; }
};

/* ------------------------------------------------------------------ shared memory */
static void* simt_static_shared_raw(int id, long long bytes, long long align) {
    SimtWorker* w = simt_w;
    if (w->st_off[id] >= 0) return w->arena + w->st_off[id];
    if (align < 16) align = 16;
    long long off = (w->dyn + w->static_top + align - 1) / align * align;
    if (off + bytes > w->arena_cap || off - w->dyn + bytes + w->dyn > SIMT_SMEM_LIMIT) {
        SimtFaultRec* f = simt_claim(w, SIMT_F_SMEM);
        f->array = 65 + id; f->extent = bytes;
        simt_msg(f, "static shared memory (%lld bytes so far + %lld) plus %lld dynamic bytes exceeds the %d bytes a block may have",
                 w->static_top, bytes, w->dyn, SIMT_SMEM_LIMIT);
        simt_escape(w);
    }
    w->static_top = off - w->dyn + bytes;
    w->st_off[id] = off; w->st_len[id] = bytes;
    if (SIMT_GUARDED) memset(w->arena + off, 0xff, (size_t)bytes);   /* poison: NaN / -1 */
    return w->arena + off;
}
static void* simt_dynamic_shared_raw(void) { return simt_w->arena; }

#define SIMT_FAULT_RACE_KINDS "write-write", "read-after-write", "write-after-read"
__attribute__((noinline, noreturn)) static void simt_race_fault(const void* a, int kind, int other) {
    SimtWorker* w = simt_w;
    static const char* names[] = {SIMT_FAULT_RACE_KINDS};
    const char *lo, *hi; int id;
    simt_region(a, &lo, &hi, &id);
    SimtFaultRec* f = simt_claim(w, SIMT_F_RACE);
    f->array = id; f->index = lo ? (long long)((const char*)a - lo) : -1; f->extent = lo ? (long long)(hi - lo) : -1;
    f->other_thread = other;
    simt_msg(f, "%s race on shared memory byte offset %lld: thread %d and thread %d access it with no __syncthreads/__syncwarp between",
             names[kind], f->index, other, w->cur->linear);
    simt_escape(w);
}

static inline bool simt_ordered(SimtWorker* w, int other, unsigned other_wep, int me) {
    return (other >> 5) == (me >> 5) && other_wep < w->wep[me >> 5];
}

__attribute__((noinline)) static void simt_race(const void* a, size_t sz, int write) {
    SimtWorker* w = simt_w;
    if (!w->shadow) return;
    long long off = (const char*)a - w->arena;
    if (off < 0 || off >= w->arena_cap) return;
    int me = w->cur->linear;
    unsigned ep = w->epoch, mywep = w->wep[me >> 5];
    for (long long u = off / 2; u < (off + (long long)sz + 1) / 2; ++u) {
        SimtShadow* s = &w->shadow[u];
        if (s->wep == ep && s->writer != me && !simt_ordered(w, s->writer, s->wwep, me))
            simt_race_fault(a, write ? 0 : 1, s->writer);
        if (write) {
            if (s->rep == ep) {
                if (s->r1 >= 0 && s->r1 != me && !simt_ordered(w, s->r1, s->r1w, me)) simt_race_fault(a, 2, s->r1);
                if (s->r2 >= 0 && s->r2 != me && !simt_ordered(w, s->r2, s->r2w, me)) simt_race_fault(a, 2, s->r2);
            }
            s->wep = ep; s->writer = me; s->wwep = mywep;
        } else {
            if (s->rep != ep) { s->rep = ep; s->r1 = me; s->r1w = mywep; s->r2 = -1; }
            else if (s->r1 == me) s->r1w = mywep;
            else { s->r2 = me; s->r2w = mywep; }
        }
    }
}

/* a reference to one scalar element of a guarded shared array: reads and writes are
 * race-checked; vector element types (float4 ...) are handed out as plain references */
template <class T> struct SRef {
    T* a;
    operator T() const { simt_race(a, sizeof(T), 0); return *a; }
    SRef& operator=(T v) { simt_race(a, sizeof(T), 1); *a = v; return *this; }
    SRef& operator=(const SRef& o) { T v = (T)o; return *this = v; }
    SRef& operator+=(T v) { T c = (T)*this; return *this = (T)(c + v); }
    SRef& operator-=(T v) { T c = (T)*this; return *this = (T)(c - v); }
    SRef& operator*=(T v) { T c = (T)*this; return *this = (T)(c * v); }
    SRef& operator/=(T v) { T c = (T)*this; return *this = (T)(c / v); }
    SRef& operator++() { T c = (T)*this; return *this = (T)(c + 1); }
    SRef& operator--() { T c = (T)*this; return *this = (T)(c - 1); }
    T operator++(int) { T c = (T)*this; *this = (T)(c + 1); return c; }
    T operator--(int) { T c = (T)*this; *this = (T)(c - 1); return c; }
    T* operator&() const { return a; }
};
template <class T> struct simt_sref { typedef SRef<T> t; static t make(T* a) { t r; r.a = a; return r; } };
#define SIMT_PLAIN_REF(V) template <> struct simt_sref<V> { typedef V& t; static t make(V* a) { return *a; } };
SIMT_PLAIN_REF(int2) SIMT_PLAIN_REF(int4) SIMT_PLAIN_REF(float2) SIMT_PLAIN_REF(float4)
SIMT_PLAIN_REF(double2) SIMT_PLAIN_REF(__half2) SIMT_PLAIN_REF(__nv_bfloat162)

template <class T> struct SArr {
    T* p; long long n; int id;
    template <class I> typename simt_sref<T>::t operator[](I i) const {
        if (__builtin_expect((unsigned long long)(long long)i >= (unsigned long long)n, 0)) simt_fault_oob(id, (long long)i, n, 0, 0);
        return simt_sref<T>::make(p + i);
    }
    operator GPtr<T>() const { return GPtr<T>(p, (const char*)p, (const char*)(p + n), id); }
    operator GPtr<const T>() const { return GPtr<const T>(p, (const char*)p, (const char*)(p + n), id); }
    template <class I> GPtr<T> operator+(I i) const { return GPtr<T>(*this) + i; }
};
template <class T> static inline SArr<T> simt_static_shared(int id, long long count) {
    SArr<T> s; s.p = (T*)simt_static_shared_raw(id, count * (long long)sizeof(T), (long long)alignof(T));
    s.n = count; s.id = 65 + id; return s;
}
template <class T> static inline SArr<T> simt_dynamic_shared(void) {
    SArr<T> s; s.p = (T*)simt_w->arena; s.n = simt_w->dyn / (long long)sizeof(T); s.id = 64; return s;
}
/* reinterpret_cast of a shared array itself (not of a pointer into it) */
template <class To, class U> static inline To simt_cast(const SArr<U>& s) { return simt_cast<To>((GPtr<U>)s); }

/* ------------------------------------------------------------------ barriers and warps */
static void simt_release_barrier(SimtWorker* w) {
    for (int i = 0; i < w->nth; ++i) if (w->th[i].state == T_BAR) w->th[i].state = T_READY;
    w->bar_arrived = 0; w->bar_line = 0; w->epoch++;
}

static void simt_syncthreads(int line) {
    SimtWorker* w = simt_w;
    SimtThread* t = w->cur;
    if (!w->fibers) return;   /* plain mode is chosen only for kernels without barriers */
    if (w->bar_arrived > 0 && w->bar_line != line) {
        SimtFaultRec* f = simt_claim(w, SIMT_F_BARRIER);
        f->line = line;
        int other = -1;
        for (int i = 0; i < w->nth; ++i) if (w->th[i].state == T_BAR) { other = i; break; }
        f->other_thread = other;
        simt_msg(f, "threads wait at different __syncthreads(): thread %d at line %d, thread %d at line %d",
                 other, w->bar_line, t->linear, line);
        simt_escape(w);
    }
    w->bar_line = line;
    if (++w->bar_arrived == w->nth) { simt_release_barrier(w); return; }
    t->state = T_BAR; t->bline = line;
    simt_to_sched(w);
}
#define __syncthreads() simt_syncthreads(__LINE__)

static const char* simt_wname(int kind) {
    switch (kind) {
        case W_SHFL: return "__shfl_sync"; case W_UP: return "__shfl_up_sync";
        case W_DOWN: return "__shfl_down_sync"; case W_XOR: return "__shfl_xor_sync";
        default: return "__syncwarp";
    }
}

__attribute__((noinline, noreturn)) static void simt_warp_fault(SimtWorker* w, int line, unsigned mask, int other, const char* fmt, ...) {
    SimtFaultRec* f = simt_claim(w, SIMT_F_WARP);
    f->line = line; f->mask = mask; f->other_thread = other;
    va_list ap; va_start(ap, fmt); vsnprintf(f->msg, sizeof f->msg, fmt, ap); va_end(ap);
    simt_escape(w);
}

static uint64_t simt_warp(int kind, unsigned mask, uint64_t val, int arg, int width, int line) {
    SimtWorker* w = simt_w;
    SimtThread* t = w->cur;
    int lane = t->linear & 31, base = t->linear - lane;
    if (!w->fibers) return val;
    if (!((mask >> lane) & 1u))
        simt_warp_fault(w, line, mask, -1, "%s at line %d: lane %d calls it with mask 0x%08x, which does not include the lane itself",
                        simt_wname(kind), line, lane, mask);
    if (kind != W_SYNC && (width < 1 || width > 32 || (width & (width - 1))))
        simt_warp_fault(w, line, mask, -1, "%s at line %d: width %d is not a power of two in [1, 32]", simt_wname(kind), line, width);
    t->wkind = kind; t->wmask = mask; t->wval = val; t->warg = arg; t->wwidth = width; t->wline = line;
    t->state = T_WARP;
    bool all = true;
    for (int k = 0; k < 32; ++k) {
        if (!((mask >> k) & 1u) || k == lane) continue;
        if (base + k >= w->nth) simt_warp_fault(w, line, mask, base + k, "%s at line %d: mask 0x%08x names lane %d, which does not exist in this block",
                                                simt_wname(kind), line, mask, k);
        SimtThread* u = &w->th[base + k];
        if (u->state == T_WARP) {
            if (u->wmask != mask)
                simt_warp_fault(w, line, mask, u->linear, "lanes disagree on the mask: lane %d calls %s with 0x%08x (line %d), lane %d calls %s with 0x%08x (line %d)",
                                k, simt_wname(u->wkind), u->wmask, u->wline, lane, simt_wname(kind), mask, line);
            if (u->wkind != kind)
                simt_warp_fault(w, line, mask, u->linear, "lanes of mask 0x%08x reach different warp operations: lane %d %s (line %d), lane %d %s (line %d)",
                                mask, k, simt_wname(u->wkind), u->wline, lane, simt_wname(kind), line);
        } else if (u->state == T_DONE) {
            simt_warp_fault(w, line, mask, u->linear, "%s at line %d: mask 0x%08x names lane %d, which has already exited",
                            simt_wname(kind), line, mask, k);
        } else {
            all = false;
        }
    }
    if (!all) { simt_to_sched(w); return t->wres; }
    /* every lane of the mask is here: exchange */
    for (int k = 0; k < 32; ++k) {
        if (!((mask >> k) & 1u)) continue;
        SimtThread* u = &w->th[base + k];
        int src = k, wd = u->wwidth, seg = k & ~(wd - 1), d = u->warg;
        switch (kind) {
            case W_SHFL: src = seg + (d & (wd - 1)); break;
            case W_UP: src = ((k - seg) >= d) ? k - d : k; break;
            case W_DOWN: src = ((k - seg) + d < wd) ? k + d : k; break;
            case W_XOR: src = k ^ d; if (src >= seg + wd || src < 0 || src > 31) src = k; break;
            default: break;
        }
        if (kind != W_SYNC && !((mask >> src) & 1u))
            simt_warp_fault(w, line, mask, base + src, "%s at line %d: lane %d reads lane %d, which is not in mask 0x%08x (its value is undefined on the GPU)",
                            simt_wname(kind), line, k, src, mask);
        u->wres = w->th[base + src].wval;
    }
    for (int k = 0; k < 32; ++k)
        if ((mask >> k) & 1u) w->th[base + k].state = T_READY;
    w->wep[t->linear >> 5] = ++w->wclock;
    return t->wres;
}

template <class T> static inline uint64_t simt_pack(T v) { uint64_t u = 0; memcpy(&u, &v, sizeof(T)); return u; }
template <class T> static inline T simt_unpack(uint64_t u) { T v; memcpy(&v, &u, sizeof(T)); return v; }
#define SIMT_SHFL_T(T)                                                                                    \
    static inline T simt_shfl(int line, unsigned m, T v, int s, int wd = 32) { return simt_unpack<T>(simt_warp(W_SHFL, m, simt_pack(v), s, wd, line)); } \
    static inline T simt_shfl_up(int line, unsigned m, T v, unsigned d, int wd = 32) { return simt_unpack<T>(simt_warp(W_UP, m, simt_pack(v), (int)d, wd, line)); } \
    static inline T simt_shfl_down(int line, unsigned m, T v, unsigned d, int wd = 32) { return simt_unpack<T>(simt_warp(W_DOWN, m, simt_pack(v), (int)d, wd, line)); } \
    static inline T simt_shfl_xor(int line, unsigned m, T v, int d, int wd = 32) { return simt_unpack<T>(simt_warp(W_XOR, m, simt_pack(v), d, wd, line)); }
SIMT_SHFL_T(int) SIMT_SHFL_T(unsigned) SIMT_SHFL_T(long long) SIMT_SHFL_T(unsigned long long)
SIMT_SHFL_T(float) SIMT_SHFL_T(double) SIMT_SHFL_T(__half) SIMT_SHFL_T(__nv_bfloat16)
SIMT_SHFL_T(__half2) SIMT_SHFL_T(__nv_bfloat162)
#define __shfl_sync(...) simt_shfl(__LINE__, __VA_ARGS__)
#define __shfl_up_sync(...) simt_shfl_up(__LINE__, __VA_ARGS__)
#define __shfl_down_sync(...) simt_shfl_down(__LINE__, __VA_ARGS__)
#define __shfl_xor_sync(...) simt_shfl_xor(__LINE__, __VA_ARGS__)
static inline void simt_syncwarp(int line, unsigned mask = 0xffffffffu) { simt_warp(W_SYNC, mask, 0, 0, 32, line); }
#define __syncwarp(...) simt_syncwarp(__LINE__, ##__VA_ARGS__)

/* ------------------------------------------------------------------ wmma (tensor cores), emulated
 * Every lane holds a whole fragment (its tile in row-major order, as float) and computes the
 * whole product, so all lanes hold the same result; the GPU spreads a fragment over the lanes
 * in an order the kernel language never exposes (it has no fragment element access).
 * load_matrix_sync, store_matrix_sync and mma_sync are warp-collective: each includes a
 * __syncwarp of the full warp, so a lane that skips one shows as a WarpMaskError. That sync
 * orders nothing a kernel must order itself: a load syncs after its reads (a load before the
 * __syncwarp that publishes other lanes' writes reads stale data, as it may on the GPU), a
 * store before its writes (a read of the stored tile needs a __syncwarp after the store). A
 * store writes element e from lane e % 32. Pointers must be 32-byte aligned and ldm a multiple of
 * 16 bytes, as on the GPU (else MisalignedAccess). mma_sync adds the products in float in k
 * order after the accumulator's value; the tensor cores' internal rounding may differ, which
 * verification's error bound allows for. */
namespace nvcuda { namespace wmma {
struct matrix_a {}; struct matrix_b {}; struct accumulator {};
struct row_major {}; struct col_major {};
enum layout_t { mem_row_major, mem_col_major };
template <class Use, int M, int N, int K> struct simt_shape;
template <int M, int N, int K> struct simt_shape<matrix_a, M, N, K> { enum { R = M, C = K }; };
template <int M, int N, int K> struct simt_shape<matrix_b, M, N, K> { enum { R = K, C = N }; };
template <int M, int N, int K> struct simt_shape<accumulator, M, N, K> { enum { R = M, C = N }; };
template <class Use, int M, int N, int K, class T, class Layout = void> struct fragment {
    enum { R = simt_shape<Use, M, N, K>::R, C = simt_shape<Use, M, N, K>::C };
    float v[R * C];
};
template <class L> struct simt_colmajor { enum { v = 0 }; };
template <> struct simt_colmajor<col_major> { enum { v = 1 }; };

template <class T> static inline const void* simt_raw(const GPtr<T>& p) { return (const void*)p.p; }
template <class T> static inline const void* simt_raw(const SArr<T>& p) { return (const void*)p.p; }
template <class T> static inline const void* simt_raw(T* p) { return (const void*)p; }

template <class T, class P> static void simt_wmma_check(const P& p, unsigned ldm, const char* what, int line) {
    uintptr_t a = (uintptr_t)simt_raw(p);
    if (a % 32 == 0 && (ldm * sizeof(T)) % 16 == 0) return;
    SimtWorker* w = simt_w;
    SimtFaultRec* f = simt_claim(w, SIMT_F_MISALIGNED);
    f->line = line;
    simt_msg(f, "nvcuda::wmma::%s at line %d: the pointer must be 32-byte aligned (it is %u bytes past) and "
             "ldm (%u) a multiple of %u elements", what, line, (unsigned)(a % 32), ldm, (unsigned)(16 / sizeof(T)));
    simt_escape(w);
}

template <class Use, int M, int N, int K, class T, class L, class V>
static inline void fill_fragment(fragment<Use, M, N, K, T, L>& f, V value) {
    float x = (float)(T)value;
    for (int i = 0; i < fragment<Use, M, N, K, T, L>::R * fragment<Use, M, N, K, T, L>::C; ++i) f.v[i] = x;
}

template <class Use, int M, int N, int K, class T, class L, class P>
static inline void simt_load(fragment<Use, M, N, K, T, L>& f, const P& p, unsigned ldm, bool col, int line) {
    enum { R = fragment<Use, M, N, K, T, L>::R, C = fragment<Use, M, N, K, T, L>::C };
    simt_wmma_check<T>(p, ldm, "load_matrix_sync", line);
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) {
            T x = p[col ? (long long)c * ldm + r : (long long)r * ldm + c];
            f.v[r * C + c] = (float)x;
        }
    simt_syncwarp(line);  /* after the reads: a kernel that loads before its lanes' writes are synced reads stale data */
}
template <int M, int N, int K, class T, class L, class P>
static inline void load_matrix_sync(fragment<matrix_a, M, N, K, T, L>& f, const P& p, unsigned ldm, int line = __builtin_LINE()) {
    simt_load(f, p, ldm, simt_colmajor<L>::v, line);
}
template <int M, int N, int K, class T, class L, class P>
static inline void load_matrix_sync(fragment<matrix_b, M, N, K, T, L>& f, const P& p, unsigned ldm, int line = __builtin_LINE()) {
    simt_load(f, p, ldm, simt_colmajor<L>::v, line);
}
template <int M, int N, int K, class T, class P>
static inline void load_matrix_sync(fragment<accumulator, M, N, K, T>& f, const P& p, unsigned ldm, layout_t layout,
                                    int line = __builtin_LINE()) {
    simt_load(f, p, ldm, layout == mem_col_major, line);
}

template <int M, int N, int K, class T, class P>
static inline void store_matrix_sync(const P& p, const fragment<accumulator, M, N, K, T>& f, unsigned ldm, layout_t layout,
                                     int line = __builtin_LINE()) {
    simt_syncwarp(line);
    simt_wmma_check<T>(p, ldm, "store_matrix_sync", line);
    for (int e = simt_w->cur->linear & 31; e < M * N; e += 32) {
        int r = e / N, c = e % N;
        p[layout == mem_col_major ? (long long)c * ldm + r : (long long)r * ldm + c] = (T)f.v[e];
    }
}

template <int M, int N, int K, class TA, class LA, class TB, class LB, class TC>
static inline void mma_sync(fragment<accumulator, M, N, K, TC>& d, const fragment<matrix_a, M, N, K, TA, LA>& a,
                            const fragment<matrix_b, M, N, K, TB, LB>& b, const fragment<accumulator, M, N, K, TC>& c,
                            int line = __builtin_LINE()) {
    simt_syncwarp(line);
    float out[M * N];
    for (int i = 0; i < M; ++i)
        for (int j = 0; j < N; ++j) {
            float s = c.v[i * N + j];
            for (int k = 0; k < K; ++k) s += a.v[i * K + k] * b.v[k * N + j];
            out[i * N + j] = (float)(TC)s;
        }
    memcpy(d.v, out, sizeof out);
}
} }  /* namespace nvcuda::wmma */

/* ------------------------------------------------------------------ the scheduler */
static void simt_fiber_main(void) {
    SimtWorker* w = simt_w;
    simt_entry(w->L);
    SimtThread* t = w->cur;
    t->state = T_DONE; w->n_done++;
    if (w->steps > w->max_steps) w->max_steps = w->steps;
    simt_to_sched(w);
    __builtin_trap();   /* a finished fiber is never resumed */
}

static int simt_range(char* out, size_t n, const SimtWorker* w, int state, int line) {
    /* "a-b, c, ..." of threads in a state (optionally at a barrier line) */
    int count = 0; size_t len = 0; out[0] = 0;
    for (int i = 0; i < w->nth; ++i) {
        const SimtThread* t = &w->th[i];
        bool in = t->state == state && (line < 0 || t->bline == line);
        if (!in) continue;
        int j = i;
        while (j + 1 < w->nth && w->th[j + 1].state == state && (line < 0 || w->th[j + 1].bline == line)) ++j;
        count += j - i + 1;
        if (len + 24 < n) len += (size_t)(j > i ? snprintf(out + len, n - len, "%s%d-%d", len ? "," : "", i, j)
                                                 : snprintf(out + len, n - len, "%s%d", len ? "," : "", i));
        i = j;
    }
    return count;
}

/* no thread of the block can move: say why */
static void simt_deadlock(SimtWorker* w) {
    char a[160], b[160];
    for (int i = 0; i < w->nth; ++i) {
        SimtThread* t = &w->th[i];
        if (t->state != T_WARP) continue;
        int base = i & ~31;
        for (int k = 0; k < 32; ++k) {
            if (!((t->wmask >> k) & 1u) || base + k >= w->nth) continue;
            SimtThread* u = &w->th[base + k];
            if (u->state == T_WARP) continue;
            SimtFaultRec* f = simt_claim(w, SIMT_F_WARP);
            f->thread[0] = t->tid.x; f->thread[1] = t->tid.y; f->thread[2] = t->tid.z;
            f->line = t->wline; f->mask = t->wmask; f->other_thread = u->linear;
            simt_msg(f, "%s at line %d (mask 0x%08x) waits for lane %d (thread %d), which %s",
                     simt_wname(t->wkind), t->wline, t->wmask, k, u->linear,
                     u->state == T_DONE ? "has exited without reaching it" : "waits at __syncthreads() instead");
            return;
        }
    }
    SimtFaultRec* f = simt_claim(w, SIMT_F_BARRIER);
    int waiting = simt_range(a, sizeof a, w, T_BAR, -1);
    int done = simt_range(b, sizeof b, w, T_DONE, -1);
    for (int i = 0; i < w->nth; ++i) if (w->th[i].state == T_BAR) {
        f->thread[0] = w->th[i].tid.x; f->thread[1] = w->th[i].tid.y; f->thread[2] = w->th[i].tid.z;
        f->line = w->th[i].bline; break;
    }
    for (int i = 0; i < w->nth; ++i) if (w->th[i].state != T_BAR) { f->other_thread = i; break; }
    f->index = waiting; f->extent = w->nth;
    simt_msg(f, "__syncthreads() at line %d was reached by %d of %d threads (%s); threads %s (%d) exited without reaching it",
             f->line, waiting, w->nth, a, b, done);
}

static void simt_run_block(SimtWorker* w) {
    SimtLaunch* L = w->L;
    int bx = (int)w->bdim.x, by = (int)w->bdim.y;
    w->epoch++;
    for (int s = 0; s < SIMT_MAX_SHARED; ++s) w->st_off[s] = -1;
    w->static_top = 0;
    if (SIMT_GUARDED && w->dyn) memset(w->arena, 0xff, (size_t)w->dyn);
    if (!w->fibers) {
        SimtThread* t = &w->th[0];
        for (int i = 0; i < w->nth; ++i) {
            t->tid.x = (unsigned)(i % bx); t->tid.y = (unsigned)((i / bx) % by); t->tid.z = (unsigned)(i / (bx * by));
            t->linear = i; t->state = T_READY;
            w->cur = t; w->steps = 0;
            simt_entry(L);
            if (w->steps > w->max_steps) w->max_steps = w->steps;
        }
        return;
    }
    for (int i = 0; i < w->nth; ++i) {
        SimtThread* t = &w->th[i];
        t->tid.x = (unsigned)(i % bx); t->tid.y = (unsigned)((i / bx) % by); t->tid.z = (unsigned)(i / (bx * by));
        t->linear = i; t->state = T_READY; t->steps = 0; t->bline = 0;
        simt_fiber_init(w, t, i);
    }
    w->bar_arrived = 0; w->bar_line = 0; w->n_done = 0;
    for (;;) {
        bool progress = false;
        for (int i = 0; i < w->nth; ++i) {
            SimtThread* t = &w->th[i];
            if (t->state != T_READY) continue;
            simt_to_fiber(w, t);
            if (w->faulted) return;
            progress = true;
        }
        if (w->n_done == w->nth) return;
        if (!progress) { simt_deadlock(w); w->faulted = 1; return; }
        if (w->deadline > 0 && simt_now() > w->deadline) {
            SimtFaultRec* f = simt_claim(w, SIMT_F_TIMEOUT);
            simt_msg(f, "the launch ran past its time limit of %.3g s (a block kept waiting at barriers)", L->time_limit_s);
            w->faulted = 1; return;
        }
        if (__atomic_load_n(&L->abort_flag, __ATOMIC_ACQUIRE)) { w->faulted = 1; return; }
    }
}

struct SimtPool { SimtLaunch* L; long long next; long long nblocks; int nth; };

static void* simt_worker_main(void* arg) {
    SimtPool* P = (SimtPool*)arg;
    SimtLaunch* L = P->L;
    SimtWorker W;
    memset(&W, 0, sizeof W);
    SimtWorker* w = &W;
    simt_w = w;
    w->L = L; w->nth = P->nth; w->fibers = L->fibers; w->step_limit = L->step_limit;
    w->step_cap = L->step_limit > 0 ? L->step_limit : (long long)(~0ull >> 1);
    w->budget = 65536;
    w->bdim = make_uint3(L->block[0], L->block[1], L->block[2]);
    w->gdim = make_uint3(L->grid[0], L->grid[1], L->grid[2]);
    w->deadline = L->time_limit_s > 0 ? simt_now() + L->time_limit_s : 0;
    w->th = (SimtThread*)calloc((size_t)(w->fibers ? w->nth : 1), sizeof(SimtThread));
    w->wep = (unsigned*)calloc((size_t)(w->nth / 32 + 1), sizeof(unsigned));
    w->dyn = (L->smem + 15) / 16 * 16;
    w->arena_cap = w->dyn + SIMT_SMEM_LIMIT + 64;
    w->arena = (char*)aligned_alloc(64, (size_t)((w->arena_cap + 63) / 64 * 64));
    if (L->racecheck && SIMT_GUARDED) w->shadow = (SimtShadow*)calloc((size_t)(w->arena_cap / 2 + 1), sizeof(SimtShadow));
    if (w->fibers) {
        w->stack_sz = 64 * 1024;
        w->stacks_len = w->stack_sz * (size_t)w->nth;
        void* m = mmap(0, w->stacks_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        w->stacks = m == MAP_FAILED ? 0 : (char*)m;
        if (w->stacks) for (int i = 0; i < w->nth; ++i) mprotect(w->stacks + (size_t)i * w->stack_sz, 4096, PROT_NONE);
    }
    if (!w->th || !w->wep || !w->arena || (w->fibers && !w->stacks)) {
        SimtFaultRec* f = simt_claim(w, SIMT_F_INTERNAL);
        simt_msg(f, "out of memory setting up a worker (%d threads per block)", w->nth);
    } else if (setjmp(w->jmp) == 0) {
        for (;;) {
            if (__atomic_load_n(&L->abort_flag, __ATOMIC_ACQUIRE)) break;
            long long b = __atomic_fetch_add(&P->next, 1, __ATOMIC_RELAXED);
            if (b >= P->nblocks) break;
            long long gx = L->grid[0], gy = L->grid[1];
            w->bid = make_uint3((unsigned)(b % gx), (unsigned)((b / gx) % gy), (unsigned)(b / (gx * gy)));
            w->blin = b;
            w->cur = 0;
            simt_run_block(w);
            if (w->faulted) break;
            __atomic_fetch_add(&L->blocks_done, 1, __ATOMIC_RELAXED);
            if (w->deadline > 0 && simt_now() > w->deadline) {
                SimtFaultRec* f = simt_claim(w, SIMT_F_TIMEOUT);
                simt_msg(f, "the launch ran past its time limit of %.3g s after %lld blocks", L->time_limit_s, L->blocks_done);
                break;
            }
        }
    }
    __atomic_fetch_add(&L->switches, w->switches, __ATOMIC_RELAXED);
    long long ms = __atomic_load_n(&L->max_steps, __ATOMIC_RELAXED);
    while (w->max_steps > ms && !__atomic_compare_exchange_n(&L->max_steps, &ms, w->max_steps, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {}
    if (w->stacks) munmap(w->stacks, w->stacks_len);
    free(w->th); free(w->wep); free(w->arena); free(w->shadow);
    simt_w = 0;
    return 0;
}

extern "C" __attribute__((visibility("default"))) int simt_abi_version(void) { return 2; }
extern "C" __attribute__((visibility("default"))) int simt_guarded(void) { return SIMT_GUARDED; }

extern "C" __attribute__((visibility("default"))) int simt_launch(SimtLaunch* L) {
    long long nblocks = (long long)L->grid[0] * L->grid[1] * L->grid[2];
    int nth = (int)(L->block[0] * L->block[1] * L->block[2]);
    L->claimed = 0; L->abort_flag = 0; L->max_steps = 0; L->switches = 0; L->blocks_done = 0;
    memset(&L->fault, 0, sizeof L->fault);
    if (nblocks <= 0 || nth <= 0) return 0;
    int guard = SIMT_GUARDED && L->guard_bytes > 0;
    if (guard && simt_guard_setup(L) != 0) { simt_guard_finish(L); return L->fault.kind; }
    SimtPool P = {L, 0, nblocks, nth};
    int nw = L->workers < 1 ? 1 : L->workers;
    if (nw > nblocks) nw = (int)nblocks;
    if (nw > 64) nw = 64;
    pthread_t tids[64];
    int started = 0;
    for (int i = 1; i < nw; ++i) {
        pthread_attr_t at; pthread_attr_init(&at); pthread_attr_setstacksize(&at, 8u << 20);
        if (pthread_create(&tids[started], &at, simt_worker_main, &P) == 0) ++started;
        pthread_attr_destroy(&at);
    }
    simt_worker_main(&P);
    for (int i = 0; i < started; ++i) pthread_join(tids[i], 0);
    if (guard) simt_guard_finish(L);
    return L->fault.kind;
}
