/* A llama-form decode step in one call (engine/backends/cpu/native_step.py).

   Compiled after blas_shim.c into the same library (engine/backends/cpu/blas.py joins
   the two sources), so it calls the shim's own routes: every weight product goes
   through cblas_sgemm, which finds the weight's quantized copy by address and runs
   the same kernel on the same thread pool as MLX's matmuls do in the lean step (the
   same bits); the attention's score product with the softmax alpha, and its value
   product, take the shim's small-product loops as the lean step's do.

   Why: at one to a few rows a small model's step is mostly not arithmetic. The lean
   step (step.py) builds ~30 MLX nodes a layer from Python; each costs ~5 us of
   dispatch on MLX's CPU stream, Python's graph building competes with the products'
   second thread for the two cores, and the products' helper thread sleeps between
   products. Here a layer is a few loops over [B, D] rows and five products, run back
   to back on the calling thread (the Python interpreter's lock released).

   Per row b: keys and values at time indices [start[b], t_new] of each layer's
   buffers, the new token's written at t_new; the row's attention reads only its own
   keys, so a row's result does not depend on the other rows or on its padding. */

typedef struct {
  const float *attn_norm, *mlp_norm; /* [D] */
  const float *w_qkv, *w_o, *w_gu, *w_down; /* float32 weights [N, K], row-major */
  float *k, *v;                             /* the layer's KV buffers */
  long kb, kh, kt, vb, vh, vt;              /* their strides (floats): row, head, time */
  const int *start; /* [B]: each row's first time index the new token attends to */
  int t_new;        /* the time index the new token's keys go to */
  int rope;         /* which RoPE setting's cos/sin (0 or 1) */
  /* Gemma 3 only (else NULL): the query/key head norms, the norms after the
     attention and after the MLP (their weights as 1 + w) */
  const float *q_norm, *k_norm, *post_attn_norm, *post_mlp_norm;
} mb_layer_t;

typedef struct {
  int B, D, n_heads, n_kv, head_dim, inter, vocab, n_layers, traditional;
  int n_embed;       /* rows of the embedding table (token ids are checked against it) */
  int gemma;         /* Gemma 3's layer form: sandwich norms, head norms, GELU-tanh MLP */
  float eps, embed_scale; /* the embedding times embed_scale (Gemma 3; 1 for llama) */
  const float *embed;      /* [vocab, D] */
  const float *final_norm; /* [D] */
  const float *head_w;     /* [vocab, D] */
  const int *tokens;       /* [B] */
  float scale;             /* the attention scale, folded into the queries' RoPE */
  const float *cs[2], *sn[2]; /* [B, head_dim] per RoPE setting: each row's factors
                                 (Gemma 3: local and global layers) */
  float *logits;           /* [B, vocab] */
  const mb_layer_t *layers;
} mb_step_t;

static __thread float *s_work, *s_scores;
static __thread size_t s_work_cap, s_scores_cap;

static void rms_rows(const float *x, const float *w, float eps, int B, int D, float *y) {
  for (int b = 0; b < B; b++) {
    const float *xr = x + (size_t)b * D;
    float *yr = y + (size_t)b * D;
    float ss = 0.f;
    int i = 0;
#if defined(MB_AVX2) || defined(MB_AVX512)
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= D; i += 8) {
      const __m256 v = _mm256_loadu_ps(xr + i);
      acc = _mm256_fmadd_ps(v, v, acc);
    }
    ss = hsum8(acc);
#endif
    for (; i < D; i++) ss += xr[i] * xr[i];
    const float r = 1.f / sqrtf(ss / (float)D + eps);
    for (i = 0; i < D; i++) yr[i] = w[i] * (xr[i] * r);
  }
}

/* v = v * C + swap(v) * S over the query and key heads of each row (``swap``
   exchanges the two members of each rotated pair: neighbours for "traditional" RoPE,
   the two halves of a head otherwise), C and S the row's cos and sin factors, times
   the attention scale for the query heads (engine/backends/cpu/step.py's tables). */
