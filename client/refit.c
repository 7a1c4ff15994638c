/*
 * libgpupool-client, refit.c: refit plans. A plan maps a version's members (slices of global
 * tensors, named as parts.c names them, or whole tensors) onto an engine's own tensors (the
 * targets: each holds slices of global tensors stacked along one dimension), as a list of 2D
 * copies (source buffer + offset, target address, rows of contiguous elements and the pitches
 * between rows), merged into as few and as large copies as the layouts allow. It is computed
 * once per (layout, targets) and replayed for every version of that layout: the targets are
 * written in place, nothing is allocated or looked up per version.
 *
 * Host copies are memcpy (a cast converts element by element: float16, bfloat16, float32 and
 * float64 among themselves); device copies go to backend/cuda/refit_copy.c.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "cuda/refit_copy.h"
#include "cuda/refit_convert.h"
#include "refit_internal.h"
#include "gpupool/refit.h"

/* Most copies one plan may hold (a strided target can need one per row). */
#define OPS_MAX (1u << 24)

/* Float kinds of casts: refit_convert.h's, shared with the gather kernel. */
enum { FK_NONE = GPUPOOL__FK_NONE, FK_F16 = GPUPOOL__FK_F16, FK_BF16 = GPUPOOL__FK_BF16, FK_F32 = GPUPOOL__FK_F32,
       FK_F64 = GPUPOOL__FK_F64 };

typedef struct {
  uint32_t buf;        /* source buffer of the bundle */
  uint8_t sfk, dfk;    /* float kinds of a cast, FK_NONE both when there is none */
  uint8_t sesz, desz;  /* element sizes */
  uint64_t soff;       /* bytes from the buffer's start */
  char *dst;
  uint64_t width;      /* elements per row */
  uint64_t rows;
  uint64_t spitch, dpitch; /* bytes from row to row */
  int32_t ddev;        /* device plans: the CUDA device of dst, -1 for host memory */
} op;

struct gpupool_plan {
  gpupool_refit_target *targets; /* the caller's, copied (pieces and keys too) */
  int ntargets;
  unsigned flags;
  int device;          /* copies go through CUDA */
  gpupool_client *c;
  uint64_t gen;        /* c's reconnections when the plan was made: layout ids are per connection */
  uint32_t nbufs;
  uint64_t *need;      /* per source buffer: the bytes its copies read from its start */
  op *ops;
  size_t nops;
  gpupool__refit_op *dops; /* device plans: the copies as the backend takes them, per refit */
  gpupool_plan_info info;
};

/* A member of the version as a source: a slice of a global tensor. */
typedef struct {
  const char *key;
  size_t keylen;
  int ndim;
  int64_t start[GPUPOOL_MAX_NDIM], shape[GPUPOOL_MAX_NDIM], global[GPUPOOL_MAX_NDIM];
  int64_t stride[GPUPOOL_MAX_NDIM]; /* elements */
  uint8_t code, bits;
  uint32_t buf;
  uint64_t off;        /* bytes from the buffer's start to element 0 */
  const char *member;  /* its member name */
} src;

static int float_kind(uint8_t code, uint8_t bits) {
  if (code == GPUPOOL_DTYPE_FLOAT)
    return bits == 16 ? FK_F16 : bits == 32 ? FK_F32 : bits == 64 ? FK_F64 : FK_NONE;
  return code == GPUPOOL_DTYPE_BFLOAT && bits == 16 ? FK_BF16 : FK_NONE;
}

static const char *dtype_str(uint8_t code, uint8_t bits, char *buf, size_t n) {
  static const char *names[] = {"int", "uint", "float", "handle", "bfloat", "complex", "bool"};
  snprintf(buf, n, "%s%u", code < 7 ? names[code] : "dtype", bits);
  return buf;
}

/* ---- the plan ---------------------------------------------------------------------------------- */

static void targets_free(gpupool_refit_target *t, int n) {
  for (int i = 0; t && i < n; i++) {
    for (int j = 0; t[i].pieces && j < t[i].npieces; j++)
      free((char *)t[i].pieces[j].key);
    free((gpupool_refit_piece *)t[i].pieces);
  }
  free(t);
}

void gpupool_plan_free(gpupool_plan *p) {
  if (!p)
    return;
  targets_free(p->targets, p->ntargets);
  free(p->need);
  free(p->ops);
  free(p->dops);
  free(p);
}

int gpupool_plan_info_get(const gpupool_plan *p, gpupool_plan_info *out) {
  if (!p || !out)
    return gpupool__err(GPUPOOL_EINVAL, "plan_info_get: plan and out must not be NULL");
  *out = p->info;
  return 0;
}

