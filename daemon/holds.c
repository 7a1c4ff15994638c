/*
 * Inter-process events, buffers and holds: allocating a buffer, a client's holds on it
 * (its owner hold, and the holds open, get and publish give), releasing and sharing them.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "errors.h"
#include "list.h"
#include "log.h"
#include "registry_internal.h"

static gpupool__event *event_get(gpupool__registry *reg) {
  gpupool__event *e;
  if (!reg->be->ops->has_events)
    return NULL;
  if (reg->free_events) {
    e = reg->free_events;
    reg->free_events = e->next_free;
    e->next_free = NULL;
    return e;
  }
  if (gpupool__grow((void **)&reg->events, &reg->capevents, reg->nevents + 1, sizeof *reg->events) != 0)
    return NULL;
  e = calloc(1, sizeof *e);
  if (!e)
    return NULL;
  if (reg->be->ops->event_create(reg->be, &e->be, e->handle) != 0) {
    GPUPOOL__ERROR("cannot create an inter-process event: %s", gpupool__errmsg());
    free(e);
    return NULL;
  }
  e->id = ++reg->nevents;
  reg->events[e->id - 1] = e;
  return e;
}

void gpupool__event_put(gpupool__registry *reg, gpupool__event *e) {
  if (!e)
    return;
  e->next_free = reg->free_events;
  reg->free_events = e;
}

int gpupool__hold_new(gpupool__registry *reg, gpupool__client *c, gpupool__buffer *b, int read_only, int owner,
                      gpupool__hold **out) {
  gpupool__uid_usage *u = gpupool__uid_usage_get(reg, c->tenant, 1);
  gpupool__hold *h;
  int rc;
  if (!u)
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  if ((rc = gpupool__quota_holds(reg, c, u)) != 0) {
    gpupool__uid_usage_put(reg, u);
    return rc;
  }
  h = calloc(1, sizeof *h);
  if (!h) {
    gpupool__uid_usage_put(reg, u);
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  }
  h->id = gpupool__next_id(reg);
  h->buf = b;
  h->client = c;
  h->read_only = read_only;
  h->owner = owner;
  if (reg->be->ops->has_events) {
    h->done = event_get(reg);
    if (!h->done) {
      free(h);
      gpupool__uid_usage_put(reg, u);
      return gpupool__err(GPUPOOL_EBACKEND, "cannot create an inter-process event for the hold");
    }
  }
  if (gpupool__hmap_put(&reg->holds, h->id, h) != 0) {
    gpupool__event_put(reg, h->done);
    free(h);
    gpupool__uid_usage_put(reg, u);
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  }
  u->holds++;
  h->next = c->holds;
  if (c->holds)
    c->holds->prev = h;
  c->holds = h;
  c->nholds++;
  b->refs++;
  *out = h;
  return 0;
}

static int add_done_dep(gpupool__buffer *b, gpupool__event *e) {
  if (gpupool__grow((void **)&b->done, &b->capdone, b->ndone + 1, sizeof *b->done) != 0)
    return GPUPOOL_ENOMEM;
  b->done[b->ndone++] = e;
  return 0;
}

/* 0, or ENOMEM when the dependency cannot be recorded: the caller then keeps the buffer
 * referenced (leaked until the daemon stops) rather than reuse it under a live holder. */
static int add_lease_dep(gpupool__buffer *b, gpupool__lease *l) {
  if (gpupool__grow((void **)&b->leases, &b->capleases, b->nleases + 1, sizeof *b->leases) != 0)
    return GPUPOOL_ENOMEM;
  l->refs++;
  b->leases[b->nleases++] = l;
  return 0;
}

