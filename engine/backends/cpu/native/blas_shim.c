/* markbase's cblas_sgemm shim for MLX's Linux CPU backend (see engine/cpu_blas.py).

   Loaded with RTLD_GLOBAL before the real BLAS, so libmlx.so's cblas_sgemm binds
   here. Three routes for C = alpha * A * op(B) + beta * C:

   1. Quantized weights (engine/cpu_qgemm.py): the float32 weight matrix B has a
      registered MLX affine-quantized copy (4 or 8 bits, groups of 32/64/128, the
      same values the float32 matrix was dequantized from). For small M (decode
      steps) the product reads the 4/8-bit copy instead of the float32 one: 4-8x
      fewer bytes, and decode on a CPU is bound by the bytes read per token.
   2. M == 1 products through cblas_sgemv (OpenBLAS 0.3.21's sgemm packs the whole
      weight matrix on every call; sgemv reads it once).
   3. Everything else: the real cblas_sgemm.
*/
#define _GNU_SOURCE
#include <dlfcn.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define MB_AVX512 1
#ifdef __AVX512VNNI__
#define MB_VNNI 1
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MB_AVX2 1
#endif

#if defined(MB_AVX2) || defined(MB_AVX512)
static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

enum { RowMajor = 101 };
enum { NoTrans = 111, Trans = 112 };
typedef void (*sgemm_t)(int, int, int, int, int, int, float, const float *, int,
                        const float *, int, float, float *, int);
typedef void (*sgemv_t)(int, int, int, int, float, const float *, int,
                        const float *, int, float, float *, int);
typedef void (*setthr_t)(int);
typedef int (*getthr_t)(void);
static sgemm_t real_sgemm;
static sgemv_t real_sgemv;
static setthr_t set_threads; /* openblas_set_num_threads, when the library has it */
/* Threads per kind of call (0: the library's default): M == 1 gemv, sgemm with
   M < small_m (decode batches: OpenBLAS's threads stall there when other processes
   share the cores), and the rest (prefill). */
static int default_threads, cur_threads;
static int gemv_threads, small_gemm_threads = 1, gemm_threads;
static int small_m = 16;
static int use_gemv = 1;
/* Below this many matrix elements a gemv is too small to pay OpenBLAS's thread
   hand-off (its sgemv goes 2-threaded from 9216 elements; sgemm stays 1-threaded
   below M*N*K = 262144): attention's 64 x T products stay on sgemm. */
static long gemv_min_elems = 65536;
static long n_gemv, n_gemm;

int markbase_blas_init(const char *path) {
  /* RTLD_LOCAL: never promote a library into the global scope from here (Python
     loads the fast BLAS with RTLD_GLOBAL itself, after this shim). */
  void *h = path && *path ? dlopen(path, RTLD_NOW | RTLD_LOCAL) : RTLD_NEXT;
  if (!h) return -1;
  real_sgemm = (sgemm_t)dlsym(h, "cblas_sgemm");
  real_sgemv = (sgemv_t)dlsym(h, "cblas_sgemv");
  set_threads = (setthr_t)dlsym(h, "openblas_set_num_threads");
  getthr_t get_threads = (getthr_t)dlsym(h, "openblas_get_num_threads");
  default_threads = get_threads ? get_threads() : 0;
  cur_threads = default_threads;
  return (real_sgemm && real_sgemv) ? 0 : -2;
}
void markbase_blas_set_gemv(int on) { use_gemv = on; }
void markbase_blas_set_gemv_min(long elems) { gemv_min_elems = elems; }
int markbase_blas_set_threads(int gemv, int small_gemm, int gemm, int small_m_rows) {
  gemv_threads = gemv;
  small_gemm_threads = small_gemm;
  gemm_threads = gemm;
  if (small_m_rows >= 0) small_m = small_m_rows;
  return set_threads != 0;
}
static inline void use_threads(int n) {
  if (n <= 0) n = default_threads;
  if (n > 0 && n != cur_threads && set_threads) {
    set_threads(n);
    cur_threads = n;
  }
}
long markbase_blas_calls(int gemv) { return gemv ? n_gemv : n_gemm; }
__attribute__((constructor)) static void markbase_blas_ctor(void) {
  const char *p = getenv("MARKBASE_BLAS_REAL");
  if (p && *p) markbase_blas_init(p);
}

/* ------------------------------------------------------------ quantized weights */

typedef struct {
  int n0, n;          /* rows [n0, n0 + n) of the float32 matrix */
  int bits, gs;       /* 4 or 8; group size, a multiple of 32 (8-bit rows: or 16) */
  const uint8_t *q;   /* n rows of K * bits / 8 bytes, MLX's packing (low bits first) */
  const float *s, *b; /* n rows of K / gs scales and biases: w = s * q + b */
} qseg_t;

#define QSEG_MAX 4
typedef struct {
  const float *w; /* the float32 weight's data: the key, with N */
  int N, K, nseg, rows, ready;
  qseg_t seg[QSEG_MAX];
} qw_t;

#define QTAB 4096 /* entries; a power of two */
#define QTOMB ((const float *)1)
static qw_t qtab[QTAB];
static int q_on = 1, q_max_m = 16, q_threads = 0;
static int q_spin_us = 30; /* a pool helper's wait for the next job before it sleeps */
static int q_act_i8 = 0;    /* inputs as int8 blocks (VNNI, opt-in), else exact float products */
static long q_hits;

static inline unsigned qhash(const float *w, int N) {
  uint64_t h = (uint64_t)(uintptr_t)w * 0x9E3779B97F4A7C15ull ^ (uint64_t)N * 0xC2B2AE3D27D4EB4Full;
  return (unsigned)(h >> 40) & (QTAB - 1);
}

static const qw_t *qfind(const float *w, int N, int K) {
  for (unsigned i = qhash(w, N), probes = 0; probes < QTAB; i = (i + 1) & (QTAB - 1), probes++) {
    const float *k = __atomic_load_n(&qtab[i].w, __ATOMIC_ACQUIRE);
    if (!k) return 0;
    if (k == w && qtab[i].N == N && qtab[i].K == K &&
        __atomic_load_n(&qtab[i].ready, __ATOMIC_ACQUIRE))
      return &qtab[i];
  }
  return 0;
}

/* Adds one segment of weight (w, N, K); the weight is used once its segments cover
   all N rows. 0 on success, <0 on a bad argument or a full table. Called from Python
   while the model is set up, never concurrently with itself. */
int markbase_qw_add(const float *w, int N, int K, int n0, int n, int bits, int gs,
                    const void *q, const float *s, const float *b) {
  if (!w || N <= 0 || K <= 0 || n <= 0 || n0 < 0 || n0 + n > N) return -1;
  /* groups of 32, 64, 128 ...; 8-bit rows also 16 (llama.cpp's Q6_K sub-blocks) */
  if ((bits != 4 && bits != 8) || K % gs || !(gs % 32 == 0 || (gs == 16 && bits == 8))) return -2;
  unsigned i = qhash(w, N), probes = 0, tomb = QTAB;
  for (; probes < QTAB; i = (i + 1) & (QTAB - 1), probes++) {
    const float *k = qtab[i].w;
    if (k == QTOMB) {
      if (tomb == QTAB) tomb = i;
      continue;
    }
    if (!k || (k == w && qtab[i].N == N)) break;
  }
  if (probes == QTAB && tomb == QTAB) return -3;
  qw_t *e;
  if (probes < QTAB && qtab[i].w == w) {
    e = &qtab[i];
    if (e->K != K || e->nseg >= QSEG_MAX || e->ready) return -4;
  } else {
    e = &qtab[(tomb < QTAB) ? tomb : i];
    e->ready = 0;
    e->N = N;
    e->K = K;
    e->nseg = 0;
    e->rows = 0;
    __atomic_store_n(&e->w, w, __ATOMIC_RELEASE);
  }
  qseg_t *sg = &e->seg[e->nseg++];
  sg->n0 = n0;
  sg->n = n;
  sg->bits = bits;
  sg->gs = gs;
  sg->q = (const uint8_t *)q;
  sg->s = s;
  sg->b = b;
  e->rows += n;
  if (e->rows == N) __atomic_store_n(&e->ready, 1, __ATOMIC_RELEASE);
  return 0;
}

int markbase_qw_remove(const float *w, int N) {
  for (unsigned i = qhash(w, N), probes = 0; probes < QTAB; i = (i + 1) & (QTAB - 1), probes++) {
    const float *k = qtab[i].w;
    if (!k) return -1;
    if (k == w && qtab[i].N == N) {
      __atomic_store_n(&qtab[i].ready, 0, __ATOMIC_RELEASE);
      __atomic_store_n(&qtab[i].w, QTOMB, __ATOMIC_RELEASE);
      return 0;
    }
  }
  return -1;
}

/* threads: the pool's size, read when the first product runs (0: the CPUs this
   process may use; 1: no pool, switchable at any time); spin_us: how long an idle helper waits for work before sleeping. */
void markbase_qw_set_int8(int on) { q_act_i8 = on; }
int markbase_qw_has_int8(void) {
#if defined(MB_VNNI) || defined(MB_AVX2)
  return 1;
#else
  return 0;
#endif
}
void markbase_qw_config(int on, int max_m, int threads, int spin_us) {
  q_on = on;
  if (max_m >= 0) q_max_m = max_m;
  if (threads >= 0) q_threads = threads;
  if (spin_us >= 0) q_spin_us = spin_us;
}
long markbase_qw_hits(void) { return __atomic_load_n(&q_hits, __ATOMIC_RELAXED); }
int markbase_qw_simd(void) {
#ifdef MB_AVX512
  return 512;
#elif defined(MB_AVX2)
  return 256;
#else
  return 0;
#endif
}