static int src_cmp(const void *a, const void *b) {
  const src *x = a, *y = b;
  size_t n = x->keylen < y->keylen ? x->keylen : y->keylen;
  int c = memcmp(x->key, y->key, n);
  if (c)
    return c;
  if (x->keylen != y->keylen)
    return x->keylen < y->keylen ? -1 : 1;
  for (int i = 0; i < x->ndim; i++)
    if (x->start[i] != y->start[i])
      return x->start[i] < y->start[i] ? -1 : 1;
  return strcmp(x->member, y->member);
}

static int key_cmp(const char *key, size_t len, const src *s) {
  size_t n = len < s->keylen ? len : s->keylen;
  int c = memcmp(key, s->key, n);
  if (c)
    return c;
  return len == s->keylen ? 0 : len < s->keylen ? -1 : 1;
}

static void contiguous_strides(int ndim, const int64_t *shape, int64_t *stride) {
  int64_t s = 1;
  for (int i = ndim - 1; i >= 0; i--) {
    stride[i] = s;
    s *= shape[i] > 0 ? shape[i] : 1;
  }
}

static int dtype_ok(const gpupool_tensor_meta *m) {
  return m->dtype_lanes == 1 && m->dtype_bits >= 8 && m->dtype_bits % 8 == 0 && m->dtype_bits <= 128;
}

/* The version's members as sources, sorted by key and slice; identical slices (a tensor every
 * rank holds whole) are kept once; slices of one key that overlap otherwise are refused. */
static int sources_of(const gpupool_bundle *b, src **out, size_t *nout) {
  const clayout *l = b->layout;
  src *s = calloc((size_t)l->n + 1, sizeof *s);
  size_t n = 0, i, j, k;
  if (!s)
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory for a plan over %d members", l->n);
  for (int m = 0; m < l->n; m++) {
    const gpupool_member *mb = &l->members[m];
    gpupool__shard sh;
    src *x = &s[n];
    if (!mb->has_meta || !dtype_ok(&mb->meta))
      continue; /* no description: nothing a target can name */
    x->member = mb->name;
    x->ndim = mb->meta.ndim;
    x->code = mb->meta.dtype_code;
    x->bits = mb->meta.dtype_bits;
    x->buf = (uint32_t)mb->buffer;
    x->off = mb->offset + mb->meta.byte_offset;
    if (mb->meta.strides_present)
      memcpy(x->stride, mb->meta.strides, sizeof x->stride);
    else
      contiguous_strides(x->ndim, mb->meta.shape, x->stride);
    memcpy(x->shape, mb->meta.shape, sizeof x->shape);
    for (int d = 0; d < x->ndim; d++)
      if (x->stride[d] < 0) {
        free(s);
        return gpupool__err(GPUPOOL_EINVAL, "member '%s' has a negative stride; refit reads strides of 0 or more",
                            mb->name);
      }
    if (gpupool__shard_parse(mb->name, &sh) == 0) {
      if (sh.ndim != x->ndim || memcmp(sh.shape, x->shape, (size_t)x->ndim * sizeof x->shape[0])) {
        int nd = x->ndim;
        free(s);
        return gpupool__err(GPUPOOL_EINVAL, "member '%s': its name's slice does not match its tensor's shape "
                            "(%d dimensions)", mb->name, nd);
      }
      x->key = mb->name;
      x->keylen = sh.keylen;
      memcpy(x->start, sh.start, sizeof x->start);
      memcpy(x->global, sh.global, sizeof x->global);
    } else {
      x->key = mb->name;
      x->keylen = strlen(mb->name);
      memcpy(x->global, x->shape, sizeof x->global);
    }
    n++;
  }
  qsort(s, n, sizeof *s, src_cmp);
  /* Per key: one global shape and dtype; identical slices once; no other overlap. */
  for (i = 0, k = 0; i < n; i = j) {
    for (j = i + 1; j < n && !key_cmp(s[i].key, s[i].keylen, &s[j]); j++)
      ;
    for (size_t a = i; a < j; a++) {
      int dup = 0;
      if (s[a].ndim != s[i].ndim || memcmp(s[a].global, s[i].global, (size_t)s[i].ndim * sizeof s[i].global[0]) ||
          s[a].code != s[i].code || s[a].bits != s[i].bits) {
        int rc = gpupool__err(GPUPOOL_EINVAL, "members '%s' and '%s' are slices of one tensor '%.*s' but disagree "
                              "on its global shape or dtype", s[i].member, s[a].member, (int)s[i].keylen, s[i].key);
        free(s);
        return rc;
      }
      for (size_t q = i; q < a && !dup; q++) {
        size_t nb = (size_t)s[a].ndim * sizeof s[a].start[0];
        int same = !memcmp(s[q].start, s[a].start, nb) && !memcmp(s[q].shape, s[a].shape, nb);
        int overlap = 1;
        for (int d = 0; d < s[a].ndim; d++)
          if (s[a].start[d] >= s[q].start[d] + s[q].shape[d] || s[q].start[d] >= s[a].start[d] + s[a].shape[d])
            overlap = 0;
        if (same) {
          dup = 1;
        } else if (overlap && s[a].ndim > 0) {
          int rc = gpupool__err(GPUPOOL_EINVAL, "members '%s' and '%s' overlap: slices of one tensor are disjoint "
                                "or identical", s[q].member, s[a].member);
          free(s);
          return rc;
        }
      }
      if (!dup)
        s[k++] = s[a];
    }
  }
  *out = s;
  *nout = k;
  return 0;
}