void gpupool__hold_drop(gpupool__registry *reg, gpupool__hold *h, int done_recorded, gpupool__lease *lease) {
  gpupool__client *c = h->client;
  gpupool__buffer *b = h->buf;
  GPUPOOL__LIST_UNLINK(c->holds, h, prev, next);
  c->nholds--;
  {
    gpupool__uid_usage *u = gpupool__uid_usage_get(reg, c->tenant, 0);
    if (u) {
      u->holds--;
      gpupool__uid_usage_put(reg, u);
    }
  }
  gpupool__hmap_del(&reg->holds, h->id);
  if (h->done) {
    if (done_recorded && add_done_dep(b, h->done) == 0)
      h->done = NULL;
    else
      gpupool__event_put(reg, h->done);
  }
  free(h);
  if (lease && !lease->gone && reg->be->ops->has_events)
    b->died_in_use = 1;
  if (lease && !lease->gone && add_lease_dep(b, lease) != 0) {
    GPUPOOL__ERROR("out of memory recording that buffer %" PRIu64 " waits for a lease; it stays allocated until "
                   "the daemon restarts",
                   b->id);
    return;
  }
  gpupool__buffer_unref(reg, b);
}

int gpupool__hold_of(gpupool__registry *reg, gpupool__client *c, uint64_t id, gpupool__hold **out) {
  gpupool__hold *h = gpupool__hmap_get(&reg->holds, id);
  if (!h)
    return gpupool__err(GPUPOOL_ENOENT,
                        "hold %" PRIu64 " does not exist (never issued, or already released)", id);
  if (h->client != c)
    return gpupool__err(GPUPOOL_EPERM,
                        "hold %" PRIu64 " belongs to another client; a client can only use and release its own holds",
                        id);
  *out = h;
  return 0;
}

/* The alignment an allocation in p gets: *align as asked (0 = the pool's), never below the
 * pool's; EINVAL unless a power of two up to 2 MiB. */
int gpupool__pool_alignment(const gpupool__pool *p, uint64_t *align) {
  if (*align == 0)
    *align = p->cfg.alignment;
  if (*align & (*align - 1) || *align > SLAB_GRAIN)
    return gpupool__err(GPUPOOL_EINVAL, "alignment %" PRIu64 " must be a power of two up to 2 MiB", *align);
  if (*align < p->cfg.alignment)
    *align = p->cfg.alignment;
  return 0;
}

int gpupool__allocate(gpupool__registry *reg, gpupool__client *c, gpupool__pool *p, uint64_t size, uint64_t align,
                gpupool__hold **out) {
  gpupool__buffer *b = NULL;
  gpupool__slab *s;
  uint64_t off, asize, owner;
  int rc;

  if (size == 0)
    return gpupool__err(GPUPOOL_EINVAL, "cannot allocate 0 bytes; ask for at least 1");
  if ((rc = gpupool__pool_owner(reg, c, p, &owner)) != 0 || (rc = gpupool__pool_alignment(p, &align)) != 0)
    return rc;
  if (size > GPUPOOL_SLAB_HARD_MAX)
    return gpupool__place(reg, p, owner, size, size, align, &s, &off); /* produces the ETOOBIG message */
  asize = gpupool__round_up(size, p->cfg.alignment);
  if ((rc = gpupool__quota_waiting_leases(reg, c)) != 0 || (rc = gpupool__quota_memory(reg, c, asize)) != 0)
    return rc;
  if ((rc = gpupool__place(reg, p, owner, size, asize, align, &s, &off)) != 0)
    return rc;
  if (s->dedicated)
    asize = s->bs.size;
  b = calloc(1, sizeof *b);
  if (!b) {
    rc = gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
    goto fail_range;
  }
  b->id = gpupool__next_id(reg);
  b->slab = s;
  b->offset = off;
  b->size = asize;
  b->asked = size;
  b->owner_uid = c->uid;
  b->owner_tenant = c->tenant;
  b->owner_pid = c->pid;
  b->owner_client = c->id;
  b->created_ns = gpupool__now_ns();
  /* The share token's secret: from the kernel-seeded generator in libc, without a system
   * call per allocation. */
  arc4random_buf(b->secret, sizeof b->secret);
  arc4random_buf(b->secret_ro, sizeof b->secret_ro);
  if (reg->be->ops->has_events && !(b->ready = event_get(reg))) {
    rc = gpupool__err(GPUPOOL_EBACKEND, "cannot create the buffer's ready event");
    goto fail_buf;
  }
  if (gpupool__hmap_put(&reg->buffers, b->id, b) != 0) {
    rc = gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
    goto fail_ev;
  }
  s->nbuffers++;
  p->used += asize;
  if (p->used > p->used_high)
    p->used_high = p->used;
  p->nbuffers++;
  c->bytes += asize;
  c->allocs++;
  gpupool__uid_account(reg, c->tenant, (int64_t)asize, 1);
  rc = gpupool__hold_new(reg, c, b, 0, 1, out);
  if (rc != 0) {
    /* refs is 0: undo through the normal path so every counter goes back. */
    b->refs = 1;
    gpupool__buffer_unref(reg, b);
    return rc;
  }
  return 0;
fail_ev:
  gpupool__event_put(reg, b->ready);
fail_buf:
  free(b);
fail_range:
  if (s->alloc)
    gpupool__alloc_put(s->alloc, off, asize);
  gpupool__slab_maybe_retire(reg, s);
  return rc;
}