/* Per-call inputs, prepared once per product: for 4-bit rows the even and odd
   elements of each input row apart (a packed byte holds elements 2j and 2j+1). */
typedef struct {
  int M, K;
  const float *A;
  int lda;
  float *xe, *xo; /* float mode: M x K/2 each */
  /* int8 mode (llama.cpp's Q8_1 inputs: each 32-element block of an input row as int8
     times one float scale; the weight's affine bias meets the block's sum of those
     int8 values, scaled: the rounding of x then meets the centred weight s q + b,
     where the exact float sum would leave it against q's uncentred 0..15, which
     measured 2.5x the error) */
  int i8;
  int nblk, c4, c8;      /* 32-blocks per row; 128- and 64-weight chunks per row */
  int8_t *qe, *qo, *q8;  /* M rows of c4*64 (4-bit: even/odd elements) / c8*64 bytes */
  float *d4, *d8;        /* M rows of c4*16 / c8*16 lane scales (block scale per lane) */
  float *xs;             /* M rows of nblk16 block sums */
  int nblk16;            /* nblk rounded up to 16 */
  /* AVX2's int8 mode: per input row and 32-block, the block's even then odd elements
     as int8 (a 4-bit block's low then high nibbles) and its scale */
  int8_t *x8;            /* M rows of nblk * 32 */
  int8_t *xn;            /* the same int8 values in their own order (8-bit rows) */
  float *dx;             /* M rows of nblk */
  float *sq;             /* M rows of nblk: dx times the sum of the block's int8 values */
} qin_t;

/* input rows per register tile: AVX2 has 16 vector registers, AVX-512 32 */
#ifdef MB_AVX2
#define MT 4
#else
#define MT 8
#endif

#ifdef MB_AVX512
/* dot4_<T> / dot8_<T>: T input rows against one weight row; every weight block is
   dequantized once into registers (w = s * q + b) and used for all T rows. */
#define DEF_DOT4(T)                                                                    \
  static void dot4_##T(const uint8_t *q, const float *s, const float *b, int K, int gs, \
                       const float *xe, const float *xo, int xstride, float *out) {    \
    /* separate sums for the low and high nibbles: two FMA chains per row, so one  \
       row is not bound by the FMA latency */                                      \
    __m512 al[T], ah[T];                                                               \
    for (int i = 0; i < T; i++) al[i] = ah[i] = _mm512_setzero_ps();                   \
    const int per = gs / 32;                                                           \
    const __m512i lowmask = _mm512_set1_epi32(15);                                     \
    for (int g = 0, blk = 0; g < K / gs; g++) {                                        \
     __m512 sc = _mm512_set1_ps(s[g]), bi = _mm512_set1_ps(b[g]);                      \
     for (int j = 0; j < per; j++, blk++) {                                            \
      __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + blk * 16))); \
      __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, lowmask)), sc, bi); \
      __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), sc, bi); \
      for (int i = 0; i < T; i++) {                                                    \
        al[i] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xe + i * xstride + blk * 16), al[i]); \
        ah[i] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xo + i * xstride + blk * 16), ah[i]); \
      }                                                                                \
     }                                                                                 \
    }                                                                                  \
    for (int i = 0; i < T; i++) out[i] = _mm512_reduce_add_ps(_mm512_add_ps(al[i], ah[i])); \
  }
#define DEF_DOT8(T)                                                                    \
  static void dot8_##T(const uint8_t *q, const float *s, const float *b, int K, int gs, \
                       const float *x, int xstride, float *out) {                      \
    __m512 a0[T], a1[T];                                                               \
    for (int i = 0; i < T; i++) a0[i] = a1[i] = _mm512_setzero_ps();                   \
    const int per = gs / 32;                                                           \
    for (int g = 0, blk = 0; g < K / gs; g++) {                                        \
     __m512 sc = _mm512_set1_ps(s[g]), bi = _mm512_set1_ps(b[g]);                      \
     for (int j = 0; j < per; j++, blk++) {                                            \
      __m512 w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(             \
                                      _mm_loadu_si128((const __m128i *)(q + blk * 32)))), \
                                  sc, bi);                                             \
      __m512 w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(             \
                                      _mm_loadu_si128((const __m128i *)(q + blk * 32 + 16)))), \
                                  sc, bi);                                             \
      for (int i = 0; i < T; i++) {                                                    \
        a0[i] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + i * xstride + blk * 32), a0[i]); \
        a1[i] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + i * xstride + blk * 32 + 16), a1[i]); \
      }                                                                                \
     }                                                                                 \
    }                                                                                  \
    for (int i = 0; i < T; i++) out[i] = _mm512_reduce_add_ps(_mm512_add_ps(a0[i], a1[i])); \
  }
/* dot8 for groups of 16: each 16-lane vector is one group */
#define DEF_DOT8G16(T)                                                                 \
  static void dot8g16_##T(const uint8_t *q, const float *s, const float *b, int K, int gs, \
                          const float *x, int xstride, float *out) {                   \
    (void)gs;                                                                          \
    __m512 a0[T], a1[T];                                                               \
    for (int i = 0; i < T; i++) a0[i] = a1[i] = _mm512_setzero_ps();                   \
    for (int blk = 0; blk < K / 32; blk++) {                                           \
      __m512 w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(             \
                                      _mm_loadu_si128((const __m128i *)(q + blk * 32)))), \
                                  _mm512_set1_ps(s[2 * blk]), _mm512_set1_ps(b[2 * blk])); \
      __m512 w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(             \
                                      _mm_loadu_si128((const __m128i *)(q + blk * 32 + 16)))), \
                                  _mm512_set1_ps(s[2 * blk + 1]), _mm512_set1_ps(b[2 * blk + 1])); \
      for (int i = 0; i < T; i++) {                                                    \
        a0[i] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + i * xstride + blk * 32), a0[i]); \
        a1[i] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + i * xstride + blk * 32 + 16), a1[i]); \
      }                                                                                \
    }                                                                                  \
    for (int i = 0; i < T; i++) out[i] = _mm512_reduce_add_ps(_mm512_add_ps(a0[i], a1[i])); \
  }
DEF_DOT4(1) DEF_DOT4(2) DEF_DOT4(3) DEF_DOT4(4) DEF_DOT4(5) DEF_DOT4(6) DEF_DOT4(7) DEF_DOT4(8)
DEF_DOT8(1) DEF_DOT8(2) DEF_DOT8(3) DEF_DOT8(4) DEF_DOT8(5) DEF_DOT8(6) DEF_DOT8(7) DEF_DOT8(8)
DEF_DOT8G16(1) DEF_DOT8G16(2) DEF_DOT8G16(3) DEF_DOT8G16(4)
DEF_DOT8G16(5) DEF_DOT8G16(6) DEF_DOT8G16(7) DEF_DOT8G16(8)
typedef void (*dot4_t)(const uint8_t *, const float *, const float *, int, int, const float *,
                       const float *, int, float *);
typedef void (*dot8_t)(const uint8_t *, const float *, const float *, int, int, const float *,
                       int, float *);
static const dot4_t dot4_tab[MT + 1] = {0, dot4_1, dot4_2, dot4_3, dot4_4,
                                        dot4_5, dot4_6, dot4_7, dot4_8};
static const dot8_t dot8_tab[MT + 1] = {0, dot8_1, dot8_2, dot8_3, dot8_4,
                                        dot8_5, dot8_6, dot8_7, dot8_8};
static const dot8_t dot8g16_tab[MT + 1] = {0, dot8g16_1, dot8g16_2, dot8g16_3, dot8g16_4,
                                           dot8g16_5, dot8g16_6, dot8g16_7, dot8g16_8};
#define DOT4(T, ...) dot4_tab[T](__VA_ARGS__)
#define DOT8(T, ...) dot8_tab[T](__VA_ARGS__)
#define DOT8G16(T, ...) dot8g16_tab[T](__VA_ARGS__)
#elif defined(MB_AVX2)
/* The same kernels 8 lanes wide (AVX2 + FMA: Zen 2/3, Haswell and later without
   AVX-512). A 32-weight block is 16 packed bytes: bytes 0-7 give even elements 0-7
   (low nibbles) and odd elements 0-7 (high nibbles) of the block, bytes 8-15 the
   rest; xe/xo hold the input's even and odd elements in the same order. Two FMA
   chains per row whatever the tile size, so a row's bits do not depend on the batch.
   Tried on 2 cores of an AMD EPYC, no gain: every weight row dequantized into a float
   buffer with 4 chains per row (1.2-1.3x slower at 1-16 rows; the buffer only past the
   first tile of rows, with these 2 chains, is dotw below); 4 weight rows at once at
   batch 1 (same time); at one row, the affine term factored out (s * sum q x + b * sum
   x), 4 chains, or software prefetch (each within 5%: one thread runs this kernel at
   4.5-5.5 G weights/s hot in cache, bound by converting and dequantizing each weight). */