static void rope_rows(float *qkv, const float *cs, const float *sn, float scale, int B,
                      int n_q, int n_k, int stride, int hd, int traditional) {
  const int half = hd / 2;
  float tmp[512], cq[512], sq[512];
  for (int b = 0; b < B; b++) {
    float *row = qkv + (size_t)b * stride;
    const float *c = cs + (size_t)b * hd, *s = sn + (size_t)b * hd;
    for (int j = 0; j < hd; j++) {
      cq[j] = c[j] * scale;
      sq[j] = s[j] * scale;
    }
    for (int h = 0; h < n_q + n_k; h++) {
      float *v = row + (size_t)h * hd;
      const float *ch = h < n_q ? cq : c, *sh = h < n_q ? sq : s;
      memcpy(tmp, v, sizeof(float) * hd);
      for (int j = 0; j < hd; j++) {
        const int o = traditional ? (j ^ 1) : (j < half ? j + half : j - half);
        v[j] = tmp[j] * ch[j] + tmp[o] * sh[j];
      }
    }
  }
}

/* The gated MLP's activation, g * u / (1 + exp(-z)), from the fused gate|up rows:
   SiLU (z = g) or, with ``gelu``, gelu_approx(g) * u as g * u * sigmoid(2 c (g +
   0.044715 g^3)), c = sqrt(2 / pi) (engine/backends/cpu/fast_math.py's forms). */
static void glu_rows(const float *gu, int B, int I, int gelu, float *out) {
  const float c2 = 1.5957691216057308f;
  for (int b = 0; b < B; b++) {
    const float *g = gu + (size_t)b * 2 * I, *u = g + I;
    float *o = out + (size_t)b * I;
    int i = 0;
#if defined(MB_AVX2) || defined(MB_AVX512)
    const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
    const __m256 k = _mm256_set1_ps(0.044715f), nc2 = _mm256_set1_ps(-c2);
    for (; i + 8 <= I; i += 8) {
      const __m256 gv = _mm256_loadu_ps(g + i);
      __m256 nz = _mm256_sub_ps(zero, gv);
      if (gelu)
        nz = _mm256_mul_ps(
            nc2, _mm256_add_ps(gv, _mm256_mul_ps(_mm256_mul_ps(k, gv), _mm256_mul_ps(gv, gv))));
      _mm256_storeu_ps(o + i, _mm256_div_ps(_mm256_mul_ps(gv, _mm256_loadu_ps(u + i)),
                                            _mm256_add_ps(one, exp8(nz))));
    }
#endif
    for (; i < I; i++) {
      const float nz = gelu ? -c2 * (g[i] + 0.044715f * g[i] * g[i] * g[i]) : -g[i];
      o[i] = g[i] * u[i] / (1.f + expf(nz));
    }
  }
}

typedef struct {
  const mb_step_t *s;
  const mb_layer_t *L;
  const float *qkv;
  float *out; /* [B, nq] */
  int oom;    /* a task could not grow its scratch (set by any thread) */
} attn_job_t;

/* Row b = task / n_kv, KV head h = task % n_kv: its G query heads against the row's
   keys, softmax inside the score product, then the values. */
static void attn_task(const void *p, int task) {
  const attn_job_t *a = p;
  const mb_step_t *s = a->s;
  const mb_layer_t *L = a->L;
  const int b = task / s->n_kv, h = task % s->n_kv, hd = s->head_dim;
  const int G = s->n_heads / s->n_kv, nq = s->n_heads * hd, nk = s->n_kv * hd;
  const int t0 = L->start[b], T = L->t_new + 1 - t0;
  if (!grow(&s_scores, &s_scores_cap, (size_t)G * T)) {
    __atomic_store_n(&((attn_job_t *)p)->oom, 1, __ATOMIC_RELAXED);
    return;
  }
  const float *q = a->qkv + (size_t)b * (nq + 2 * nk) + (size_t)h * G * hd;
  const float *K = L->k + b * L->kb + h * L->kh + t0 * L->kt;
  const float *V = L->v + b * L->vb + h * L->vh + t0 * L->vt;
  cblas_sgemm(RowMajor, NoTrans, Trans, G, T, hd, MB_SOFTMAX_ALPHA, q, hd, K, (int)L->kt, 0.f,
              s_scores, T);
  cblas_sgemm(RowMajor, NoTrans, NoTrans, G, hd, T, 1.f, s_scores, T, V, (int)L->vt, 0.f,
              a->out + (size_t)b * nq + (size_t)h * G * hd, hd);
}

/* x += a @ w^T, with ``norm`` (Gemma 3's sandwich norm) applied to the product first
   when given; without it the product adds itself to x (beta = 1, the lean step's
   ``addmm``). a: [B, K], w: [D, K], tmp: [B, D] scratch. */