int gpupool__release(gpupool__registry *reg, gpupool__client *c, uint64_t hold_id, int done_recorded, int *freed) {
  gpupool__hold *h = NULL;
  int rc = gpupool__hold_of(reg, c, hold_id, &h);
  if (rc != 0)
    return rc;
  *freed = h->buf->refs == 1;
  gpupool__hold_drop(reg, h, done_recorded, NULL);
  return 0;
}

int gpupool__share(gpupool__registry *reg, gpupool__client *c, uint64_t hold_id, uint8_t token[GPUPOOL_TOKEN_SIZE]) {
  gpupool__hold *h = NULL;
  int rc = gpupool__hold_of(reg, c, hold_id, &h);
  if (rc != 0)
    return rc;
  for (int i = 0; i < 8; i++)
    token[i] = (uint8_t)(h->buf->id >> (8 * i));
  /* A read-only hold shares read-only: its token carries the read-only secret. */
  memcpy(token + 8, h->read_only ? h->buf->secret_ro : h->buf->secret, sizeof h->buf->secret);
  return 0;
}

int gpupool__open(gpupool__registry *reg, gpupool__client *c, const uint8_t *token, size_t len, int read_only,
            gpupool__hold **out) {
  uint64_t id = 0;
  gpupool__buffer *b;
  uint8_t diff = 0;
  int rc;
  if (len != GPUPOOL_TOKEN_SIZE)
    return gpupool__err(GPUPOOL_EINVAL, "share token has %zu bytes, expected %d", len, GPUPOOL_TOKEN_SIZE);
  for (int i = 0; i < 8; i++)
    id |= (uint64_t)token[i] << (8 * i);
  b = gpupool__hmap_get(&reg->buffers, id);
  if (b) {
    uint8_t diff_ro = 0;
    for (size_t i = 0; i < sizeof b->secret; i++) {
      diff |= (uint8_t)(b->secret[i] ^ token[8 + i]);
      diff_ro |= (uint8_t)(b->secret_ro[i] ^ token[8 + i]);
    }
    if (diff && !diff_ro) {
      diff = 0;
      read_only = 1; /* a token from a read-only hold opens read-only, whatever is asked */
    }
  }
  /* A buffer of another tenant is refused like a forged token: its holder would get the fd
   * of a slab that holds that tenant's other buffers too. */
  if (!b || diff || !gpupool__owner_reachable(reg, c, b->slab->owner))
    return gpupool__err(GPUPOOL_ENOENT,
                        "share token does not name a live buffer of your tenant (the buffer was freed, the "
                        "token is forged, or it belongs to another tenant: share across tenants through a "
                        "pool shared with a group)");
  if ((rc = gpupool__quota_waiting_leases(reg, c)) != 0)
    return rc;
  return gpupool__hold_new(reg, c, b, read_only, 0, out);
}

void gpupool__hold_discard(gpupool__registry *reg, gpupool__hold *h) { gpupool__hold_drop(reg, h, 0, NULL); }
