/*
 * Sharded versions and refit plans against a real gpupoold (host backend): trainer ranks
 * (each its own connection, or its own process) publish their slices of a Llama-shaped model
 * as parts of a version; the version is seen only once every part is in; engines of tensor-
 * parallel degree 1, 2 and 4 refit their own tensors (fused qkv and gate_up, column-parallel;
 * row-parallel o and down; vocab-parallel embedding; a replicated norm) in place, with casts;
 * a rank that dies mid-publish leaves no version and nothing held; a reader killed mid-refit
 * leaves nothing held; 1,000 refits replay one plan and leave the daemon as they found it.
 */
#include <signal.h>

#include <gpupool/refit.h>

#include "harness.h"

static th_daemon D;

static int setup(void **state) {
  *state = &D;
  th_prepare(&D);
  th_write_conf(&D, "[daemon]\nmax_pending_versions_per_uid = 6\n[pool default]\nkind = host\ncapacity = 256M\nslab_size = 4M\n");
  th_start(&D, 1, NULL);
  return 0;
}

static int teardown(void **state) { return th_teardown(state); }

/* ---- the model: global tensors and where their elements come from ---------------------------- */

enum { H = 12, NQ = 16, NKV = 8, FF = 20, VOCAB = 32, NKEYS = 9 };
enum { COL = 0, ROW = 1, REP = 2 }; /* how a tensor-parallel trainer splits a key */

static const struct {
  const char *key;
  int ndim;
  int64_t shape[2];
  int tp; /* COL: dim 0, ROW: dim 1, REP: whole on every rank */
} K[NKEYS] = {
    {"q", 2, {NQ, H}, COL},      {"k", 2, {NKV, H}, COL},   {"v", 2, {NKV, H}, COL},
    {"o", 2, {H, NQ}, ROW},      {"gate", 2, {FF, H}, COL}, {"up", 2, {FF, H}, COL},
    {"down", 2, {H, FF}, ROW},   {"norm", 1, {H, 0}, REP},  {"embed", 2, {VOCAB, H}, COL},
};

/* Element (i, j) of key k at version v: exact in bfloat16 and float16 (a multiple of 1/8 below
 * 32), different for every element, key and version. */
static float value(int k, int64_t i, int64_t j, uint64_t v) {
  return (float)((k * 131 + i * 17 + j * 7 + (int64_t)v * 3) % 256) / 8.0f;
}

/* A value that needs rounding in bfloat16 (for the cast from float32). */
static float fine_value(int k, int64_t i, int64_t j, uint64_t v) { return value(k, i, j, v) + 0.0013f * (float)(j + 1); }