typedef struct {
  op *ops;
  size_t n, cap;
  uint64_t bytes;
} ops_list;

static int ops_push(ops_list *l, const op *o) {
  if (l->n == l->cap) {
    size_t cap = l->cap ? l->cap * 2 : 64;
    op *p;
    if (l->n >= OPS_MAX)
      return gpupool__err(GPUPOOL_ELIMIT, "the plan needs more than %u copies (targets strided element by "
                          "element?); make the targets' last dimension contiguous", OPS_MAX);
    if (!(p = realloc(l->ops, cap * sizeof *p)))
      return gpupool__err(GPUPOOL_ENOMEM, "out of memory for a plan of %zu copies", cap);
    l->ops = p;
    l->cap = cap;
  }
  l->ops[l->n++] = *o;
  l->bytes += o->width * o->rows * o->desz;
  return 0;
}

/* The copies of one box of E elements from s (at index si) into t (at index ti). */
static int emit(ops_list *l, const src *s, const gpupool_refit_target *t, const int64_t *tstride,
                const int64_t *E, const int64_t *si, const int64_t *ti, int sfk, int dfk) {
  int64_t ext[GPUPOOL_MAX_NDIM], ss[GPUPOOL_MAX_NDIM], ds[GPUPOOL_MAX_NDIM], idx[GPUPOOL_MAX_NDIM];
  int nd = 0, outer;
  op o = {0};
  uint64_t sesz = s->bits / 8, desz = t->meta.dtype_bits / 8;
  int64_t soff = (int64_t)s->off, doff = (int64_t)t->meta.byte_offset;
  for (int k = 0; k < t->meta.ndim; k++) {
    soff += si[k] * s->stride[k] * (int64_t)sesz;
    doff += ti[k] * tstride[k] * (int64_t)desz;
    if (E[k] == 1)
      continue;
    ext[nd] = E[k];
    ss[nd] = s->stride[k] * (int64_t)sesz;
    ds[nd] = tstride[k] * (int64_t)desz;
    nd++;
  }
  /* Outer dimensions first (by target stride), then fold dimensions contiguous on both sides. */
  for (int a = 1; a < nd; a++)
    for (int b = a; b > 0 && ds[b] > ds[b - 1]; b--) {
      int64_t t0 = ext[b], t1 = ss[b], t2 = ds[b];
      ext[b] = ext[b - 1], ss[b] = ss[b - 1], ds[b] = ds[b - 1];
      ext[b - 1] = t0, ss[b - 1] = t1, ds[b - 1] = t2;
    }
  for (int a = nd - 2; a >= 0; a--)
    if (ss[a] == ext[a + 1] * ss[a + 1] && ds[a] == ext[a + 1] * ds[a + 1]) {
      ext[a + 1] *= ext[a];
      for (int b = a; b < nd - 1; b++)
        ext[b] = ext[b + 1], ss[b] = ss[b + 1], ds[b] = ds[b + 1];
      nd--; /* the folded dimension sits at a now; a-1 may fold into it next */
    }
  o.buf = s->buf;
  o.sfk = (uint8_t)sfk;
  o.dfk = (uint8_t)dfk;
  o.sesz = (uint8_t)sesz;
  o.desz = (uint8_t)desz;
  o.width = 1;
  o.rows = 1;
  o.spitch = sesz;
  o.dpitch = desz;
  outer = nd;
  if (nd > 0 && ss[nd - 1] == (int64_t)sesz && ds[nd - 1] == (int64_t)desz) {
    o.width = (uint64_t)ext[nd - 1];
    o.spitch = o.width * sesz;
    o.dpitch = o.width * desz;
    outer = nd - 1;
  }
  if (outer > 0) {
    o.rows = (uint64_t)ext[outer - 1];
    o.spitch = (uint64_t)ss[outer - 1];
    o.dpitch = (uint64_t)ds[outer - 1];
    outer--;
  }
  memset(idx, 0, sizeof idx);
  for (;;) {
    int64_t so = soff, dof = doff;
    int rc;
    for (int k = 0; k < outer; k++) {
      so += idx[k] * ss[k];
      dof += idx[k] * ds[k];
    }
    o.soff = (uint64_t)so;
    o.dst = (char *)t->ptr + dof;
    if ((rc = ops_push(l, &o)) != 0)
      return rc;
    int k = outer - 1;
    while (k >= 0 && ++idx[k] == ext[k])
      idx[k--] = 0;
    if (k < 0)
      break;
  }
  return 0;
}