static inline __m256 deq8(__m256i v, __m256 sc, __m256 bi) {
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), sc, bi);
}
#define DEF_DOT4(T)                                                                    \
  static void dot4_##T(const uint8_t *q, const float *s, const float *b, int K, int gs, \
                       const float *xe, const float *xo, int xstride, float *out) {    \
    __m256 a0[T], a1[T];                                                               \
    for (int i = 0; i < T; i++) a0[i] = a1[i] = _mm256_setzero_ps();                   \
    const int per = gs / 32;                                                           \
    const __m256i lowmask = _mm256_set1_epi32(15);                                     \
    for (int g = 0, blk = 0; g < K / gs; g++) {                                        \
     __m256 sc = _mm256_set1_ps(s[g]), bi = _mm256_set1_ps(b[g]);                      \
     for (int j = 0; j < per; j++, blk++) {                                            \
      for (int h = 0; h < 2; h++) {                                                    \
       __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + blk * 16 + h * 8))); \
       __m256 lo = deq8(_mm256_and_si256(v, lowmask), sc, bi);                         \
       __m256 hi = deq8(_mm256_srli_epi32(v, 4), sc, bi);                              \
       const int o = blk * 16 + h * 8;                                                 \
       for (int i = 0; i < T; i++) {                                                   \
         a0[i] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xe + i * xstride + o), a0[i]);    \
         a1[i] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xo + i * xstride + o), a1[i]);    \
       }                                                                               \
      }                                                                                \
     }                                                                                 \
    }                                                                                  \
    for (int i = 0; i < T; i++) out[i] = hsum8(_mm256_add_ps(a0[i], a1[i]));         \
  }
#define DEF_DOT8(T)                                                                    \
  static void dot8_##T(const uint8_t *q, const float *s, const float *b, int K, int gs, \
                       const float *x, int xstride, float *out) {                      \
    __m256 a0[T], a1[T];                                                               \
    for (int i = 0; i < T; i++) a0[i] = a1[i] = _mm256_setzero_ps();                   \
    const int per = gs / 32;                                                           \
    for (int g = 0, blk = 0; g < K / gs; g++) {                                        \
     __m256 sc = _mm256_set1_ps(s[g]), bi = _mm256_set1_ps(b[g]);                      \
     for (int j = 0; j < per; j++, blk++) {                                            \
      for (int h = 0; h < 32; h += 16) {                                               \
       const uint8_t *p = q + blk * 32 + h;                                            \
       __m256 w0 = deq8(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)), sc, bi); \
       __m256 w1 = deq8(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8))), sc, bi); \
       const int o = blk * 32 + h;                                                     \
       for (int i = 0; i < T; i++) {                                                   \
         a0[i] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + i * xstride + o), a0[i]);     \
         a1[i] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + i * xstride + o + 8), a1[i]); \
       }                                                                               \
      }                                                                                \
     }                                                                                 \
    }                                                                                  \
    for (int i = 0; i < T; i++) out[i] = hsum8(_mm256_add_ps(a0[i], a1[i]));         \
  }
/* dot8 for groups of 16 (Q6_K's sub-blocks): the same chunks of 16 in the same order,
   each with its own scale and bias */
#define DEF_DOT8G16(T)                                                                 \
  static void dot8g16_##T(const uint8_t *q, const float *s, const float *b, int K, int gs, \
                          const float *x, int xstride, float *out) {                   \
    (void)gs;                                                                          \
    __m256 a0[T], a1[T];                                                               \
    for (int i = 0; i < T; i++) a0[i] = a1[i] = _mm256_setzero_ps();                   \
    for (int c = 0; c < K / 16; c++) {                                                 \
      const __m256 sc = _mm256_set1_ps(s[c]), bi = _mm256_set1_ps(b[c]);              \
      const uint8_t *p = q + c * 16;                                                   \
      __m256 w0 = deq8(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)), sc, bi); \
      __m256 w1 = deq8(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8))), sc, bi); \
      for (int i = 0; i < T; i++) {                                                    \
        a0[i] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + i * xstride + c * 16), a0[i]); \
        a1[i] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + i * xstride + c * 16 + 8), a1[i]); \
      }                                                                                \
    }                                                                                  \
    for (int i = 0; i < T; i++) out[i] = hsum8(_mm256_add_ps(a0[i], a1[i]));         \
  }
DEF_DOT4(1) DEF_DOT4(2) DEF_DOT4(3) DEF_DOT4(4)
DEF_DOT8(1) DEF_DOT8(2) DEF_DOT8(3) DEF_DOT8(4)
DEF_DOT8G16(1) DEF_DOT8G16(2) DEF_DOT8G16(3) DEF_DOT8G16(4)
/* More input rows than one register tile (M > MT): a tile's weight rows are dequantized
   once into the thread's buffer, and dotw runs dot4's (dot8's) two FMA chains from
   there: the same values in the same order, so a row's bits still do not depend on the
   batch, and the later tiles of input rows skip the dequantization. In the buffer a
   row holds first the values of its first chain (a 4-bit row's low nibbles, in dot4's
   order; an 8-bit row's elements 0-7 of every 16), then those of its second, so each
   chain runs over contiguous memory, one chain after the other (the two sums meet
   only at the end). dotw takes R weight rows at once against T input rows: an input
   vector loaded once serves R rows, so at R = 3 the loop is bound by its FMAs instead
   of its loads (one thread, 16 x 16 rows, K 576-1536: 17.8-18.5 G multiply-adds/s
   against 12.1-13.6 one weight row at a time, the same bits; the FMA units' own rate
   here is 20). */
#define QW_BUF 1
static void deq4_row(const uint8_t *q, const float *s, const float *b, int K, int gs, float *w) {
  const int per = gs / 32;
  const __m256i lowmask = _mm256_set1_epi32(15);
  float *w2 = w + K / 2;
  for (int g = 0, blk = 0; g < K / gs; g++) {
    __m256 sc = _mm256_set1_ps(s[g]), bi = _mm256_set1_ps(b[g]);
    for (int j = 0; j < per; j++, blk++)
      for (int h = 0; h < 2; h++) {
        __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + blk * 16 + h * 8)));
        const int o = (blk * 2 + h) * 8;
        _mm256_storeu_ps(w + o, deq8(_mm256_and_si256(v, lowmask), sc, bi));
        _mm256_storeu_ps(w2 + o, deq8(_mm256_srli_epi32(v, 4), sc, bi));
      }
  }
}
/* Each chunk of 16 weights: elements 0-7 to the first half of w, 8-15 to the second,
   with its group's scale and bias (groups of 16, 32, 64, ...). */
static void deq8_row(const uint8_t *q, const float *s, const float *b, int K, int gs, float *w) {
  float *w2 = w + K / 2;
  for (int c = 0; c < K / 16; c++) {
    const int g = c * 16 / gs;
    const __m256 sc = _mm256_set1_ps(s[g]), bi = _mm256_set1_ps(b[g]);
    const uint8_t *p = q + c * 16;
    _mm256_storeu_ps(w + c * 8, deq8(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)), sc, bi));
    _mm256_storeu_ps(w2 + c * 8,
                     deq8(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8))), sc, bi));
  }
}
/* R buffered weight rows (K floats apart) against T input rows; out[i * ostride + r].
   4-bit: chain 1 over the inputs' even elements xe, chain 2 over the odd ones xo (K/2
   each, xstride apart). 8-bit: x's elements 0-7 of every 16, then 8-15 (xe = x,
   xo = x + 8, step 16). */
#define DEF_DOTW(R, T)                                                                 \
  static void dotw_##R##_##T(const float *w, int K, const float *xe, const float *xo,  \
                             int xstride, int xstep, float *out, int ostride) {       \
    __m256 a0[R][T], a1[R][T];                                                         \
    const int h = K / 2;                                                               \
    for (int r = 0; r < R; r++)                                                        \
      for (int i = 0; i < T; i++) a0[r][i] = a1[r][i] = _mm256_setzero_ps();           \
    for (int c = 0; c < h / 8; c++) {                                                  \
      __m256 wv[R];                                                                    \
      for (int r = 0; r < R; r++) wv[r] = _mm256_loadu_ps(w + (size_t)r * K + c * 8);  \
      for (int i = 0; i < T; i++) {                                                    \
        __m256 xv = _mm256_loadu_ps(xe + i * xstride + c * xstep);                     \
        for (int r = 0; r < R; r++) a0[r][i] = _mm256_fmadd_ps(wv[r], xv, a0[r][i]);   \
      }                                                                                \
    }                                                                                  \
    for (int c = 0; c < h / 8; c++) {                                                  \
      __m256 wv[R];                                                                    \
      for (int r = 0; r < R; r++) wv[r] = _mm256_loadu_ps(w + (size_t)r * K + h + c * 8); \
      for (int i = 0; i < T; i++) {                                                    \
        __m256 xv = _mm256_loadu_ps(xo + i * xstride + c * xstep);                     \
        for (int r = 0; r < R; r++) a1[r][i] = _mm256_fmadd_ps(wv[r], xv, a1[r][i]);   \
      }                                                                                \
    }                                                                                  \
    for (int r = 0; r < R; r++)                                                        \
      for (int i = 0; i < T; i++) out[i * ostride + r] = hsum8(_mm256_add_ps(a0[r][i], a1[r][i])); \
  }