static uint16_t bf16_of(float f) {
  uint32_t x;
  memcpy(&x, &f, 4);
  return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

static float f32_of_bf16(uint16_t b) {
  uint32_t x = (uint32_t)b << 16;
  float f;
  memcpy(&f, &x, 4);
  return f;
}

static uint16_t f16_of(float f) { /* exact values only: normal halfs */
  uint32_t x;
  memcpy(&x, &f, 4);
  if (f == 0.0f)
    return 0;
  return (uint16_t)(((x >> 16) & 0x8000u) | ((((x >> 23) & 0xff) - 112) << 10) | ((x & 0x7fffffu) >> 13));
}

static void meta_of(gpupool_tensor_meta *m, int code, int bits, int ndim, const int64_t *shape) {
  memset(m, 0, sizeof *m);
  m->dtype_code = (uint8_t)code;
  m->dtype_bits = (uint8_t)bits;
  m->dtype_lanes = 1;
  m->ndim = ndim;
  for (int i = 0; i < ndim; i++)
    m->shape[i] = shape[i];
}

/* The slice of key k rank r of `world` holds: scheme 0 = FSDP (dim 0, uneven chunks of
 * ceil(n / world), the last ones shorter or empty), 1 = tensor parallel (K[k].tp). */
static int slice_of(int k, int scheme, int r, int world, int64_t *start, int64_t *shape) {
  int d = scheme == 0 ? 0 : K[k].tp == ROW ? 1 : 0;
  for (int i = 0; i < K[k].ndim; i++) {
    start[i] = 0;
    shape[i] = K[k].shape[i];
  }
  if (scheme == 1 && K[k].tp == REP)
    return 1;
  int64_t n = K[k].shape[d], chunk = scheme == 0 ? (n + world - 1) / world : n / world;
  start[d] = chunk * r < n ? chunk * r : n;
  shape[d] = start[d] + chunk <= n ? chunk : n - start[d];
  return shape[d] > 0;
}

/* Why the last publish_rank failed. */
static char publish_why[512];
/* publish_rank publishes the members in place (gpupool_bundle_publish_members_part), not the
 * bundle. */
static int publish_inplace;

/* Rank r's part of version v through c: its slices of every key in dtype (32: float32, 16:
 * bfloat16, with fine values when fine). Returns publish_part's code; *complete as it says. */
static int publish_rank(gpupool_client *c, const char *name, int scheme, int r, int world, uint64_t v, int bits,
                        int fine, int *complete) {
  gpupool_member_spec spec[NKEYS];
  gpupool_tensor_meta meta[NKEYS];
  char names[NKEYS][GPUPOOL_NAME_MAX + 1];
  int64_t start[NKEYS][2], shape[NKEYS][2];
  int n = 0, keyof[NKEYS], rc;
  gpupool_bundle *b;
  for (int k = 0; k < NKEYS; k++) {
    if (!slice_of(k, scheme, r, world, start[n], shape[n]))
      continue;
    if ((rc = gpupool_shard_member_name(names[n], sizeof names[n], K[k].key, r, K[k].ndim, K[k].shape, start[n],
                                        shape[n])) != 0)
      return rc;
    meta_of(&meta[n], bits == 32 ? GPUPOOL_DTYPE_FLOAT : GPUPOOL_DTYPE_BFLOAT, bits, K[k].ndim, shape[n]);
    spec[n].name = names[n];
    spec[n].meta = &meta[n];
    spec[n].size = (uint64_t)(shape[n][0] * (K[k].ndim == 2 ? shape[n][1] : 1)) * (uint64_t)bits / 8;
    keyof[n++] = k;
  }
  if ((rc = gpupool_bundle_alloc(c, NULL, spec, n, 0, 1000, NULL, &b)) != 0)
    return rc;
  for (int m = 0; m < n; m++) {
    gpupool_member mb;
    int k = keyof[m];
    int64_t cols = K[k].ndim == 2 ? shape[m][1] : 1;
    gpupool_bundle_member(b, m, &mb);
    for (int64_t i = 0; i < shape[m][0]; i++)
      for (int64_t j = 0; j < cols; j++) {
        int64_t gi = start[m][0] + i, gj = K[k].ndim == 2 ? start[m][1] + j : 0;
        float f = K[k].ndim == 2 ? (fine ? fine_value(k, gi, gj, v) : value(k, gi, gj, v))
                                 : (fine ? fine_value(k, 0, gi, v) : value(k, 0, gi, v));
        if (bits == 32) {
          ((float *)mb.ptr)[i * cols + j] = f;
        } else {
          ((uint16_t *)mb.ptr)[i * cols + j] = bf16_of(f);
        }
      }
  }
  if (publish_inplace) {
    gpupool_member_ref refs[NKEYS];
    for (int m = 0; m < n; m++) {
      gpupool_member mb;
      gpupool_bundle_member(b, m, &mb);
      refs[m] = (gpupool_member_ref){names[m], gpupool_bundle_buffer(b, mb.buffer), mb.offset, mb.size, &meta[m]};
    }
    rc = gpupool_bundle_publish_members_part(c, name, v, r, world, refs, n, NULL, complete);
  } else {
    rc = gpupool_bundle_publish_part(b, name, v, r, world, NULL, complete);
  }
  snprintf(publish_why, sizeof publish_why, "%s", rc ? gpupool_last_error() : "");
  gpupool_bundle_release(b, NULL);
  return rc;
}

/* ---- the engine: a tensor-parallel rank's own tensors ------------------------------------------- */

enum { T_QKV, T_O, T_GATE_UP, T_DOWN, T_NORM, T_EMBED, NT };

typedef struct {
  int tp, rank;
  int code, bits;
  void *mem[NT];
  gpupool_refit_target t[NT];
  gpupool_refit_piece pieces[NT][3];
} engine;

static void piece(gpupool_refit_piece *p, const char *key, int64_t s0, int64_t s1, int64_t len) {
  memset(p, 0, sizeof *p);
  p->key = key;
  p->start[0] = s0;
  p->start[1] = s1;
  p->length = len;
}

/* Engine rank `rank` of degree tp, tensors of dtype (code, bits). */
static void engine_init(engine *e, int tp, int rank, int code, int bits) {
  int64_t q = NQ / tp, kv = NKV / tp, ff = FF / tp, voc = VOCAB / tp;
  int64_t shapes[NT][2] = {{q + 2 * kv, H}, {H, q}, {2 * ff, H}, {H, ff}, {H, 0}, {voc, H}};
  int ndims[NT] = {2, 2, 2, 2, 1, 2};
  memset(e, 0, sizeof *e);
  e->tp = tp;
  e->rank = rank;
  e->code = code;
  e->bits = bits;
  piece(&e->pieces[T_QKV][0], "q", q * rank, 0, q);
  piece(&e->pieces[T_QKV][1], "k", kv * rank, 0, kv);
  piece(&e->pieces[T_QKV][2], "v", kv * rank, 0, kv);
  piece(&e->pieces[T_O][0], "o", 0, q * rank, 0);
  piece(&e->pieces[T_GATE_UP][0], "gate", ff * rank, 0, ff);
  piece(&e->pieces[T_GATE_UP][1], "up", ff * rank, 0, ff);
  piece(&e->pieces[T_DOWN][0], "down", 0, ff * rank, 0);
  piece(&e->pieces[T_NORM][0], "norm", 0, 0, 0);
  piece(&e->pieces[T_EMBED][0], "embed", voc * rank, 0, 0);
  int npieces[NT] = {3, 1, 2, 1, 1, 1}, dims[NT] = {0, 1, 0, 1, 0, 0};
  for (int i = 0; i < NT; i++) {
    size_t n = (size_t)(shapes[i][0] * (ndims[i] == 2 ? shapes[i][1] : 1));
    e->mem[i] = calloc(n, (size_t)bits / 8);
    assert_non_null(e->mem[i]);
    e->t[i].ptr = e->mem[i];
    meta_of(&e->t[i].meta, code, bits, ndims[i], shapes[i]);
    e->t[i].dim = dims[i];
    e->t[i].pieces = e->pieces[i];
    e->t[i].npieces = npieces[i];
  }
}

static void engine_free(engine *e) {
  for (int i = 0; i < NT; i++)
    free(e->mem[i]);
}

static float engine_at(const engine *e, int t, int64_t i, int64_t j) {
  int64_t cols = e->t[t].meta.ndim == 2 ? e->t[t].meta.shape[1] : 1;
  const char *p = (const char *)e->mem[t] + (size_t)(i * cols + j) * (size_t)(e->bits / 8);
  uint16_t u;
  float f;
  if (e->bits == 32) {
    memcpy(&f, p, 4);
    return f;
  }
  memcpy(&u, p, 2);
  return e->code == GPUPOOL_DTYPE_BFLOAT ? f32_of_bf16(u) : (float)u; /* float16 compared as bits below */
}

static int key_index(const char *key) {
  for (int k = 0; k < NKEYS; k++)
    if (!strcmp(K[k].key, key))
      return k;
  return -1;
}

/* What element (i, j) of target t should hold at version v: the global element it maps to,
 * in the engine's dtype. */
static int engine_ok(const engine *e, uint64_t v, int fine, char *why, size_t whylen) {
  for (int t = 0; t < NT; t++) {
    const gpupool_refit_target *tg = &e->t[t];
    int nd = tg->meta.ndim;
    int64_t rows = tg->meta.shape[0], cols = nd == 2 ? tg->meta.shape[1] : 1;
    for (int64_t i = 0; i < rows; i++)
      for (int64_t j = 0; j < cols; j++) {
        /* Which piece: walk along dim. */
        int64_t along = tg->dim == 0 ? i : j, pos = 0, gi = 0, gj = 0;
        int k = -1;
        for (int p = 0; p < tg->npieces; p++) {
          int64_t len = tg->pieces[p].length ? tg->pieces[p].length : tg->meta.shape[tg->dim] - pos;
          if (along < pos + len) {
            k = key_index(tg->pieces[p].key);
            gi = tg->pieces[p].start[0] + (tg->dim == 0 ? i - pos : i);
            gj = tg->pieces[p].start[1] + (tg->dim == 1 ? j - pos : j);
            break;
          }
          pos += len;
        }
        float want = nd == 2 ? (fine ? fine_value(k, gi, gj, v) : value(k, gi, gj, v))
                             : (fine ? fine_value(k, 0, gi, v) : value(k, 0, gi, v));
        float got = engine_at(e, t, i, j);
        if (e->bits == 16 && e->code == GPUPOOL_DTYPE_BFLOAT)
          want = f32_of_bf16(bf16_of(want));
        if (e->bits == 16 && e->code == GPUPOOL_DTYPE_FLOAT)
          want = (float)f16_of(want);
        if (got != want) {
          snprintf(why, whylen, "tp %d rank %d target %d (%lld, %lld): %g, want %g (version %llu)", e->tp, e->rank,
                   t, (long long)i, (long long)j, (double)got, (double)want, (unsigned long long)v);
          return 0;
        }
      }
  }
  return 1;
}

static void check_engine(const engine *e, uint64_t v, int fine) {
  char why[256];
  if (!engine_ok(e, v, fine, why, sizeof why))
    fail_msg("%s", why);
}

/* Publish version v of name from `world` ranks (one connection each), checking that the
 * version is not seen before its last part. */
static void publish_version(const char *name, int scheme, int world, uint64_t v, int bits, int fine) {
  gpupool_client *c[8];
  for (int r = 0; r < world; r++)
    c[r] = th_connect(&D, "rank");
  for (int r = world - 1; r >= 0; r--) {
    int complete = -1, rc = publish_rank(c[r], name, scheme, r, world, v, bits, fine, &complete);
    if (rc != 0)
      fail_msg("rank %d: %s: %s", r, gpupool_err_name(rc), gpupool_last_error());
    assert_int_equal(complete, r == 0);
    if (r > 0) { /* not yet: the reader sees the previous version or none */
      gpupool_bundle *b = NULL;
      rc = gpupool_bundle_get(c[0], name, v - 1, 0, GPUPOOL_READ_ONLY, NULL, &b);
      assert_int_equal(rc, GPUPOOL_ENOENT);
    }
  }
  for (int r = 0; r < world; r++)
    gpupool_client_disconnect(c[r]);
}

/* Refit engines of degree tp (every rank) from version v of name, and check them. */
static void refit_engines(const char *name, int tp, uint64_t v, int code, int bits, int fine) {
  gpupool_client *c = th_connect(&D, "engine");
  gpupool_bundle *b;
  assert_int_equal(gpupool_bundle_get(c, name, v - 1, 5000, GPUPOOL_READ_ONLY, NULL, &b), 0);
  assert_int_equal(gpupool_bundle_version(b), v);
  for (int r = 0; r < tp; r++) {
    engine e;
    gpupool_plan *p;
    gpupool_plan_info info;
    engine_init(&e, tp, r, code, bits);
    void *before[NT];
    memcpy(before, e.mem, sizeof before);
    int rc = gpupool_refit_plan(b, e.t, NT, 0, &p);
    if (rc != 0)
      fail_msg("plan tp %d rank %d: %s", tp, r, gpupool_last_error());
    assert_int_equal(gpupool_refit(p, b, NULL), 0);
    assert_memory_equal(before, e.mem, sizeof before); /* in place */
    check_engine(&e, v, fine);
    assert_int_equal(gpupool_plan_info_get(p, &info), 0);
    assert_int_equal(info.plans, 1);
    assert_int_equal(info.refits, 1);
    assert_true(info.copies > 0);
    gpupool_plan_free(p);
    engine_free(&e);
  }
  gpupool_bundle_release(b, NULL);
  gpupool_client_disconnect(c);
}

/* ---- the cases -------------------------------------------------------------------------------------- */

static void test_fsdp_to_tp(void **state) {
  (void)state;
  /* 4 ranks (even for most keys) and 3 (uneven: chunks of 6, 6, 4 rows of q; 3, 3, 2 of k). */
  publish_version("fsdp4", 0, 4, 1, 32, 0);
  publish_version("fsdp3", 0, 3, 1, 32, 0);
  for (int tp = 1; tp <= 4; tp *= 2) {
    refit_engines("fsdp4", tp, 1, GPUPOOL_DTYPE_FLOAT, 32, 0);
    refit_engines("fsdp3", tp, 1, GPUPOOL_DTYPE_FLOAT, 32, 0);
  }
  /* FSDP over more ranks than some keys have rows: empty ranks publish nothing of them. */
  publish_version("fsdp8", 0, 8, 1, 32, 0);
  refit_engines("fsdp8", 4, 1, GPUPOOL_DTYPE_FLOAT, 32, 0);
}

static void test_tp_to_tp(void **state) {
  (void)state;
  /* A tensor-parallel trainer of degree 2 (norm whole on both ranks) into engines of 1 and 4. */
  publish_version("tp2", 1, 2, 1, 32, 0);
  refit_engines("tp2", 1, 1, GPUPOOL_DTYPE_FLOAT, 32, 0);
  refit_engines("tp2", 4, 1, GPUPOOL_DTYPE_FLOAT, 32, 0);
  /* Members published in place from buffers the ranks hold (no bundle publish). */
  publish_inplace = 1;
  publish_version("tp4", 1, 4, 1, 32, 0);
  publish_inplace = 0;
  refit_engines("tp4", 2, 1, GPUPOOL_DTYPE_FLOAT, 32, 0);
}

static void test_casts(void **state) {
  (void)state;
  /* bfloat16 shards into float32 and float16 engines (exact values), float32 shards with
   * values that need rounding into a bfloat16 engine (rounded to nearest even). */
  publish_version("bf16", 0, 2, 1, 16, 0);
  refit_engines("bf16", 2, 1, GPUPOOL_DTYPE_FLOAT, 32, 0);
  refit_engines("bf16", 2, 1, GPUPOOL_DTYPE_FLOAT, 16, 0);
  publish_version("fine", 0, 2, 1, 32, 1);
  refit_engines("fine", 2, 1, GPUPOOL_DTYPE_BFLOAT, 16, 1);
  /* No cast between an integer and a float: refused with the reason, nothing planned. */
  gpupool_client *c = th_connect(&D, "engine");
  gpupool_bundle *b;
  engine e;
  gpupool_plan *p = NULL;
  assert_int_equal(gpupool_bundle_get(c, "fine", 0, 5000, GPUPOOL_READ_ONLY, NULL, &b), 0);
  engine_init(&e, 2, 0, GPUPOOL_DTYPE_INT, 32);
  assert_int_equal(gpupool_refit_plan(b, e.t, NT, 0, &p), GPUPOOL_EINVAL);
  assert_null(p);
  assert_non_null(strstr(gpupool_last_error(), "no cast"));
  engine_free(&e);
  gpupool_bundle_release(b, NULL);
  gpupool_client_disconnect(c);
}

static void test_bad_targets(void **state) {
  (void)state;
  gpupool_client *c = th_connect(&D, "engine");
  gpupool_bundle *b;
  engine e;
  gpupool_plan *p = NULL;
  publish_version("bad", 0, 2, 1, 32, 0);
  assert_int_equal(gpupool_bundle_get(c, "bad", 0, 5000, GPUPOOL_READ_ONLY, NULL, &b), 0);
  /* A slice past the global tensor, a key the version lacks, pieces that do not fill the target. */
  engine_init(&e, 2, 1, GPUPOOL_DTYPE_FLOAT, 32);
  e.pieces[T_QKV][0].start[0] = NQ - 2;
  assert_int_equal(gpupool_refit_plan(b, e.t, NT, 0, &p), GPUPOOL_EINVAL);
  assert_non_null(strstr(gpupool_last_error(), "outside"));
  engine_free(&e);
  engine_init(&e, 2, 1, GPUPOOL_DTYPE_FLOAT, 32);
  e.pieces[T_NORM][0].key = "ln_f";
  assert_int_equal(gpupool_refit_plan(b, e.t, NT, 0, &p), GPUPOOL_EINVAL);
  assert_non_null(strstr(gpupool_last_error(), "no tensor 'ln_f'"));
  engine_free(&e);
  engine_init(&e, 2, 1, GPUPOOL_DTYPE_FLOAT, 32);
  e.t[T_QKV].npieces = 2; /* q and k only: v's rows left over */
  assert_int_equal(gpupool_refit_plan(b, e.t, NT, 0, &p), GPUPOOL_EINVAL);
  assert_non_null(strstr(gpupool_last_error(), "span"));
  assert_null(p);
  engine_free(&e);
  gpupool_bundle_release(b, NULL);
  /* Parts that disagree, a part twice, a version not newer: refused, the name unchanged. */
  gpupool_client *r0 = th_connect(&D, "rank0"), *r1 = th_connect(&D, "rank1");
  int complete = 0;
  assert_int_equal(publish_rank(r0, "bad", 0, 0, 2, 1, 32, 0, &complete), GPUPOOL_EINVAL);
  assert_non_null(strstr(publish_why, "not 1"));
  assert_int_equal(publish_rank(r0, "bad", 0, 0, 2, 2, 32, 0, &complete), 0);
  assert_int_equal(publish_rank(r0, "bad", 0, 0, 2, 2, 32, 0, &complete), GPUPOOL_EEXIST);
  assert_non_null(strstr(publish_why, "is in already"));
  assert_int_equal(publish_rank(r1, "bad", 0, 1, 3, 2, 32, 0, &complete), GPUPOOL_EINVAL);
  assert_non_null(strstr(publish_why, "made of 2 parts"));
  assert_int_equal(publish_rank(r1, "bad", 0, 1, 2, 2, 32, 0, &complete), 0);
  assert_int_equal(complete, 1);
  gpupool_client_disconnect(r0);
  gpupool_client_disconnect(r1);
  gpupool_client_disconnect(c);
}

/* Publish whole 8x8 float32 tensors named keys[0..n-1] (a plain bundle, no parts) as the next
 * version of name; element (i, j) of key k is value(k, i, j, v). */
static void publish_whole(const char *name, const char *const *keys, int n, uint64_t v) {
  gpupool_client *c = th_connect(&D, "trainer");
  gpupool_member_spec spec[8];
  gpupool_tensor_meta meta[8];
  int64_t shape[2] = {8, 8};
  gpupool_bundle *b;
  for (int k = 0; k < n; k++) {
    meta_of(&meta[k], GPUPOOL_DTYPE_FLOAT, 32, 2, shape);
    spec[k].name = keys[k];
    spec[k].size = 64 * 4;
    spec[k].meta = &meta[k];
  }
  assert_int_equal(gpupool_bundle_alloc(c, NULL, spec, n, 256, 1000, NULL, &b), 0);
  for (int k = 0; k < n; k++) {
    gpupool_member m;
    gpupool_bundle_member(b, k, &m);
    for (int i = 0; i < 8; i++)
      for (int j = 0; j < 8; j++)
        ((float *)m.ptr)[i * 8 + j] = value(k, i, j, v);
  }
  assert_int_equal(gpupool_bundle_publish(b, name, NULL, NULL), 0);
  gpupool_bundle_release(b, NULL);
  gpupool_client_disconnect(c);
}

static void test_merge_strides_relayout(void **state) {
  static const char *const keys[] = {"a", "b", "c", "d"};
  float flat[3 * 64], tr[64];
  gpupool_refit_piece pc[4];
  gpupool_refit_target t[4];
  int64_t shape[2] = {8, 8};
  gpupool_client *c;
  gpupool_bundle *b;
  gpupool_plan *p;
  gpupool_plan_info info;
  (void)state;
  publish_whole("whole", keys, 3, 1);
  /* Three tensors one after the other in the bundle (256-byte members, aligned to 256) into
   * three targets one after the other in one array: one copy. */
  memset(t, 0, sizeof t);
  for (int k = 0; k < 3; k++) {
    piece(&pc[k], keys[k], 0, 0, 0);
    t[k].ptr = flat + 64 * k;
    meta_of(&t[k].meta, GPUPOOL_DTYPE_FLOAT, 32, 2, shape);
    t[k].pieces = &pc[k];
    t[k].npieces = 1;
  }
  /* And a, transposed (column-major strides). */
  piece(&pc[3], "a", 0, 0, 0);
  t[3].ptr = tr;
  meta_of(&t[3].meta, GPUPOOL_DTYPE_FLOAT, 32, 2, shape);
  t[3].meta.strides_present = 1;
  t[3].meta.strides[0] = 1;
  t[3].meta.strides[1] = 8;
  t[3].pieces = &pc[3];
  t[3].npieces = 1;
  c = th_connect(&D, "engine");
  assert_int_equal(gpupool_bundle_get(c, "whole", 0, 5000, GPUPOOL_READ_ONLY, NULL, &b), 0);
  assert_int_equal(gpupool_refit_plan(b, t, 3, 0, &p), 0);
  assert_int_equal(gpupool_plan_info_get(p, &info), 0);
  assert_int_equal(info.copies, 1);
  assert_int_equal(info.bytes, 3 * 64 * 4);
  gpupool_plan_free(p);
  assert_int_equal(gpupool_refit_plan(b, t, 4, 0, &p), 0);
  assert_int_equal(gpupool_refit(p, b, NULL), 0);
  for (int k = 0; k < 3; k++)
    for (int i = 0; i < 64; i++)
      assert_true(flat[64 * k + i] == value(k, i / 8, i % 8, 1));
  for (int i = 0; i < 8; i++)
    for (int j = 0; j < 8; j++)
      assert_true(tr[j * 8 + i] == value(0, i, j, 1));
  gpupool_bundle_release(b, NULL);
  /* A version of another layout (a member more, in front): planned again, written right. */
  static const char *const keys2[] = {"d", "a", "b", "c"};
  publish_whole("whole", keys2, 4, 2);
  assert_int_equal(gpupool_bundle_get(c, "whole", 1, 5000, GPUPOOL_READ_ONLY, NULL, &b), 0);
  assert_int_equal(gpupool_refit(p, b, NULL), 0);
  assert_int_equal(gpupool_plan_info_get(p, &info), 0);
  assert_int_equal(info.plans, 2);
  for (int k = 0; k < 3; k++)
    for (int i = 0; i < 64; i++)
      assert_true(flat[64 * k + i] == value(k + 1, i / 8, i % 8, 2));
  for (int i = 0; i < 8; i++)
    for (int j = 0; j < 8; j++)
      assert_true(tr[j * 8 + i] == value(1, i, j, 2));
  gpupool_bundle_release(b, NULL);
  gpupool_plan_free(p);
  assert_int_equal(gpupool_name_unpublish(c, "whole"), 0);
  gpupool_client_disconnect(c);
}

/* Versions waiting for parts are bounded per name (4) and per tenant (6 here). */
static void test_pending_limits(void **state) {
  gpupool_daemon_stats base, ds;
  gpupool_client *c;
  int complete;
  (void)state;
  th_stats(&D, &base, NULL);
  c = th_connect(&D, "rank0");
  for (uint64_t v = 1; v <= 4; v++)
    assert_int_equal(publish_rank(c, "lim", 0, 0, 2, v, 32, 0, &complete), 0);
  assert_int_equal(publish_rank(c, "lim", 0, 0, 2, 5, 32, 0, &complete), GPUPOOL_ELIMIT);
  assert_non_null(strstr(publish_why, "versions waiting for parts already"));
  assert_int_equal(publish_rank(c, "lim2", 0, 0, 2, 1, 32, 0, &complete), 0);
  assert_int_equal(publish_rank(c, "lim2", 0, 0, 2, 2, 32, 0, &complete), 0);
  assert_int_equal(publish_rank(c, "lim3", 0, 0, 2, 1, 32, 0, &complete), GPUPOOL_ELIMIT);
  assert_non_null(strstr(publish_why, "max_pending_versions_per_uid"));
  /* Completing one frees its place; the others go with the connection. */
  gpupool_client *r1 = th_connect(&D, "rank1");
  assert_int_equal(publish_rank(r1, "lim2", 0, 1, 2, 2, 32, 0, &complete), 0);
  assert_int_equal(complete, 1);
  assert_int_equal(publish_rank(c, "lim3", 0, 0, 2, 1, 32, 0, &complete), 0);
  assert_int_equal(gpupool_name_unpublish(c, "lim2"), 0);
  gpupool_client_disconnect(r1);
  gpupool_client_disconnect(c);
  for (uint64_t end = th_now_ms() + 3000; th_now_ms() < end;) {
    th_stats(&D, &ds, NULL);
    if (ds.buffers == base.buffers && ds.holds == base.holds)
      break;
    th_sleep_ms(20);
  }
  assert_int_equal(ds.buffers, base.buffers);
  assert_int_equal(ds.holds, base.holds);
  assert_int_equal(ds.names, base.names);
}

/* A reader waiting for the name: woken by the part that completes the version, and given
 * all of it. */
static int waiting_reader(const th_daemon *d, int arg) {
  gpupool_client *c;
  gpupool_bundle *b;
  engine e;
  gpupool_plan *p;
  char why[256];
  (void)arg;
  CHILD_CHECK(gpupool_client_connect(d->sock, "waiter", GPUPOOL_TIMEOUT_DEFAULT, &c) == 0, "connect");
  printf("waiting\n");
  fflush(stdout);
  CHILD_CHECK(gpupool_bundle_get(c, "woken", 0, 10000, GPUPOOL_READ_ONLY, NULL, &b) == 0, "get");
  CHILD_CHECK(gpupool_bundle_version(b) == 5, "version %llu", (unsigned long long)gpupool_bundle_version(b));
  engine_init(&e, 2, 0, GPUPOOL_DTYPE_FLOAT, 32);
  CHILD_CHECK(gpupool_refit_plan(b, e.t, NT, 0, &p) == 0, "plan");
  CHILD_CHECK(gpupool_refit(p, b, NULL) == 0, "refit");
  CHILD_CHECK(engine_ok(&e, 5, 0, why, sizeof why), "%s", why);
  gpupool_plan_free(p);
  gpupool_bundle_release(b, NULL);
  gpupool_client_disconnect(c);
  return 0;
}

static void test_waiter_woken(void **state) {
  gpupool_daemon_stats ds;
  gpupool_client *r0, *r1;
  int complete;
  pid_t pid;
  (void)state;
  r0 = th_connect(&D, "rank0");
  r1 = th_connect(&D, "rank1");
  pid = th_spawn(&D, waiting_reader, 0);
  /* Once it waits (a waiter counts as a held request: poll the clients, then give it time). */
  for (uint64_t end = th_now_ms() + 3000; th_now_ms() < end;) {
    th_stats(&D, &ds, NULL);
    if (ds.clients >= 4)
      break;
    th_sleep_ms(10);
  }
  th_sleep_ms(100);
  assert_int_equal(publish_rank(r1, "woken", 0, 1, 2, 5, 32, 0, &complete), 0);
  th_sleep_ms(100); /* the reader must not be woken by a part */
  assert_int_equal(publish_rank(r0, "woken", 0, 0, 2, 5, 32, 0, &complete), 0);
  assert_int_equal(complete, 1);
  th_wait_ok(pid, "waiting reader");
  assert_int_equal(gpupool_name_unpublish(r0, "woken"), 0);
  gpupool_client_disconnect(r0);
  gpupool_client_disconnect(r1);
}

/* A rank that publishes its part and dies (SIGKILL) before the others are in. */
static int dying_rank(const th_daemon *d, int arg) {
  gpupool_client *c;
  int complete;
  CHILD_CHECK(gpupool_client_connect(d->sock, "dying", GPUPOOL_TIMEOUT_DEFAULT, &c) == 0, "connect");
  CHILD_CHECK(publish_rank(c, "dies", 0, 1, 3, (uint64_t)arg, 32, 0, &complete) == 0, "publish");
  CHILD_CHECK(complete == 0, "complete");
  raise(SIGKILL);
  return 1;
}

static void test_rank_dies(void **state) {
  gpupool_daemon_stats base, ds;
  gpupool_client *r0, *r2;
  gpupool_bundle *b = NULL;
  int complete = -1, st;
  pid_t pid;
  (void)state;
  th_stats(&D, &base, NULL);
  r0 = th_connect(&D, "rank0");
  r2 = th_connect(&D, "rank2");
  assert_int_equal(publish_rank(r0, "dies", 0, 0, 3, 1, 32, 0, &complete), 0);
  pid = th_spawn(&D, dying_rank, 1);
  assert_int_equal(waitpid(pid, &st, 0), pid);
  assert_true(WIFSIGNALED(st));
  /* The last part comes after rank 1 died: version 1 is gone, so it starts a new one, which
   * waits for parts 0 and 1 again; nothing is published. */
  for (uint64_t end = th_now_ms() + 3000; th_now_ms() < end;) {
    assert_int_equal(publish_rank(r2, "dies", 0, 2, 3, 1, 32, 0, &complete), 0);
    if (complete == 0)
      break;
  }
  assert_int_equal(complete, 0);
  assert_int_equal(gpupool_bundle_get(r0, "dies", 0, 200, GPUPOOL_READ_ONLY, NULL, &b), GPUPOOL_ETIMEDOUT);
  /* The living ranks' connections close: their parts go too; the daemon is back where it was. */
  gpupool_client_disconnect(r0);
  gpupool_client_disconnect(r2);
  for (uint64_t end = th_now_ms() + 3000;;) {
    th_stats(&D, &ds, NULL);
    if ((ds.buffers == base.buffers && ds.holds == base.holds && ds.pending_frees == base.pending_frees) ||
        th_now_ms() > end)
      break;
    th_sleep_ms(20);
  }
  assert_int_equal(ds.buffers, base.buffers);
  assert_int_equal(ds.holds, base.holds);
  assert_int_equal(ds.names, base.names);
  assert_int_equal(ds.pending_frees, base.pending_frees);
}

/* A reader that refits in a loop until killed. */
static int looping_reader(const th_daemon *d, int arg) {
  gpupool_client *c;
  gpupool_bundle *b;
  gpupool_plan *p;
  engine e;
  (void)arg;
  CHILD_CHECK(gpupool_client_connect(d->sock, "reader", GPUPOOL_TIMEOUT_DEFAULT, &c) == 0, "connect");
  CHILD_CHECK(gpupool_bundle_get(c, "killed", 0, 5000, GPUPOOL_READ_ONLY, NULL, &b) == 0, "get");
  engine_init(&e, 2, 1, GPUPOOL_DTYPE_FLOAT, 32);
  CHILD_CHECK(gpupool_refit_plan(b, e.t, NT, 0, &p) == 0, "plan");
  printf("planned\n");
  fflush(stdout);
  for (;;)
    CHILD_CHECK(gpupool_refit(p, b, NULL) == 0, "refit");
}

static void test_reader_killed(void **state) {
  gpupool_daemon_stats base, ds;
  pid_t pid;
  (void)state;
  th_stats(&D, &base, NULL);
  publish_version("killed", 0, 2, 1, 32, 0);
  th_stats(&D, &base, NULL);
  pid = th_spawn(&D, looping_reader, 0);
  for (uint64_t end = th_now_ms() + 5000; th_now_ms() < end;) { /* until it holds the version */
    th_stats(&D, &ds, NULL);
    if (ds.holds > base.holds)
      break;
    th_sleep_ms(10);
  }
  assert_true(ds.holds > base.holds);
  th_sleep_ms(50); /* refitting now */
  kill(pid, SIGKILL);
  waitpid(pid, NULL, 0);
  for (uint64_t end = th_now_ms() + 3000; th_now_ms() < end;) {
    th_stats(&D, &ds, NULL);
    if (ds.holds == base.holds)
      break;
    th_sleep_ms(20);
  }
  assert_int_equal(ds.holds, base.holds);
  /* The next version publishes and refits as ever, and the killed reader's version goes. */
  publish_version("killed", 0, 2, 2, 32, 0);
  refit_engines("killed", 2, 2, GPUPOOL_DTYPE_FLOAT, 32, 0);
  th_stats(&D, &ds, NULL);
  assert_int_equal(ds.buffers, base.buffers);
}

/* 1,000 versions from 2 ranks, each refitted into one engine by one plan. */
static void test_thousand_refits(void **state) {
  gpupool_daemon_stats base, ds;
  gpupool_pool_stats pbase, ps;
  gpupool_client *r0, *r1, *c;
  gpupool_plan *p = NULL;
  gpupool_plan_info info;
  engine e;
  (void)state;
  th_stats(&D, &base, &pbase);
  r0 = th_connect(&D, "rank0");
  r1 = th_connect(&D, "rank1");
  c = th_connect(&D, "engine");
  engine_init(&e, 4, 2, GPUPOOL_DTYPE_FLOAT, 32);
  for (uint64_t v = 1; v <= 1000; v++) {
    gpupool_bundle *b;
    int complete;
    assert_int_equal(publish_rank(r1, "many", 0, 1, 2, v, 32, 0, &complete), 0);
    assert_int_equal(publish_rank(r0, "many", 0, 0, 2, v, 32, 0, &complete), 0);
    assert_int_equal(complete, 1);
    assert_int_equal(gpupool_bundle_get(c, "many", v - 1, 5000, GPUPOOL_READ_ONLY, NULL, &b), 0);
    if (!p)
      assert_int_equal(gpupool_refit_plan(b, e.t, NT, 0, &p), 0);
    assert_int_equal(gpupool_refit(p, b, NULL), 0);
    if (v % 100 == 1)
      check_engine(&e, v, 0);
    assert_int_equal(gpupool_bundle_release(b, NULL), 0);
  }
  check_engine(&e, 1000, 0);
  assert_int_equal(gpupool_plan_info_get(p, &info), 0);
  assert_int_equal(info.plans, 1); /* every version had the first one's layout */
  assert_int_equal(info.refits, 1000);
  gpupool_plan_free(p);
  engine_free(&e);
  assert_int_equal(gpupool_name_unpublish(c, "many"), 0);
  gpupool_client_disconnect(r0);
  gpupool_client_disconnect(r1);
  gpupool_client_disconnect(c);
  for (uint64_t end = th_now_ms() + 3000; th_now_ms() < end;) {
    th_stats(&D, &ds, &ps);
    if (ds.buffers == base.buffers && ds.holds == base.holds && ps.used == pbase.used)
      break;
    th_sleep_ms(20);
  }
  assert_int_equal(ds.buffers, base.buffers);
  assert_int_equal(ds.holds, base.holds);
  assert_int_equal(ds.pending_frees, base.pending_frees);
  assert_int_equal(ps.used, pbase.used);
}

/* gpupool_buffer_copy_in_many into host buffers: every range lands where it was asked, a range past
 * a buffer's end or into a read-only hold is refused before anything is written. */
static void test_copy_in_many(void **state) {
  gpupool_client *c = th_connect(&D, "copy-in");
  gpupool_buffer *b[3], *ro = NULL;
  size_t sizes[3] = {4096, 100000, 7};
  uint8_t src[3][100000];
  const void *srcs[3] = {src[0], src[1], src[2]};
  uint64_t off[3] = {100, 0, 0};
  size_t len[3] = {3000, 100000, 7};
  int gathered = -1;
  uint64_t v = 0;
  (void)state;
  for (int i = 0; i < 3; i++) {
    assert_int_equal(gpupool_buffer_alloc(c, NULL, sizes[i], 0, NULL, &b[i]), 0);
    memset(gpupool_buffer_ptr(b[i]), 0xee, sizes[i]);
    for (size_t k = 0; k < sizeof src[i]; k++)
      src[i][k] = (uint8_t)(k * 7 + (size_t)i);
  }
  assert_int_equal(gpupool_buffer_copy_in_many(b, off, srcs, len, 3, NULL, 0, &gathered), 0);
  assert_int_equal(gathered, 0);
  for (int i = 0; i < 3; i++) {
    const uint8_t *p = gpupool_buffer_ptr(b[i]);
    for (size_t k = 0; k < sizes[i]; k++) {
      int in = k >= off[i] && k < off[i] + len[i];
      assert_int_equal(p[k], in ? src[i][k - off[i]] : 0xee);
    }
  }
  /* Past the end of buffer 0 (4096 bytes): refused, nothing written, buffer 2 included. */
  memset(gpupool_buffer_ptr(b[2]), 0, 7);
  off[0] = 1097;
  assert_int_equal(gpupool_buffer_copy_in_many(b, off, srcs, len, 3, NULL, 0, NULL), GPUPOOL_EINVAL);
  assert_non_null(strstr(gpupool_last_error(), "copy 0 writes 3000 bytes at offset 1097 of a buffer of 4096"));
  assert_int_equal(((uint8_t *)gpupool_buffer_ptr(b[2]))[0], 0);
  /* Into a read-only hold. */
  assert_int_equal(gpupool_buffer_publish(b[1], "copy-in", NULL, NULL, &v), 0);
  assert_int_equal(gpupool_buffer_get(c, "copy-in", 0, 0, GPUPOOL_READ_ONLY, NULL, &ro, NULL), 0);
  off[0] = 0;
  assert_int_equal(gpupool_buffer_copy_in_many(&ro, off, srcs, len + 1, 1, NULL, 0, NULL), GPUPOOL_EINVAL);
  assert_non_null(strstr(gpupool_last_error(), "held read-only"));
  assert_int_equal(gpupool_buffer_copy_in_many(b, off, srcs, len, 0, NULL, 0, NULL), 0);
  assert_int_equal(gpupool_buffer_copy_in_many(NULL, off, srcs, len, 1, NULL, 0, NULL), GPUPOOL_EINVAL);
  assert_int_equal(gpupool_buffer_release(ro, NULL), 0);
  assert_int_equal(gpupool_name_unpublish(c, "copy-in"), 0);
  for (int i = 0; i < 3; i++)
    assert_int_equal(gpupool_buffer_release(b[i], NULL), 0);
  gpupool_client_disconnect(c);
}

int main(void) {
  return TS_RUN_TESTS(setup, teardown, test_fsdp_to_tp, test_tp_to_tp, test_casts, test_bad_targets, test_merge_strides_relayout, test_pending_limits, test_waiter_woken, test_rank_dies,
                      test_reader_killed, test_thousand_refits, test_copy_in_many);
}