static int op_cmp(const void *a, const void *b) {
  const op *x = a, *y = b;
  if (x->buf != y->buf)
    return x->buf < y->buf ? -1 : 1;
  if (x->soff != y->soff)
    return x->soff < y->soff ? -1 : 1;
  return x->dst < y->dst ? -1 : x->dst > y->dst;
}

/* Fewer, larger copies: rows contiguous on both sides become one row; a copy that goes on
 * where the previous one ended (both sides) joins it, as more of its row or more rows. */
static void ops_merge(ops_list *l) {
  size_t k = 0;
  for (size_t i = 0; i < l->n; i++) {
    op *o = &l->ops[i];
    if (o->rows > 1 && o->spitch == o->width * o->sesz && o->dpitch == o->width * o->desz) {
      o->width *= o->rows;
      o->rows = 1;
    }
    if (o->rows == 1) {
      o->spitch = o->width * o->sesz;
      o->dpitch = o->width * o->desz;
    }
  }
  qsort(l->ops, l->n, sizeof *l->ops, op_cmp);
  for (size_t i = 0; i < l->n; i++) {
    op *o = &l->ops[i], *c = k ? &l->ops[k - 1] : NULL;
    if (c && c->buf == o->buf && c->sfk == o->sfk && c->dfk == o->dfk && c->sesz == o->sesz &&
        c->desz == o->desz) {
      if (c->rows == 1 && o->rows == 1 && o->soff == c->soff + c->width * c->sesz &&
          o->dst == c->dst + c->width * c->desz) {
        c->width += o->width;
        c->spitch = c->width * c->sesz;
        c->dpitch = c->width * c->desz;
        continue;
      }
      if (c->rows > 1 && c->width == o->width && (o->rows == 1 || (c->spitch == o->spitch &&
          c->dpitch == o->dpitch)) && o->soff == c->soff + c->rows * c->spitch &&
          o->dst == c->dst + c->rows * c->dpitch) {
        c->rows += o->rows;
        continue;
      }
    }
    l->ops[k++] = *o;
  }
  l->n = k;
}

/* The copies of piece pi of target ti (at *pos along its dimension, which it moves past), from
 * the sources s (sorted by key), into l. */