#define DEF_DOTW_R(R) DEF_DOTW(R, 1) DEF_DOTW(R, 2) DEF_DOTW(R, 3) DEF_DOTW(R, 4)
DEF_DOTW_R(1) DEF_DOTW_R(2) DEF_DOTW_R(3)
typedef void (*dotw_t)(const float *, int, const float *, const float *, int, int, float *, int);
#define DOTW_R 3 /* weight rows a call at most */
static const dotw_t dotw_tab[DOTW_R + 1][MT + 1] = {
    {0}, {0, dotw_1_1, dotw_1_2, dotw_1_3, dotw_1_4}, {0, dotw_2_1, dotw_2_2, dotw_2_3, dotw_2_4},
    {0, dotw_3_1, dotw_3_2, dotw_3_3, dotw_3_4}};
typedef void (*dot4_t)(const uint8_t *, const float *, const float *, int, int, const float *,
                       const float *, int, float *);
typedef void (*dot8_t)(const uint8_t *, const float *, const float *, int, int, const float *,
                       int, float *);
static const dot4_t dot4_tab[MT + 1] = {0, dot4_1, dot4_2, dot4_3, dot4_4};
static const dot8_t dot8_tab[MT + 1] = {0, dot8_1, dot8_2, dot8_3, dot8_4};
static const dot8_t dot8g16_tab[MT + 1] = {0, dot8g16_1, dot8g16_2, dot8g16_3, dot8g16_4};

#define DOT4(T, ...) dot4_tab[T](__VA_ARGS__)
#define DOT8(T, ...) dot8_tab[T](__VA_ARGS__)
#define DOT8G16(T, ...) dot8g16_tab[T](__VA_ARGS__)
#else
static void dot4_any(int T, const uint8_t *q, const float *s, const float *b, int K, int gs,
                     const float *xe, const float *xo, int xstride, float *out) {
  for (int i = 0; i < T; i++) {
    float acc = 0.f;
    for (int k = 0; k < K / 2; k++) {
      float sc = s[(2 * k) / gs], bi = b[(2 * k) / gs];
      acc += ((q[k] & 15) * sc + bi) * xe[i * xstride + k] + ((q[k] >> 4) * sc + bi) * xo[i * xstride + k];
    }
    out[i] = acc;
  }
}
static void dot8_any(int T, const uint8_t *q, const float *s, const float *b, int K, int gs,
                     const float *x, int xstride, float *out) {
  for (int i = 0; i < T; i++) {
    float acc = 0.f;
    for (int k = 0; k < K; k++) acc += (q[k] * s[k / gs] + b[k / gs]) * x[i * xstride + k];
    out[i] = acc;
  }
}
#define DOT4(T, ...) dot4_any(T, __VA_ARGS__)
#define DOT8(T, ...) dot8_any(T, __VA_ARGS__)
#define DOT8G16(T, ...) dot8_any(T, __VA_ARGS__)
#endif

#ifdef MB_VNNI
/* Lane l of a dpbusd result sums bytes 4l..4l+3: with 4-bit weights a 64-byte chunk
   holds 4 blocks (4 lanes each), with 8-bit weights 2 blocks (8 lanes each). */
static const int32_t lane_blk4[16] = {0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3};
static const int32_t lane_blk8[16] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1};

#define DEF_IDOT(T)                                                                    \
  static void idot_##T(int bits, const uint8_t *q, const float *s, const float *b,     \
                       const qin_t *in, int m0, float *out) {                          \
    __m512 acc[T];                                                                     \
    for (int i = 0; i < T; i++) acc[i] = _mm512_setzero_ps();                          \
    const int nblk = in->nblk;                                                         \
    if (bits == 4) {                                                                   \
      const __m512i idx = _mm512_loadu_si512(lane_blk4), low = _mm512_set1_epi8(15);   \
      const int rowbytes = nblk * 16;                                                  \
      for (int c = 0; c < in->c4; c++) {                                               \
        int left = rowbytes - c * 64, nb = nblk - c * 4;                               \
        __mmask64 mq = left >= 64 ? ~0ull : ((1ull << left) - 1);                      \
        __mmask16 ms = nb >= 4 ? 0xF : (__mmask16)((1u << nb) - 1);                    \
        __m512i v = _mm512_maskz_loadu_epi8(mq, q + c * 64);                           \
        __m512i lo = _mm512_and_si512(v, low);                                         \
        __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);                   \
        __m512 sv = _mm512_permutexvar_ps(idx, _mm512_maskz_loadu_ps(ms, s + c * 4));  \
        for (int i = 0; i < T; i++) {                                                  \
          const int8_t *xe = in->qe + (size_t)(m0 + i) * in->c4 * 64 + c * 64;         \
          const int8_t *xo = in->qo + (size_t)(m0 + i) * in->c4 * 64 + c * 64;         \
          __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(xe)); \
          d = _mm512_dpbusd_epi32(d, hi, _mm512_loadu_si512(xo));                      \
          __m512 dx = _mm512_loadu_ps(in->d4 + (size_t)(m0 + i) * in->c4 * 16 + c * 16); \
          acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(sv, dx), acc[i]); \
        }                                                                              \
      }                                                                                \
    } else {                                                                           \
      const __m512i idx = _mm512_loadu_si512(lane_blk8);                               \
      const int rowbytes = nblk * 32;                                                  \
      for (int c = 0; c < in->c8; c++) {                                               \
        int left = rowbytes - c * 64, nb = nblk - c * 2;                               \
        __mmask64 mq = left >= 64 ? ~0ull : ((1ull << left) - 1);                      \
        __mmask16 ms = nb >= 2 ? 0x3 : 0x1;                                            \
        __m512i v = _mm512_maskz_loadu_epi8(mq, q + c * 64);                           \
        __m512 sv = _mm512_permutexvar_ps(idx, _mm512_maskz_loadu_ps(ms, s + c * 2));  \
        for (int i = 0; i < T; i++) {                                                  \
          const int8_t *x = in->q8 + (size_t)(m0 + i) * in->c8 * 64 + c * 64;          \
          __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v, _mm512_loadu_si512(x)); \
          __m512 dx = _mm512_loadu_ps(in->d8 + (size_t)(m0 + i) * in->c8 * 16 + c * 16); \
          acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(sv, dx), acc[i]); \
        }                                                                              \
      }                                                                                \
    }                                                                                  \
    /* the affine biases: sum over blocks of b * (block sum of the int8 x, scaled) */  \
    for (int c = 0; c < in->nblk16; c += 16) {                                         \
      int nb = nblk - c;                                                               \
      __mmask16 mb = nb >= 16 ? 0xFFFF : (__mmask16)((1u << nb) - 1);                  \
      __m512 bv = _mm512_maskz_loadu_ps(mb, b + c);                                    \
      for (int i = 0; i < T; i++)                                                      \
        acc[i] = _mm512_fmadd_ps(bv, _mm512_loadu_ps(in->xs + (size_t)(m0 + i) * in->nblk16 + c), acc[i]); \
    }                                                                                  \
    for (int i = 0; i < T; i++) out[i] = _mm512_reduce_add_ps(acc[i]);                 \
  }
DEF_IDOT(1) DEF_IDOT(2) DEF_IDOT(3) DEF_IDOT(4) DEF_IDOT(5) DEF_IDOT(6) DEF_IDOT(7) DEF_IDOT(8)
typedef void (*idot_t)(int, const uint8_t *, const float *, const float *, const qin_t *, int,
                       float *);
static const idot_t idot_tab[MT + 1] = {0, idot_1, idot_2, idot_3, idot_4,
                                        idot_5, idot_6, idot_7, idot_8};

/* Quantizes every input row to int8 blocks (scale = max|x| / 127 per 32 elements). */
static void prep_i8(qin_t *in) {
  const int K = in->K, nblk = in->nblk;
  for (int m = 0; m < in->M; m++) {
    const float *x = in->A + (size_t)m * in->lda;
    int8_t *qe = in->qe + (size_t)m * in->c4 * 64, *qo = in->qo + (size_t)m * in->c4 * 64;
    int8_t *q8 = in->q8 + (size_t)m * in->c8 * 64;
    float *d4 = in->d4 + (size_t)m * in->c4 * 16, *d8 = in->d8 + (size_t)m * in->c8 * 16;
    float *xs = in->xs + (size_t)m * in->nblk16;
    memset(qe, 0, (size_t)in->c4 * 64);
    memset(qo, 0, (size_t)in->c4 * 64);
    memset(q8, 0, (size_t)in->c8 * 64);
    memset(d4, 0, (size_t)in->c4 * 16 * sizeof(float));
    memset(d8, 0, (size_t)in->c8 * 16 * sizeof(float));
    memset(xs, 0, (size_t)in->nblk16 * sizeof(float));
    for (int blk = 0; blk < nblk; blk++) {
      __m512 a = _mm512_loadu_ps(x + blk * 32), c = _mm512_loadu_ps(x + blk * 32 + 16);
      float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(c)));
      float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      __m512 iv = _mm512_set1_ps(inv);
      __m512i ia = _mm512_cvtps_epi32(_mm512_mul_ps(a, iv)); /* round to nearest even */
      __m512i ic = _mm512_cvtps_epi32(_mm512_mul_ps(c, iv));
      xs[blk] = d * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(ia, ic));
      int8_t tmp[32];
      _mm_storeu_si128((__m128i *)tmp, _mm512_cvtsepi32_epi8(ia));
      _mm_storeu_si128((__m128i *)(tmp + 16), _mm512_cvtsepi32_epi8(ic));
      memcpy(q8 + blk * 32, tmp, 32);
      for (int j = 0; j < 16; j++) {
        qe[blk * 16 + j] = tmp[2 * j];
        qo[blk * 16 + j] = tmp[2 * j + 1];
      }
      for (int l = 0; l < 4; l++) d4[(blk / 4) * 16 + (blk % 4) * 4 + l] = d;
      for (int l = 0; l < 8; l++) d8[(blk / 2) * 16 + (blk % 2) * 8 + l] = d;
    }
  }
  (void)K;
}
#endif