static void add_product(float *x, const float *a, const float *w, const float *norm, float eps,
                        int B, int D, int K, float *tmp) {
  if (!norm) {
    cblas_sgemm(RowMajor, NoTrans, Trans, B, D, K, 1.f, a, K, w, K, 1.f, x, D);
    return;
  }
  cblas_sgemm(RowMajor, NoTrans, Trans, B, D, K, 1.f, a, K, w, K, 0.f, tmp, D);
  rms_rows(tmp, norm, eps, B, D, tmp);
  for (size_t i = 0; i < (size_t)B * D; i++) x[i] += tmp[i];
}

int markbase_decode_step(const mb_step_t *s) {
  const int B = s->B, D = s->D, hd = s->head_dim, I = s->inter;
  const int nq = s->n_heads * hd, nk = s->n_kv * hd, nqkv = nq + 2 * nk;
  if (hd > 512 || s->n_heads % s->n_kv) return -1;
  for (int b = 0; b < B; b++)
    if (s->tokens[b] < 0 || s->tokens[b] >= s->n_embed) return -3;
  const size_t need = (size_t)B * (3 * D + nqkv + nq + 3 * I);
  if (!grow(&s_work, &s_work_cap, need)) return -2;
  float *x = s_work, *xn = x + (size_t)B * D, *tmp = xn + (size_t)B * D;
  float *qkv = tmp + (size_t)B * D, *att = qkv + (size_t)B * nqkv, *gu = att + (size_t)B * nq;
  float *act = gu + (size_t)B * 2 * I;
  for (int b = 0; b < B; b++) { /* (times 1 for llama: the same values) */
    const float *e = s->embed + (size_t)s->tokens[b] * D;
    for (int i = 0; i < D; i++) x[(size_t)b * D + i] = e[i] * s->embed_scale;
  }
  const int tasks = B * s->n_kv;
  for (int l = 0; l < s->n_layers; l++) {
    const mb_layer_t *L = s->layers + l;
    rms_rows(x, L->attn_norm, s->eps, B, D, xn);
    cblas_sgemm(RowMajor, NoTrans, Trans, B, nqkv, D, 1.f, xn, D, L->w_qkv, D, 0.f, qkv, nqkv);
    if (L->q_norm)
      for (int b = 0; b < B; b++) {
        float *r = qkv + (size_t)b * nqkv;
        rms_rows(r, L->q_norm, s->eps, s->n_heads, hd, r);
        rms_rows(r + nq, L->k_norm, s->eps, s->n_kv, hd, r + nq);
      }
    rope_rows(qkv, s->cs[L->rope], s->sn[L->rope], s->scale, B, s->n_heads, s->n_kv, nqkv, hd,
              s->traditional);
    long work = 0;
    for (int b = 0; b < B; b++) {
      work += (long)(L->t_new + 1 - L->start[b]);
      for (int h = 0; h < s->n_kv; h++) {
        const float *kr = qkv + (size_t)b * nqkv + nq + (size_t)h * hd;
        memcpy(L->k + b * L->kb + h * L->kh + (long)L->t_new * L->kt, kr, sizeof(float) * hd);
        memcpy(L->v + b * L->vb + h * L->vh + (long)L->t_new * L->vt, kr + nk, sizeof(float) * hd);
      }
    }
    work *= (long)s->n_heads * hd;
    attn_job_t job = {s, L, qkv, att, 0};
    /* the (row, head) tasks on the pool when there is enough work to share */
    if (!(tasks > 1 && work >= SMALL_PAR_WORK && pool_parts(attn_task, &job, tasks)))
      for (int t = 0; t < tasks; t++) attn_task(&job, t);
    if (__atomic_load_n(&job.oom, __ATOMIC_RELAXED)) return -2;
    add_product(x, att, L->w_o, L->post_attn_norm, s->eps, B, D, nq, tmp);
    rms_rows(x, L->mlp_norm, s->eps, B, D, xn);
    cblas_sgemm(RowMajor, NoTrans, Trans, B, 2 * I, D, 1.f, xn, D, L->w_gu, D, 0.f, gu, 2 * I);
    glu_rows(gu, B, I, s->gemma, act);
    add_product(x, act, L->w_down, L->post_mlp_norm, s->eps, B, D, I, tmp);
  }
  rms_rows(x, s->final_norm, s->eps, B, D, xn);
  cblas_sgemm(RowMajor, NoTrans, Trans, B, s->vocab, D, 1.f, xn, D, s->head_w, D, 0.f, s->logits,
              s->vocab);
  return 0;
}