static int plan_piece(ops_list *l, const src *s, size_t ns, const gpupool_plan *p, int ti, int pi,
                      const int64_t *tstride, int64_t *pos) {
  const gpupool_refit_target *t = &p->targets[ti];
  int nd = t->meta.ndim, dim = t->dim;
  char d1[24], d2[24];
  int rc;
  const gpupool_refit_piece *pc = &t->pieces[pi];
  size_t klen = strlen(pc->key), lo = 0, hi = ns;
  int64_t blo[GPUPOOL_MAX_NDIM], ext[GPUPOOL_MAX_NDIM], volume = 1, covered = 0;
  int found = 0, sfk, dfk;
  while (lo < hi) { /* the first source of the key */
    size_t mid = (lo + hi) / 2;
    if (key_cmp(pc->key, klen, &s[mid]) > 0)
      lo = mid + 1;
    else
      hi = mid;
  }
  if (lo == ns || key_cmp(pc->key, klen, &s[lo]) != 0) {
    rc = gpupool__err(GPUPOOL_EINVAL, "target %d, piece %d: the version has no tensor '%s' (no member named "
                      "'%s' or '%s@PART[...]/...' with a tensor description)", ti, pi, pc->key, pc->key, pc->key);
    return rc;
  }
  if (s[lo].ndim != nd) {
    rc = gpupool__err(GPUPOOL_EINVAL, "target %d, piece %d: '%s' has %d dimensions, the target %d", ti, pi,
                      pc->key, s[lo].ndim, nd);
    return rc;
  }
  sfk = float_kind(s[lo].code, s[lo].bits);
  dfk = float_kind(t->meta.dtype_code, t->meta.dtype_bits);
  if (s[lo].code == t->meta.dtype_code && s[lo].bits == t->meta.dtype_bits) {
    sfk = dfk = FK_NONE;
  } else if (!sfk || !dfk) {
    rc = gpupool__err(GPUPOOL_EINVAL, "target %d, piece %d: no cast from %s ('%s') to %s; casts are among "
                      "float16, bfloat16, float32 and float64", ti, pi,
                      dtype_str(s[lo].code, s[lo].bits, d1, sizeof d1), pc->key,
                      dtype_str(t->meta.dtype_code, t->meta.dtype_bits, d2, sizeof d2));
    return rc;
  } else if (p->device && !gpupool__refit_device_casts()) {
    rc = gpupool__err(GPUPOOL_ENOTSUP, "target %d, piece %d: a cast from %s to %s into device memory; this "
                      "build of gpupool has no gather kernel to cast with (its CUDA toolkit had no nvcc): "
                      "publish the version in the engine's dtype", ti, pi,
                      dtype_str(s[lo].code, s[lo].bits, d1, sizeof d1),
                      dtype_str(t->meta.dtype_code, t->meta.dtype_bits, d2, sizeof d2));
    return rc;
  }
  for (int k = 0; k < nd; k++) {
    ext[k] = t->meta.shape[k];
    blo[k] = pc->start[k];
  }
  if (nd > 0)
    ext[dim] = pc->length ? pc->length : t->meta.shape[dim] - *pos;
  for (int k = 0; k < nd; k++) {
    if (blo[k] < 0 || ext[k] < 0 || blo[k] > s[lo].global[k] || ext[k] > s[lo].global[k] - blo[k] ||
        (k == dim && ext[k] > t->meta.shape[k] - *pos)) {
      rc = gpupool__err(GPUPOOL_EINVAL, "target %d, piece %d ('%s'): dimension %d, slice %" PRId64 "..%" PRId64
                        " is outside the tensor (%" PRId64 ") or the target (%" PRId64 " from %" PRId64 ")", ti,
                        pi, pc->key, k, blo[k], blo[k] + ext[k], s[lo].global[k], t->meta.shape[k],
                        k == dim ? *pos : 0);
      return rc;
    }
    volume *= ext[k];
  }
  for (size_t q = lo; q < ns && !key_cmp(pc->key, klen, &s[q]); q++) {
    int64_t E[GPUPOOL_MAX_NDIM], si[GPUPOOL_MAX_NDIM], tix[GPUPOOL_MAX_NDIM], v = 1;
    int empty = 0;
    for (int k = 0; k < nd; k++) {
      int64_t a = blo[k] > s[q].start[k] ? blo[k] : s[q].start[k];
      int64_t z = blo[k] + ext[k] < s[q].start[k] + s[q].shape[k] ? blo[k] + ext[k] : s[q].start[k] + s[q].shape[k];
      if (z <= a) {
        empty = 1;
        break;
      }
      E[k] = z - a;
      si[k] = a - s[q].start[k];
      tix[k] = a - blo[k] + (k == dim ? *pos : 0);
      v *= E[k];
    }
    if (empty || volume == 0)
      continue;
    found = 1;
    covered += v;
    if ((rc = emit(l, &s[q], t, tstride, E, si, tix, sfk, dfk)) != 0)
      return rc;
  }
  if (covered != volume) {
    rc = gpupool__err(GPUPOOL_EINVAL, "target %d, piece %d ('%s'): the version's slices cover %" PRId64 " of its "
                      "%" PRId64 " elements%s", ti, pi, pc->key, covered, volume,
                      found ? "" : " (none of them)");
    return rc;
  }
  if (nd > 0)
    *pos += ext[dim];
  return 0;
}