#ifdef MB_AVX2
/* Inputs as int8 blocks for AVX2 (llama.cpp's Q8_1 activations): scale = max|x| / 127
   per 32 elements, rounded to nearest even, and the block's sum of its int8 values
   (scaled) for the weights' affine biases. */
static void prep_i8_avx2(qin_t *in) {
  const int nblk = in->nblk;
  const __m256 signbit = _mm256_set1_ps(-0.0f);
  for (int m = 0; m < in->M; m++) {
    const float *x = in->A + (size_t)m * in->lda;
    for (int blk = 0; blk < nblk; blk++) {
      const float *xb = x + blk * 32;
      __m256 v0 = _mm256_loadu_ps(xb), v1 = _mm256_loadu_ps(xb + 8);
      __m256 v2 = _mm256_loadu_ps(xb + 16), v3 = _mm256_loadu_ps(xb + 24);
      __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(signbit, v0), _mm256_andnot_ps(signbit, v1)),
                                _mm256_max_ps(_mm256_andnot_ps(signbit, v2), _mm256_andnot_ps(signbit, v3)));
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      h = _mm_max_ss(h, _mm_movehdup_ps(h));
      const float amax = _mm_cvtss_f32(h);
      const size_t r = (size_t)m * nblk + blk;
      in->dx[r] = amax / 127.f;
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      int8_t *q = in->x8 + r * 32, *qn = in->xn + r * 32;
      int isum = 0;
      for (int j = 0; j < 32; j++) { /* MXCSR's rounding: to nearest even */
        qn[j] = (int8_t)_mm_cvtss_si32(_mm_set_ss(xb[j] * inv));
        isum += qn[j];
      }
      in->sq[r] = in->dx[r] * (float)isum;
      for (int j = 0; j < 16; j++) {
        q[j] = qn[2 * j];
        q[16 + j] = qn[2 * j + 1];
      }
    }
  }
}

/* One row's result from its accumulated 8 lanes: plus the affine biases' share (in
   lanes of its own, added before the horizontal sum), the sum over blocks of
   b * (scaled int8 block sum of x), with, for 8-bit rows (s not NULL), the 128 * s
   that their kernel moves out of the integer products added to b. */
static inline float row_total(__m256 acc, const float *b, const float *s, const float *sq,
                              int nblk) {
  const __m256 k128 = _mm256_set1_ps(128.f);
  __m256 bs = _mm256_setzero_ps();
  int c = 0;
  for (; c + 8 <= nblk; c += 8) {
    __m256 bc = _mm256_loadu_ps(b + c);
    if (s) bc = _mm256_fmadd_ps(k128, _mm256_loadu_ps(s + c), bc);
    bs = _mm256_fmadd_ps(bc, _mm256_loadu_ps(sq + c), bs);
  }
  float t = 0.f;
  for (; c < nblk; c++) t += (s ? b[c] + 128.f * s[c] : b[c]) * sq[c];
  return hsum8(_mm256_add_ps(acc, bs)) + t;
}

/* T input rows (int8 blocks) against one 4-bit weight row: per 32-block, the 16 packed
   bytes as [low nibbles | high nibbles] times the row's [even | odd] int8 elements
   (maddubs: u8 x i8 pairs, at most 2 * 15 * 127, no saturation), scaled once. Even
   and odd blocks sum in two chains. */
#define DEF_IDOT2(T)                                                                   \
  static void idot2_##T(const uint8_t *q, const float *s, const float *b, const qin_t *in, \
                        int m0, float *out) {                                          \
    __m256 acc[2][T];                                                                  \
    for (int i = 0; i < T; i++) acc[0][i] = acc[1][i] = _mm256_setzero_ps();           \
    const int nblk = in->nblk;                                                         \
    const __m128i low = _mm_set1_epi8(15);                                             \
    const __m256i ones = _mm256_set1_epi16(1);                                         \
    for (int blk = 0; blk < nblk; blk++) {                                             \
      __m128i v = _mm_loadu_si128((const __m128i *)(q + blk * 16));                   \
      __m256i w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low),           \
                                   _mm_and_si128(v, low));                             \
      __m256 *a = acc[blk & 1];                                                        \
      for (int i = 0; i < T; i++) {                                                    \
        const size_t r = (size_t)(m0 + i) * nblk + blk;                                \
        __m256i p = _mm256_madd_epi16(                                                 \
            _mm256_maddubs_epi16(w, _mm256_loadu_si256((const __m256i *)(in->x8 + r * 32))), ones); \
        a[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(s[blk] * in->dx[r]), a[i]); \
      }                                                                                \
    }                                                                                  \
    for (int i = 0; i < T; i++)                                                        \
      out[i] = row_total(_mm256_add_ps(acc[0][i], acc[1][i]), b, NULL,                 \
                         in->sq + (size_t)(m0 + i) * nblk, nblk);                      \
  }
DEF_IDOT2(1) DEF_IDOT2(2) DEF_IDOT2(3) DEF_IDOT2(4)
typedef void (*idot2_t)(const uint8_t *, const float *, const float *, const qin_t *, int, float *);
static const idot2_t idot2_tab[MT + 1] = {0, idot2_1, idot2_2, idot2_3, idot2_4};

/* T input rows (int8 blocks) against one 8-bit weight row. maddubs takes unsigned x
   signed bytes, and 255 * 127 twice would saturate its 16-bit sums, so the weights
   are taken as q - 128 (signed): |q - 128| against x with q - 128's sign (at most
   2 * 128 * 127), and the 128 * s * x that moves out is added back from the sum of the
   same int8 values: sum (s q + b) x8 dx = (s sum (q - 128) x8 + (b + 128 s) sum x8) dx. */
#define DEF_IDOT8(T)                                                                   \
  static void idot8_##T(const uint8_t *q, const float *s, const float *b, const qin_t *in, \
                        int m0, float *out) {                                          \
    __m256 acc[T];                                                                     \
    for (int i = 0; i < T; i++) acc[i] = _mm256_setzero_ps();                          \
    const int nblk = in->nblk;                                                         \
    const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);    \
    for (int blk = 0; blk < nblk; blk++) {                                             \
      __m256i w = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(q + blk * 32)), flip); \
      __m256i aw = _mm256_abs_epi8(w);                                                 \
      for (int i = 0; i < T; i++) {                                                    \
        const size_t r = (size_t)(m0 + i) * nblk + blk;                                \
        __m256i x = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(in->xn + r * 32)), w); \
        __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, x), ones);              \
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(s[blk] * in->dx[r]), acc[i]); \
      }                                                                                \
    }                                                                                  \
    for (int i = 0; i < T; i++)                                                        \
      out[i] = row_total(acc[i], b, s, in->sq + (size_t)(m0 + i) * nblk, nblk);        \
  }
DEF_IDOT8(1) DEF_IDOT8(2) DEF_IDOT8(3) DEF_IDOT8(4)
static const idot2_t idot8_tab[MT + 1] = {0, idot8_1, idot8_2, idot8_3, idot8_4};
#endif

/* Grows a thread's buffer *buf (of *cap floats) to at least ``need`` floats; 0 when out
   of memory (the buffer is then as it was). */
static int grow(float **buf, size_t *cap, size_t need) {
  if (need <= *cap) return 1;
  float *p = (float *)realloc(*buf, need * sizeof(float));
  if (!p) return 0;
  *buf = p;
  *cap = need;
  return 1;
}

/* One weight row n (of segment sg) against every input row, straight from its codes
   (with more input rows than one register tile, run_tile's tile_rows buffers the
   tile's dequantized rows instead; qrow is its fallback when that buffer cannot grow). */
static inline void qrow(const qseg_t *sg, int n, const qin_t *in, float alpha, float beta,
                        float *C, int ldc) {
  const int K = in->K, r = n - sg->n0, ng = K / sg->gs;
  const uint8_t *q = sg->q + (size_t)r * (K * sg->bits / 8);
  const float *s = sg->s + (size_t)r * ng, *b = sg->b + (size_t)r * ng;
  float out[MT];
  for (int m0 = 0; m0 < in->M; m0 += MT) {
    int mt = in->M - m0 < MT ? in->M - m0 : MT;
#ifdef MB_VNNI
    if (in->i8)
      idot_tab[mt](sg->bits, q, s, b, in, m0, out);
    else
#elif defined(MB_AVX2)
    if (in->i8)
      (sg->bits == 4 ? idot2_tab : idot8_tab)[mt](q, s, b, in, m0, out);
    else
#endif
    if (sg->bits == 4)
      DOT4(mt, q, s, b, K, sg->gs, in->xe + (size_t)m0 * (K / 2), in->xo + (size_t)m0 * (K / 2),
           K / 2, out);
    else if (sg->gs == 16)
      DOT8G16(mt, q, s, b, K, sg->gs, in->A + (size_t)m0 * in->lda, in->lda, out);
    else
      DOT8(mt, q, s, b, K, sg->gs, in->A + (size_t)m0 * in->lda, in->lda, out);
    for (int i = 0; i < mt; i++) {
      float y = alpha * out[i];
      float *c = C + (size_t)(m0 + i) * ldc + n;
      *c = beta == 0.f ? y : y + beta * *c;
    }
  }
}

/* ---- the thread pool: callers never wait on a helper that is not running ----

   A product is cut into tiles of 16 weight rows. The calling thread (MLX's CPU
   stream) publishes the job and works through the tiles itself; helpers, woken by a
   futex, claim runs of tiles (claim_span) from the same counter. The caller waits
   only for tiles a helper has already claimed, so when the machine is busy and a
   helper is not scheduled, the caller just does all the work (OpenMP's join would
   wait for that helper's whole share, a scheduler time slice or more: measured 2-3x
   slower steps on 2 shared cores). The counter carries the job's generation in its
   high half, so a late helper can never claim a tile of a newer job with an older
   job's fields. */
typedef struct {
  const qw_t *e;
  const qin_t *in;
  float alpha, beta;
  float *C;
  int ldc, tiles;
  int span; /* tiles a claim takes */
  void (*fn)(const void *arg, int t); /* a job of another kind: tile t is fn(arg, t) */
  const void *arg;
} qjob_t;

#define TILE 16
/* Tiles one claim takes with at most MT input rows: half a thread's share, so the
   threads meet on the claim counter (one cache line, moved between cores at each claim)
   a few times a product instead of once every 16 weight rows. A caller still never
   waits for more than one claim that a helper took. SmolLM2's decode step, one row,
   the two forms alternated step by step in one process on 2 Zen 3 cores: 1.01-1.10x;
   Gemma 3 270M's (its 262,144-row output layer: 16,384 tiles) 1.13-1.18x; 2-4 rows
   1.00-1.06x. Past MT rows a tile is 16 rows times every input row and stays the
   claim (longer claims there: 0.97-1.01x). */
static inline int claim_span(int tiles, int threads) {
  const int span = tiles / (2 * threads);
  return span > 1 ? span : 1;
}
static qjob_t pool_job;
static uint64_t pool_claim; /* generation << 32 | next tile */
static int pool_done;       /* tiles finished in the current job */
static uint32_t pool_gen;   /* futex word: bumped for each job */
static int pool_sleepers, pool_helpers, pool_started;
static long pool_helper_tiles, pool_jobs; /* for markbase_qw_pool_stats */
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER; /* one job at a time */
static pthread_mutex_t pool_init_lock = PTHREAD_MUTEX_INITIALIZER;

#ifdef QW_BUF
static __thread float *t_buf; /* a tile's weight rows dequantized (tile_rows) */
static __thread size_t t_cap;

/* Rows [n0, n1) of job j with more input rows than one register tile (float inputs):
   the weight rows dequantized once into a buffer, then each tile of MT input rows
   against all of them, so the inputs a tile reads stay in L1 (qrow instead reads
   every input row for each weight row). The same dot products in the same order as
   qrow's, so the same bits. 0 when it does not apply. */
static int tile_rows(const qjob_t *j, int n0, int n1) {
  const qw_t *e = j->e;
  const qin_t *in = j->in;
  const int K = in->K;
  if (in->i8 || in->M <= MT || !grow(&t_buf, &t_cap, (size_t)(n1 - n0) * K)) return 0;
  int bits[TILE];
  for (int n = n0, si = 0; n < n1; n++) {
    while (n >= e->seg[si].n0 + e->seg[si].n) si++;
    const qseg_t *sg = &e->seg[si];
    const int r = n - sg->n0, ng = K / sg->gs;
    const uint8_t *q = sg->q + (size_t)r * (K * sg->bits / 8);
    (sg->bits == 4 ? deq4_row : deq8_row)(q, sg->s + (size_t)r * ng, sg->b + (size_t)r * ng, K,
                                          sg->gs, t_buf + (size_t)(n - n0) * K);
    bits[n - n0] = sg->bits;
  }
  float out[MT * DOTW_R];
  for (int m0 = 0; m0 < in->M; m0 += MT) {
    const int mt = in->M - m0 < MT ? in->M - m0 : MT;
    for (int n = n0; n < n1;) {
      int r = 1; /* weight rows of one kind taken together */
      while (r < DOTW_R && n + r < n1 && bits[n + r - n0] == bits[n - n0]) r++;
      const float *w = t_buf + (size_t)(n - n0) * K;
      if (bits[n - n0] == 4)
        dotw_tab[r][mt](w, K, in->xe + (size_t)m0 * (K / 2), in->xo + (size_t)m0 * (K / 2), K / 2,
                        8, out, DOTW_R);
      else {
        const float *x = in->A + (size_t)m0 * in->lda;
        dotw_tab[r][mt](w, K, x, x + 8, in->lda, 16, out, DOTW_R);
      }
      for (int i = 0; i < mt; i++)
        for (int k = 0; k < r; k++) {
          float y = j->alpha * out[i * DOTW_R + k];
          float *c = j->C + (size_t)(m0 + i) * j->ldc + n + k;
          *c = j->beta == 0.f ? y : y + j->beta * *c;
        }
      n += r;
    }
  }
  return 1;
}
#endif

static void run_tile(const qjob_t *j, int t) {
  if (j->fn) {
    j->fn(j->arg, t);
    return;
  }
  const qw_t *e = j->e;
  int n = t * TILE, end = n + TILE < e->N ? n + TILE : e->N, si = 0;
#ifdef QW_BUF
  if (tile_rows(j, n, end)) return;
#endif
  for (; n < end; n++) {
    while (n >= e->seg[si].n0 + e->seg[si].n) si++;
    qrow(&e->seg[si], n, j->in, j->alpha, j->beta, j->C, j->ldc);
  }
}

/* Claims and runs tiles of generation g until none are left (helper: count them). */
static void work_on(uint32_t g, int helper) {
  for (;;) {
    uint64_t v = __atomic_load_n(&pool_claim, __ATOMIC_ACQUIRE);
    if ((uint32_t)(v >> 32) != g) return;
    int t = (int)(uint32_t)v;
    if (t >= pool_job.tiles) return;
    const int n = pool_job.tiles - t < pool_job.span ? pool_job.tiles - t : pool_job.span;
    if (!__atomic_compare_exchange_n(&pool_claim, &v, v + n, 0, __ATOMIC_ACQ_REL,
                                     __ATOMIC_ACQUIRE))
      continue;
    for (int i = 0; i < n; i++) run_tile(&pool_job, t + i);
    if (helper) __atomic_fetch_add(&pool_helper_tiles, n, __ATOMIC_RELAXED);
    __atomic_fetch_add(&pool_done, n, __ATOMIC_RELEASE);
  }
}

/* jobs run through the pool, tiles the helpers did, helper threads */
void markbase_qw_pool_stats(long *out) {
  out[0] = __atomic_load_n(&pool_jobs, __ATOMIC_RELAXED);
  out[1] = __atomic_load_n(&pool_helper_tiles, __ATOMIC_RELAXED);
  out[2] = pool_helpers;
}

static double now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

static void *helper_main(void *arg) {
  (void)arg;
  uint32_t seen = __atomic_load_n(&pool_gen, __ATOMIC_ACQUIRE);
  for (;;) {
    double until = now_us() + q_spin_us;
    uint32_t g;
    while ((g = __atomic_load_n(&pool_gen, __ATOMIC_ACQUIRE)) == seen && now_us() < until)
      __builtin_ia32_pause();
    if (g == seen) {
      __atomic_fetch_add(&pool_sleepers, 1, __ATOMIC_ACQ_REL);
      syscall(SYS_futex, &pool_gen, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
      __atomic_fetch_sub(&pool_sleepers, 1, __ATOMIC_ACQ_REL);
      continue;
    }
    seen = g;
    work_on(g, 1);
  }
  return NULL;
}

static int pool_threads(void) {
  if (q_threads > 1) return q_threads;
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) return CPU_COUNT(&set);
  return 1;
}

static void pool_start(void) {
  pthread_mutex_lock(&pool_init_lock);
  if (!pool_started) {
    int want = pool_threads() - 1;
    for (int i = 0; i < want && i < 63; i++) {
      pthread_t th;
      pthread_attr_t at;
      pthread_attr_init(&at);
      pthread_attr_setstacksize(&at, 256 * 1024);
      if (pthread_create(&th, &at, helper_main, NULL) == 0) {
        pthread_detach(th);
        pool_helpers++;
      }
      pthread_attr_destroy(&at);
    }
    __atomic_store_n(&pool_started, 1, __ATOMIC_RELEASE);
  }
  pthread_mutex_unlock(&pool_init_lock);
}

/* Runs pool_job (set by the caller, who holds pool_lock) on the pool, the caller
   taking part, and releases the lock once every tile is done. */