/* The copies that fill p's targets from b's layout, into p (replacing what it had). */
static int plan_compute(gpupool_plan *p, const gpupool_bundle *b) {
  src *s = NULL;
  size_t ns = 0;
  ops_list l = {0};
  uint64_t *need;
  int rc;

  if ((rc = sources_of(b, &s, &ns)) != 0)
    return rc;
  for (int ti = 0; ti < p->ntargets; ti++) {
    const gpupool_refit_target *t = &p->targets[ti];
    int nd = t->meta.ndim, dim = t->dim;
    int64_t tstride[GPUPOOL_MAX_NDIM], pos = 0;
    if (t->meta.strides_present)
      memcpy(tstride, t->meta.strides, sizeof tstride);
    else
      contiguous_strides(nd, t->meta.shape, tstride);
    for (int pi = 0; pi < t->npieces; pi++)
      if ((rc = plan_piece(&l, s, ns, p, ti, pi, tstride, &pos)) != 0)
        goto out;
    if (nd > 0 && pos != t->meta.shape[dim]) {
      rc = gpupool__err(GPUPOOL_EINVAL, "target %d: its pieces span %" PRId64 " of its %" PRId64 " along dimension "
                        "%d", ti, pos, t->meta.shape[dim], dim);
      goto out;
    }
  }
  ops_merge(&l);
  if (!(need = calloc((size_t)b->nbufs, sizeof *need))) {
    rc = gpupool__err(GPUPOOL_ENOMEM, "out of memory for a plan over %d buffers", b->nbufs);
    goto out;
  }
  for (size_t i = 0; i < l.n; i++) {
    const op *o = &l.ops[i];
    uint64_t end = o->soff + (o->rows - 1) * o->spitch + o->width * o->sesz;
    if (end > need[o->buf])
      need[o->buf] = end;
  }
  if (p->device) {
    /* Where each copy writes, asked once per plan (targets do not move), so that a replay can
     * tell the copies within one device (the gather kernel's) without asking CUDA per copy. */
    gpupool__refit_op *d = calloc(l.n ? l.n : 1, sizeof *d);
    if (!d) {
      free(need);
      rc = gpupool__err(GPUPOOL_ENOMEM, "out of memory for a plan of %zu copies", l.n);
      goto out;
    }
    for (size_t i = 0; i < l.n; i++)
      l.ops[i].ddev = gpupool__refit_ptr_device(l.ops[i].dst);
    free(p->dops);
    p->dops = d;
  }
  free(p->need);
  p->need = need;
  free(p->ops);
  p->ops = l.ops;
  p->nops = l.n;
  l.ops = NULL;
  p->nbufs = (uint32_t)b->nbufs;
  p->c = b->c;
  p->gen = gpupool_client_reconnect_count(b->c);
  p->info.layout_id = b->layout->id;
  p->info.copies = p->nops;
  p->info.bytes = l.bytes;
  p->info.cast_copies = 0;
  for (size_t i = 0; i < p->nops; i++)
    p->info.cast_copies += p->ops[i].sfk != FK_NONE;
  p->info.plans++;
out:
  free(l.ops);
  free(s);
  return rc;
}

static int target_check(int i, const gpupool_refit_target *t) {
  const gpupool_tensor_meta *m = &t->meta;
  int64_t n = 1;
  if (m->ndim < 0 || m->ndim > GPUPOOL_MAX_NDIM || !dtype_ok(m))
    return gpupool__err(GPUPOOL_EINVAL, "target %d: ndim %d (0..%d) and a dtype of whole bytes, one lane", i,
                        m->ndim, GPUPOOL_MAX_NDIM);
  if (t->npieces < 1 || !t->pieces || (m->ndim > 0 && (t->dim < 0 || t->dim >= m->ndim)) ||
      (m->ndim == 0 && t->npieces != 1))
    return gpupool__err(GPUPOOL_EINVAL, "target %d: %d pieces along dimension %d of %d; a target has 1 or more "
                        "pieces (one for a scalar), along one of its dimensions", i, t->npieces, t->dim, m->ndim);
  for (int k = 0; k < m->ndim; k++) {
    if (m->shape[k] < 0 || (m->strides_present && m->strides[k] < 0))
      return gpupool__err(GPUPOOL_EINVAL, "target %d: dimension %d has a negative size or stride", i, k);
    n *= m->shape[k];
  }
  if (n > 0 && !t->ptr)
    return gpupool__err(GPUPOOL_EINVAL, "target %d: ptr is NULL", i);
  for (int j = 0; j < t->npieces; j++)
    if (!t->pieces[j].key || !*t->pieces[j].key)
      return gpupool__err(GPUPOOL_EINVAL, "target %d, piece %d: no key", i, j);
  return 0;
}