static void pool_dispatch(void) {
  __atomic_store_n(&pool_done, 0, __ATOMIC_RELAXED);
  uint32_t g = pool_gen + 1;
  __atomic_store_n(&pool_claim, (uint64_t)g << 32, __ATOMIC_RELEASE);
  __atomic_store_n(&pool_gen, g, __ATOMIC_RELEASE);
  if (__atomic_load_n(&pool_sleepers, __ATOMIC_ACQUIRE))
    syscall(SYS_futex, &pool_gen, FUTEX_WAKE_PRIVATE, pool_helpers, NULL, NULL, 0);
  pool_jobs++;
  work_on(g, 0);
  while (__atomic_load_n(&pool_done, __ATOMIC_ACQUIRE) < pool_job.tiles) __builtin_ia32_pause();
  pthread_mutex_unlock(&pool_lock);
}

/* The pool's lock when the pool can take a job now (started here if need be); 0 when
   it has no helper, is set to one thread or is busy. */
static int pool_take(void) {
  if (!__atomic_load_n(&pool_started, __ATOMIC_ACQUIRE)) pool_start();
  return pool_helpers > 0 && q_threads != 1 && pthread_mutex_trylock(&pool_lock) == 0;
}

static void run_job(const qw_t *e, const qin_t *in, float alpha, float beta, float *C, int ldc) {
  const int tiles = (e->N + TILE - 1) / TILE;
  const long work = (long)e->N * e->K * (in->M < MT ? in->M : MT);
  if (work < 200000 || !pool_take()) {
    qjob_t j = {e, in, alpha, beta, C, ldc, tiles, 1};
    for (int t = 0; t < tiles; t++) run_tile(&j, t);
    return;
  }
  const int span = in->M <= MT ? claim_span(tiles, pool_helpers + 1) : 1;
  pool_job = (qjob_t){e, in, alpha, beta, C, ldc, tiles, span};
  pool_dispatch();
}

/* fn(arg, 0 .. parts - 1) on the pool, the caller taking part; 0 (nothing run) when
   the pool cannot take it now: the caller then runs the parts itself. */
static int pool_parts(void (*fn)(const void *, int), const void *arg, int parts) {
  if (!pool_take()) return 0;
  pool_job = (qjob_t){0};
  pool_job.fn = fn;
  pool_job.arg = arg;
  pool_job.tiles = parts;
  pool_job.span = 1;
  pool_dispatch();
  return 1;
}

static __thread float *q_buf; /* the calling thread's prepared inputs (qgemm) */
static __thread size_t q_cap;

static int qgemm(const qw_t *e, int M, const float *A, int lda, float alpha, float beta, float *C,
                 int ldc) {
  const int K = e->K;
  qin_t in = {M, K, A, lda};
  int i8 = q_act_i8; /* int8 inputs meet blocks of 32: groups of 16 keep float inputs */
  for (int i = 0; i < e->nseg; i++) i8 &= e->seg[i].gs != 16;
#ifdef MB_VNNI
  if (i8) {
    in.i8 = 1;
    in.nblk = K / 32;
    in.c4 = (in.nblk + 3) / 4;
    in.c8 = (in.nblk + 1) / 2;
    in.nblk16 = (in.nblk + 15) / 16 * 16;
    size_t bytes = (size_t)M * (2 * in.c4 * 64 + in.c8 * 64);
    size_t floats = (size_t)M * (in.c4 * 16 + in.c8 * 16 + in.nblk16);
    size_t need = floats + (bytes + 3) / 4;
    if (!grow(&q_buf, &q_cap, need)) return -1;
    in.d4 = q_buf;
    in.d8 = in.d4 + (size_t)M * in.c4 * 16;
    in.xs = in.d8 + (size_t)M * in.c8 * 16;
    in.qe = (int8_t *)(in.xs + (size_t)M * in.nblk16);
    in.qo = in.qe + (size_t)M * in.c4 * 64;
    in.q8 = in.qo + (size_t)M * in.c4 * 64;
    prep_i8(&in);
    run_job(e, &in, alpha, beta, C, ldc);
    __atomic_fetch_add(&q_hits, 1, __ATOMIC_RELAXED);
    return 0;
  }
#elif defined(MB_AVX2)
  if (i8 && e->K % 32 == 0) {
    in.i8 = 1;
    in.nblk = K / 32;
    size_t cells = (size_t)M * in.nblk;
    size_t need = 2 * cells + cells * 64 / 4; /* dx, sq (floats); x8, xn (32 bytes a cell) */
    if (!grow(&q_buf, &q_cap, need)) return -1;
    in.dx = q_buf;
    in.sq = in.dx + cells;
    in.x8 = (int8_t *)(in.sq + cells);
    in.xn = in.x8 + cells * 32;
    prep_i8_avx2(&in);
    run_job(e, &in, alpha, beta, C, ldc);
    __atomic_fetch_add(&q_hits, 1, __ATOMIC_RELAXED);
    return 0;
  }
#endif
  size_t need = (size_t)M * K;
  if (!grow(&q_buf, &q_cap, need)) return -1;
  in.xe = q_buf;
  in.xo = q_buf + (size_t)M * (K / 2);
  for (int m = 0; m < M; m++) {
    const float *x = A + (size_t)m * lda;
    float *xe = in.xe + (size_t)m * (K / 2), *xo = in.xo + (size_t)m * (K / 2);
    for (int j = 0; j < K / 2; j++) {
      xe[j] = x[2 * j];
      xo[j] = x[2 * j + 1];
    }
  }
  run_job(e, &in, alpha, beta, C, ldc);
  __atomic_fetch_add(&q_hits, 1, __ATOMIC_RELAXED);
  return 0;
}

/* For tests: the product through the quantized route regardless of M and the switch. */
int markbase_qw_matmul(const float *w, int N, int K, int M, const float *A, float *C) {
  const qw_t *e = qfind(w, N, K);
  if (!e) return -1;
  return qgemm(e, M, A, K, 1.0f, 0.0f, C, N);
}

/* ------------------------------------------------ decode attention's small products

   A decode step's attention multiplies, per row and KV head, a few query rows (the
   query heads of a group: M <= 16) by the row's keys [T x D] (C = Q K^T, N = T, K = D)
   and the probabilities by its values [T x D] (C = P V, K = T, N = D), D = head_dim.
   MLX calls sgemm once per (row, head): hundreds of tiny calls per step, for which
   OpenBLAS 0.3.21 packs the operands every time (measured ~4.5 GFLOP/s on a Zen 3;
   1b row batch of 16 at 256 positions spent ~40% of its step there). These loops read
   each operand once, in place. Only for M <= SMALL_M and head-sized D. */
#define SMALL_M 16
#define SMALL_D 256
static long n_small;
long markbase_blas_small_calls(void) { return n_small; }
static int small_on = 1;
void markbase_blas_set_small(int on) { small_on = on; }

static inline void store_c(float *c, float v, float alpha, float beta) {
  float y = alpha * v;
  *c = beta == 0.f ? y : y + beta * *c;
}


/* C[M x N] = alpha * A[M x K] * B[N x K]^T + beta * C (K <= SMALL_D). Each dot product
   is one chain of 8-lane FMAs over K, then a horizontal sum, whatever M and N: decode
   attention's scores (M = a group's query heads, often fewer than 4) take four key
   rows at a time, four independent chains, instead of one latency-bound chain. */
static void small_nt(int M, int N, int K, float alpha, const float *A, int lda, const float *B,
                     int ldb, float beta, float *C, int ldc) {
  int n = 0;
#if defined(MB_AVX2) || defined(MB_AVX512)
  if (K % 8 == 0)
    for (; n + 4 <= N; n += 4) {
      const float *b0 = B + (size_t)n * ldb, *b1 = b0 + ldb, *b2 = b1 + ldb, *b3 = b2 + ldb;
      for (int m = 0; m < M; m++) {
        const float *x = A + (size_t)m * lda;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int k = 0; k < K; k += 8) {
          const __m256 xv = _mm256_loadu_ps(x + k);
          a0 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(b0 + k), a0);
          a1 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(b1 + k), a1);
          a2 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(b2 + k), a2);
          a3 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(b3 + k), a3);
        }
        float *c = C + (size_t)m * ldc + n;
        store_c(c, hsum8(a0), alpha, beta);
        store_c(c + 1, hsum8(a1), alpha, beta);
        store_c(c + 2, hsum8(a2), alpha, beta);
        store_c(c + 3, hsum8(a3), alpha, beta);
      }
    }
#endif
  for (; n < N; n++) {
    const float *b = B + (size_t)n * ldb;
    int m = 0;
#if defined(MB_AVX2) || defined(MB_AVX512)
    if (K % 8 == 0)
      for (; m + 4 <= M; m += 4) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        const float *x = A + (size_t)m * lda;
        for (int k = 0; k < K; k += 8) {
          __m256 bv = _mm256_loadu_ps(b + k);
          a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), bv, a0);
          a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + lda + k), bv, a1);
          a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + 2 * (size_t)lda + k), bv, a2);
          a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + 3 * (size_t)lda + k), bv, a3);
        }
        store_c(C + (size_t)m * ldc + n, hsum8(a0), alpha, beta);
        store_c(C + (size_t)(m + 1) * ldc + n, hsum8(a1), alpha, beta);
        store_c(C + (size_t)(m + 2) * ldc + n, hsum8(a2), alpha, beta);
        store_c(C + (size_t)(m + 3) * ldc + n, hsum8(a3), alpha, beta);
      }
    if (K % 8 == 0)
      for (; m < M; m++) {
        __m256 a0 = _mm256_setzero_ps();
        const float *x = A + (size_t)m * lda;
        for (int k = 0; k < K; k += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), _mm256_loadu_ps(b + k), a0);
        store_c(C + (size_t)m * ldc + n, hsum8(a0), alpha, beta);
      }
#endif
    for (; m < M; m++) {
      const float *x = A + (size_t)m * lda;
      float acc = 0.f;
      for (int k = 0; k < K; k++) acc += x[k] * b[k];
      store_c(C + (size_t)m * ldc + n, acc, alpha, beta);
    }
  }
}

/* C[M x N] = alpha * A[M x K] * B[K x N] + beta * C (N <= SMALL_D). */
static void small_nn(int M, int N, int K, float alpha, const float *A, int lda, const float *B,
                     int ldb, float beta, float *C, int ldc) {
  for (int m = 0; m < M; m++) {
    const float *a = A + (size_t)m * lda;
    float *c = C + (size_t)m * ldc;
    int n0 = 0;
#if defined(MB_AVX2) || defined(MB_AVX512)
    for (; n0 + 64 <= N; n0 += 64) {
      __m256 acc[8];
      for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
      for (int k = 0; k < K; k++) {
        __m256 av = _mm256_set1_ps(a[k]);
        const float *b = B + (size_t)k * ldb + n0;
        for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(av, _mm256_loadu_ps(b + 8 * j), acc[j]);
      }
      float out[64];
      for (int j = 0; j < 8; j++) _mm256_storeu_ps(out + 8 * j, acc[j]);
      for (int j = 0; j < 64; j++) store_c(c + n0 + j, out[j], alpha, beta);
    }
#endif
    for (int n = n0; n < N; n++) {
      float acc = 0.f;
      for (int k = 0; k < K; k++) acc += a[k] * B[(size_t)k * ldb + n];
      store_c(c + n, acc, alpha, beta);
    }
  }
}

/* The attention's small products on the pool, from 65,536 multiply-adds a call (a
   group of 3 query heads of 64 against ~340 positions): Q K^T split by key rows (in
   fours), P V by query rows, every output computed as on one thread (the same bits).
   SmolLM2's lean step, the two forms alternated in one process (2 Zen 3 cores,
   2026-12-07): at 1,024 positions 1.00-1.05x at one row and 1.02-1.12x at 16; Gemma 3
   270M's (4 heads of 256) 1.00-1.04x. From 16,384 multiply-adds (256 positions
   pooled too) one row lost 2% and 16 rows gained 2-3%. */
static int small_par = 1;
void markbase_blas_set_small_par(int on) { small_par = on; }
#define SMALL_PAR_WORK 65536 /* multiply-adds below which one thread does it */
typedef struct {
  int nt, M, N, K, parts;
  float alpha, beta;
  const float *A, *B;
  float *C;
  int lda, ldb, ldc;
} small_job_t;
static void small_part(const void *p, int t) {
  const small_job_t *s = p;
  if (s->nt) {
    const int n0 = s->N * t / s->parts / 4 * 4;
    const int n1 = t + 1 == s->parts ? s->N : s->N * (t + 1) / s->parts / 4 * 4;
    if (n1 > n0)
      small_nt(s->M, n1 - n0, s->K, s->alpha, s->A, s->lda, s->B + (size_t)n0 * s->ldb, s->ldb,
               s->beta, s->C + n0, s->ldc);
  } else {
    const int m0 = s->M * t / s->parts, m1 = s->M * (t + 1) / s->parts;
    if (m1 > m0)
      small_nn(m1 - m0, s->N, s->K, s->alpha, s->A + (size_t)m0 * s->lda, s->lda, s->B, s->ldb,
               s->beta, s->C + (size_t)m0 * s->ldc, s->ldc);
  }
}
static void small_run(int nt, int M, int N, int K, float alpha, const float *A, int lda,
                      const float *B, int ldb, float beta, float *C, int ldc) {
  if (small_par && (long)M * N * K >= SMALL_PAR_WORK) {
    if (!__atomic_load_n(&pool_started, __ATOMIC_ACQUIRE)) pool_start();
    const int threads = pool_helpers + 1;
    const int parts = nt ? (N / 4 < threads ? N / 4 : threads) : (M < threads ? M : threads);
    small_job_t s = {nt, M, N, K, parts, alpha, beta, A, B, C, lda, ldb, ldc};
    if (parts > 1 && pool_parts(small_part, &s, parts)) return;
  }
  (nt ? small_nt : small_nn)(M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

/* Wall time the calling thread spends in the quantized route, for the decode step's
   breakdown (bench/cpu/step_bench.py): counted only between markbase_qw_timing(1), which
   also zeroes it, and markbase_qw_timing(0); off, it costs a product one branch. */
static int q_timing;
static double q_time_us;
void markbase_qw_timing(int on) {
  if (on) q_time_us = 0;
  q_timing = on;
}
double markbase_qw_time_us(void) { return q_time_us; }

/* ------------------------------------------------ decode attention's softmax

   MLX's CPU softmax runs its exp one element at a time (~20 ns): at 16 rows and 256
   positions a SmolLM2 step spent ~28 ms of ~200 in it. The lean decode step asks for
   the softmax inside the score product instead: ``mx.addmm(mask, q, k^T, alpha=A,
   beta=1)`` with A = markbase_softmax_alpha() (2^-100, which no model passes) comes
   here as C = softmax over each row of (A' B^T + C), A' = the unscaled product, so
   the mask is added first. The step checks at construction that MLX's matmuls reach
   this shim (a probe whose rows must sum to 1), else it keeps MLX's softmax. exp:
   Cephes' single-precision scheme with FMA (within 2 ulp), 0 below -87.3 (masked
   positions: exactly 0, as MLX's). */
#define MB_SOFTMAX_ALPHA 0x1p-100f
#define MB_EXP_FLOOR -87.3365478515625f /* below it exp is 0 here (float's smallest normal) */
float markbase_softmax_alpha(void) { return MB_SOFTMAX_ALPHA; }

#if defined(MB_AVX2) || defined(MB_AVX512)
static inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(MB_EXP_FLOOR), hi = _mm256_set1_ps(88.3762626647949f);
  const __m256 keep = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), keep);
}
#endif

static void softmax_row(float *c, int n) {
  float m = -INFINITY;
  for (int i = 0; i < n; i++) m = c[i] > m ? c[i] : m;
  float sum = 0.f;
  int i = 0;
#if defined(MB_AVX2) || defined(MB_AVX512)
  const __m256 mv = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(c + i), mv));
    _mm256_storeu_ps(c + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  sum = hsum8(acc);
#endif
  for (; i < n; i++) {
    c[i] = c[i] - m < MB_EXP_FLOOR ? 0.f : expf(c[i] - m);
    sum += c[i];
  }
  const float inv = 1.f / sum;
  for (i = 0; i < n; i++) c[i] *= inv;
}

void cblas_sgemm(int order, int ta, int tb, int M, int N, int K, float alpha,
                 const float *A, int lda, const float *B, int ldb, float beta,
                 float *C, int ldc) {
  if (!real_sgemm && markbase_blas_init(NULL) != 0) abort();
  if (alpha == MB_SOFTMAX_ALPHA && order == RowMajor) { /* decode attention: softmax(Q K^T + C) */
    if (ta == NoTrans && tb == Trans && M <= SMALL_M && K <= SMALL_D)
      small_run(1, M, N, K, 1.f, A, lda, B, ldb, beta, C, ldc);
    else
      real_sgemm(order, ta, tb, M, N, K, 1.f, A, lda, B, ldb, beta, C, ldc);
    for (int m = 0; m < M; m++) softmax_row(C + (size_t)m * ldc, N);
    return;
  }
  if (q_on && order == RowMajor && ta == NoTrans && tb == Trans && ldb == K && M > 0 &&
      M <= q_max_m && K % 32 == 0) {
    const qw_t *e = qfind(B, N, K);
    if (e) {
      const double t0 = q_timing ? now_us() : 0.0;
      if (qgemm(e, M, A, lda, alpha, beta, C, ldc) == 0) {
        if (q_timing) q_time_us += now_us() - t0;
        return;
      }
    }
  }
  if (small_on && order == RowMajor && ta == NoTrans && M > 0 && M <= SMALL_M && N > 0 && K > 0) {
    if (tb == Trans && K <= SMALL_D) {
      n_small++;
      small_run(1, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
      return;
    }
    if (tb == NoTrans && N <= SMALL_D) {
      n_small++;
      small_run(0, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
      return;
    }
  }
  if (use_gemv && order == RowMajor && M == 1 && N > 1 && K > 0 &&
      (long)N * (long)K >= gemv_min_elems) {
    /* C[1 x N] = alpha * op(A)[1 x K] * op(B)[K x N] + beta * C */
    int incx = (ta == NoTrans) ? 1 : lda;
    if (beta == 0.0f) memset(C, 0, sizeof(float) * (size_t)N);
    n_gemv++;
    use_threads(gemv_threads);
    if (tb == Trans) /* B is N x K */
      real_sgemv(RowMajor, NoTrans, N, K, alpha, B, ldb, A, incx, beta, C, 1);
    else /* B is K x N */
      real_sgemv(RowMajor, Trans, K, N, alpha, B, ldb, A, incx, beta, C, 1);
    return;
  }
  n_gemm++;
  use_threads(M < small_m ? small_gemm_threads : gemm_threads);
  real_sgemm(order, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}