int gpupool_refit_plan(const gpupool_bundle *b, const gpupool_refit_target *targets, int n, unsigned flags,
                       gpupool_plan **out) {
  gpupool_plan *p;
  int rc;
  if (!b || !out || (n > 0 && !targets))
    return gpupool__err(GPUPOOL_EINVAL, "refit_plan: bundle, targets and out must not be NULL");
  gpupool__err_clear();
  *out = NULL;
  if (n < 1)
    return gpupool__err(GPUPOOL_EINVAL, "refit_plan: %d targets; a plan has 1 or more", n);
  if (flags & ~(unsigned)GPUPOOL_REFIT_DEVICE)
    return gpupool__err(GPUPOOL_EINVAL, "refit_plan: unknown flags 0x%x", flags);
  for (int i = 0; i < n; i++)
    if ((rc = target_check(i, &targets[i])) != 0)
      return rc;
  if (!(p = calloc(1, sizeof *p)) || !(p->targets = calloc((size_t)n, sizeof *p->targets))) {
    free(p);
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory for a plan of %d targets", n);
  }
  p->ntargets = n;
  p->flags = flags;
  p->device = (flags & GPUPOOL_REFIT_DEVICE) != 0;
  for (int i = 0; i < b->nbufs; i++)
    if (gpupool_buffer_kind(b->bufs[i]) == GPUPOOL_MEM_DEVICE)
      p->device = 1;
  for (int i = 0; i < n; i++) {
    gpupool_refit_piece *pc = calloc((size_t)targets[i].npieces, sizeof *pc);
    p->targets[i] = targets[i];
    p->targets[i].pieces = pc;
    if (!pc) {
      p->targets[i].npieces = 0;
      gpupool_plan_free(p);
      return gpupool__err(GPUPOOL_ENOMEM, "out of memory for a plan of %d targets", n);
    }
    for (int j = 0; j < targets[i].npieces; j++) {
      pc[j] = targets[i].pieces[j];
      if (!(pc[j].key = strdup(targets[i].pieces[j].key))) {
        p->targets[i].npieces = j;
        gpupool_plan_free(p);
        return gpupool__err(GPUPOOL_ENOMEM, "out of memory for a plan of %d targets", n);
      }
    }
  }
  if ((rc = plan_compute(p, b)) != 0) {
    gpupool_plan_free(p);
    return rc;
  }
  *out = p;
  return 0;
}

static void copy_host(const op *o, const char *from) {
  char *dst = o->dst;
  if (o->sfk == FK_NONE) {
    uint64_t w = o->width * o->sesz;
    if (o->rows == 1) {
      memcpy(dst, from, w);
      return;
    }
    for (uint64_t r = 0; r < o->rows; r++)
      memcpy(dst + r * o->dpitch, from + r * o->spitch, w);
    return;
  }
  for (uint64_t r = 0; r < o->rows; r++) {
    const char *s = from + r * o->spitch;
    char *d = dst + r * o->dpitch;
    for (uint64_t e = 0; e < o->width; e++)
      gpupool__fstore(d + e * o->desz, o->dfk, gpupool__fload(s + e * o->sesz, o->sfk));
  }
}

int gpupool_refit(gpupool_plan *p, const gpupool_bundle *b, void *stream) {
  int rc;
  if (!p || !b)
    return gpupool__err(GPUPOOL_EINVAL, "refit: plan and bundle must not be NULL");
  gpupool__err_clear();
  /* Another layout (or a layout id of another connection, which may name another table):
   * the copies are computed again, checked before any target is written. Buffers shorter than
   * the copies read are another layout too, whatever the id says (never read past one). */
  int same = b->layout->id && b->layout->id == p->info.layout_id && b->c == p->c &&
             gpupool_client_reconnect_count(b->c) == p->gen && (uint32_t)b->nbufs == p->nbufs;
  for (int i = 0; same && i < b->nbufs; i++)
    same = gpupool_buffer_size(b->bufs[i]) >= p->need[i];
  if (!same) {
    for (int i = 0; i < b->nbufs; i++)
      if (gpupool_buffer_kind(b->bufs[i]) == GPUPOOL_MEM_DEVICE)
        p->device = 1;
    if ((rc = plan_compute(p, b)) != 0)
      return rc;
  }
  if (p->device) {
    /* A copy within the stream's device may go through the gather kernel; its source's device
     * is its buffer's (asked per refit: a version of the same layout may lie elsewhere). */
    int sdev = gpupool__refit_stream_device(stream);
    size_t gathered = 0;
    for (size_t i = 0; i < p->nops; i++) {
      const op *o = &p->ops[i];
      const gpupool_buffer *buf = b->bufs[o->buf];
      gpupool__refit_op *d = &p->dops[i];
      d->dst = o->dst;
      d->src = (const char *)gpupool_buffer_ptr(buf) + o->soff;
      d->dpitch = o->dpitch;
      d->spitch = o->spitch;
      d->width = o->sfk != FK_NONE ? o->width : o->width * o->sesz; /* a cast counts elements */
      d->rows = o->rows;
      d->sk = o->sfk;
      d->dk = o->dfk;
      d->sesz = o->sesz;
      d->desz = o->desz;
      d->gather = sdev >= 0 && o->ddev == sdev && gpupool_buffer_kind(buf) == GPUPOOL_MEM_DEVICE &&
                  gpupool_buffer_device(buf) == sdev;
    }
    if ((rc = gpupool__refit_copy_many(p->dops, p->nops, stream, &gathered)) != 0)
      return rc;
    p->info.gathered = gathered;
  } else {
    for (size_t i = 0; i < p->nops; i++) {
      const op *o = &p->ops[i];
      copy_host(o, (const char *)gpupool_buffer_ptr(b->bufs[o->buf]) + o->soff);
    }
  }
  p->info.refits++;
  return 0;
}

/* ---- copies into many buffers (gpupool.h) -------------------------------------------------- */

int gpupool_buffer_copy_in_many(gpupool_buffer *const *dst, const uint64_t *off, const void *const *srcs,
                                const size_t *len, int n, void *stream, unsigned flags, int *gathered) {
  gpupool__refit_op *ops = NULL;
  size_t nops = 0, g = 0;
  int sdev = -2, rc = 0;

  gpupool__err_clear();
  if (gathered)
    *gathered = 0;
  if (n < 0 || (n > 0 && (!dst || !off || !srcs || !len)))
    return gpupool__err(GPUPOOL_EINVAL, "copy_in_many: dst, off, src and len must not be NULL, n not negative");
  for (int i = 0; i < n; i++) {
    if (!dst[i] || !srcs[i])
      return gpupool__err(GPUPOOL_EINVAL, "copy_in_many: copy %d has a NULL %s", i, !dst[i] ? "buffer" : "source");
    if (gpupool_buffer_read_only(dst[i]))
      return gpupool__err(GPUPOOL_EINVAL, "copy_in_many: copy %d writes buffer %" PRIu64 ", held read-only", i,
                          gpupool_buffer_id(dst[i]));
    if (off[i] > gpupool_buffer_size(dst[i]) || len[i] > gpupool_buffer_size(dst[i]) - off[i])
      return gpupool__err(GPUPOOL_EINVAL, "copy_in_many: copy %d writes %zu bytes at offset %" PRIu64 " of a buffer "
                          "of %zu", i, len[i], off[i], gpupool_buffer_size(dst[i]));
  }
  /* Host memory into host buffers (pinned host-NUMA ones too) by the CPU, now: a copy queued
   * on a stream from pageable memory would be ordered with nothing the caller waits for. */
#define BY_CPU(i) (gpupool_buffer_kind(dst[i]) == GPUPOOL_MEM_HOST || \
                   (gpupool_buffer_kind(dst[i]) == GPUPOOL_MEM_HOST_NUMA && !(flags & GPUPOOL_COPY_SRC_ON_STREAM_DEVICE)))
  for (int i = 0; i < n; i++)
    if (BY_CPU(i) && len[i])
      memcpy((char *)gpupool_buffer_ptr(dst[i]) + off[i], srcs[i], len[i]);
    else if (!BY_CPU(i))
      nops++;
  if (nops == 0)
    return 0;
  if (!(ops = calloc(nops, sizeof *ops)))
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory");
  nops = 0;
  for (int i = 0; i < n; i++) {
    gpupool__refit_op *o;
    if (BY_CPU(i))
      continue;
    if (sdev == -2)
      sdev = (flags & GPUPOOL_COPY_SRC_ON_STREAM_DEVICE) ? gpupool__refit_stream_device(stream) : -1;
    o = &ops[nops++];
    o->dst = (char *)gpupool_buffer_ptr(dst[i]) + off[i];
    o->src = srcs[i];
    o->width = o->dpitch = o->spitch = len[i];
    o->rows = len[i] ? 1 : 0;
    o->sk = o->dk = FK_NONE;
    o->gather = sdev >= 0 && gpupool_buffer_kind(dst[i]) == GPUPOOL_MEM_DEVICE && gpupool_buffer_device(dst[i]) == sdev;
  }
#undef BY_CPU
  rc = gpupool__refit_copy_many(ops, nops, stream, &g);
  free(ops);
  if (rc == 0 && gathered)
    *gathered = (int)g;
  return rc;
}
