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

/* An idle event (refs 1), or a new one: NULL with the reason when the backend makes no more
 * (CUDA: 4096 per process). */
static gpd_event *event_new(gpd_registry *reg) {
  gpd_event *e;
  if (reg->free_events) {
    e = reg->free_events;
    reg->free_events = e->next_free;
    e->next_free = NULL;
    e->refs = 1;
    return e;
  }
  if (gpd_grow((void **)&reg->events, &reg->capevents, reg->nevents + 1, sizeof *reg->events) != 0 ||
      !(e = calloc(1, sizeof *e))) {
    gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
    return NULL;
  }
  if (reg->be->ops->event_create(reg->be, &e->be, e->handle) != 0) {
    char msg[GPUPOOL__ERRMSG_MAX];
    snprintf(msg, sizeof msg, "%s", gpupool__errmsg());
    free(e);
    gpupool__err(GPUPOOL_EBACKEND, "cannot create an inter-process event (%u exist; CUDA allows 4096 per process): %s",
                 reg->nevents, msg);
    return NULL;
  }
  e->id = ++reg->nevents;
  e->refs = 1;
  reg->events[e->id - 1] = e;
  return e;
}

/* An event of another client's own that nothing uses (its table holds the only reference),
 * taken out of that table: what a client without events gets when the backend makes no more.
 * It may still carry a record of that client's, which the new user's first record waits for
 * (cumulative recording), so nothing of it is lost. NULL when there is none. */
static gpd_event *event_steal(gpd_registry *reg, const gpd_client *c) {
  for (size_t i = 0; i < reg->clients.cap; i++) {
    gpd_client *o;
    if (!gpupool__hmap_slot_used(&reg->clients, i) || (o = reg->clients.slots[i].val) == c)
      continue;
    for (uint32_t j = 0; j < o->nevents; j++) {
      gpd_event *e = o->events[j];
      if (e->refs != 1 || e == o->batch_done)
        continue;
      o->events[j] = o->events[--o->nevents];
      return e;
    }
  }
  return NULL;
}

gpd_event *gpd_event_get(gpd_registry *reg, gpd_client *c) {
  gpd_event *e;
  if (!reg->be->ops->has_events)
    return NULL;
  if (!c)
    return event_new(reg);
  if (c->batch_done) {
    c->batch_done->refs++;
    return c->batch_done;
  }
  if (c->nevents < GPD_EVENTS_PER_CLIENT) {
    if ((e = event_new(reg)) || (c->nevents == 0 && (e = event_steal(reg, c)))) {
      if (gpd_grow((void **)&c->events, &c->capevents, c->nevents + 1, sizeof *c->events) == 0) {
        c->events[c->nevents++] = e;
        e->refs++;
      }
      return e;
    }
    if (c->nevents == 0) {
      char msg[GPUPOOL__ERRMSG_MAX];
      snprintf(msg, sizeof msg, "%s", gpupool__errmsg());
      gpupool__err(GPUPOOL_EBACKEND,
                   "%s; this client has none of its own yet (each client uses at most %d, shared by its "
                   "holds beyond that) and every other client's are in use: retry once some are released "
                   "or their clients disconnect",
                   msg, GPD_EVENTS_PER_CLIENT);
      return NULL;
    }
    /* The daemon has none left: this client shares the ones it has. */
  }
  e = c->events[c->next_event++ % c->nevents];
  e->refs++;
  return e;
}

void gpd_event_put(gpd_registry *reg, gpd_event *e) {
  if (!e || --e->refs > 0)
    return;
  e->next_free = reg->free_events;
  reg->free_events = e;
}

int gpd_batch_begin(gpd_registry *reg, gpd_client *c) {
  if (!reg->be->ops->has_events || c->batch_done)
    return 0;
  if (!(c->batch_done = gpd_event_get(reg, c)))
    return gpupool__err(GPUPOOL_EBACKEND, "cannot get an inter-process event for the holds of this request: %s",
                        gpupool__errmsg());
  return 0;
}

void gpd_batch_end(gpd_registry *reg, gpd_client *c) {
  gpd_event *e = c->batch_done;
  c->batch_done = NULL;
  gpd_event_put(reg, e);
}

void gpd_client_events_drop(gpd_registry *reg, gpd_client *c) {
  gpd_batch_end(reg, c);
  for (uint32_t i = 0; i < c->nevents; i++)
    gpd_event_put(reg, c->events[i]);
  free(c->events);
  c->events = NULL;
  c->nevents = c->capevents = 0;
}

int gpd_hold_new(gpd_registry *reg, gpd_client *c, gpd_buffer *b, int read_only, int owner,
                      gpd_hold **out) {
  gpd_uid_usage *u = gpd_uid_usage_get(reg, c->tenant, 1);
  gpd_hold *h;
  int rc;
  if (!u)
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  if ((rc = gpd_quota_holds(reg, c, u)) != 0) {
    gpd_uid_usage_put(reg, u);
    return rc;
  }
  h = calloc(1, sizeof *h);
  if (!h) {
    gpd_uid_usage_put(reg, u);
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  }
  h->id = gpd_next_id(reg);
  h->buf = b;
  h->client = c;
  h->read_only = read_only;
  h->owner = owner;
  if (reg->be->ops->has_events) {
    h->done = gpd_event_get(reg, c);
    if (!h->done) {
      char msg[GPUPOOL__ERRMSG_MAX];
      snprintf(msg, sizeof msg, "%s", gpupool__errmsg());
      free(h);
      gpd_uid_usage_put(reg, u);
      return gpupool__err(GPUPOOL_EBACKEND, "cannot get an inter-process event for the hold: %s", msg);
    }
  }
  if (gpupool__hmap_put(&reg->holds, h->id, h) != 0) {
    gpd_event_put(reg, h->done);
    free(h);
    gpd_uid_usage_put(reg, u);
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  }
  u->holds++;
  h->next = c->holds;
  if (c->holds)
    c->holds->prev = h;
  c->holds = h;
  c->nholds++;
  b->refs++;
  if (reg->keep)
    reg->keep->client_changed(reg, c);
  *out = h;
  return 0;
}

static int add_done_dep(gpd_registry *reg, gpd_buffer *b, gpd_event *e) {
  /* Shared by several holds of b (one request's): one dependency is enough. */
  for (uint32_t i = 0; i < b->ndone; i++)
    if (b->done[i] == e) {
      gpd_event_put(reg, e);
      return 0;
    }
  /* A buffer that lives on while holder after holder lets go (one sent again and again)
   * would gather their done events without end: before the table grows, give back those
   * that have completed (amortized: only when it is full). */
  if (b->ndone > 0 && b->ndone == b->capdone) {
    uint32_t keep = 0;
    for (uint32_t i = 0; i < b->ndone; i++) {
      if (reg->be->ops->event_query(b->done[i]->be) == 0)
        b->done[keep++] = b->done[i];
      else
        gpd_event_put(reg, b->done[i]);
    }
    b->ndone = keep;
  }
  if (gpd_grow((void **)&b->done, &b->capdone, b->ndone + 1, sizeof *b->done) != 0)
    return GPUPOOL_ENOMEM;
  b->done[b->ndone++] = e;
  return 0;
}

/* 0, or ENOMEM when the dependency cannot be recorded: the caller then keeps the buffer
 * referenced (leaked until the daemon stops) rather than reuse it under a live holder. */
static int add_lease_dep(gpd_buffer *b, gpd_lease *l) {
  if (gpd_grow((void **)&b->leases, &b->capleases, b->nleases + 1, sizeof *b->leases) != 0)
    return GPUPOOL_ENOMEM;
  l->refs++;
  b->leases[b->nleases++] = l;
  return 0;
}

void gpd_hold_drop(gpd_registry *reg, gpd_hold *h, int done_recorded, gpd_lease *lease) {
  gpd_client *c = h->client;
  gpd_buffer *b = h->buf;
  GPUPOOL__LIST_UNLINK(c->holds, h, prev, next);
  c->nholds--;
  if (reg->keep)
    reg->keep->client_changed(reg, c);
  {
    gpd_uid_usage *u = gpd_uid_usage_get(reg, c->tenant, 0);
    if (u) {
      u->holds--;
      gpd_uid_usage_put(reg, u);
    }
  }
  gpupool__hmap_del(&reg->holds, h->id);
  if (h->done) {
    if (done_recorded && add_done_dep(reg, b, h->done) == 0)
      h->done = NULL;
    else
      gpd_event_put(reg, h->done);
  }
  free(h);
  if (lease && !lease->gone && reg->be->ops->has_events) {
    b->died_in_use = 1;
    if (reg->keep)
      reg->keep->buffer_changed(reg, b);
  }
  if (lease && !lease->gone && add_lease_dep(b, lease) != 0) {
    GPUPOOL__ERROR("out of memory recording that buffer %" PRIu64 " waits for a lease; it stays allocated until "
                   "the daemon restarts",
                   b->id);
    return;
  }
  gpd_buffer_unref(reg, b);
}

int gpd_hold_of(gpd_registry *reg, gpd_client *c, uint64_t id, gpd_hold **out) {
  gpd_hold *h = gpupool__hmap_get(&reg->holds, id);
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
int gpd_pool_alignment(const gpd_pool *p, uint64_t *align) {
  if (*align == 0)
    *align = p->cfg.alignment;
  if (*align & (*align - 1) || *align > SLAB_GRAIN)
    return gpupool__err(GPUPOOL_EINVAL, "alignment %" PRIu64 " must be a power of two up to 2 MiB", *align);
  if (*align < p->cfg.alignment)
    *align = p->cfg.alignment;
  return 0;
}

/* Place a new buffer of size bytes (asize rounded) in p for owner: in the buffer table, counted in
 * its slab and pool, refs 0, no owner fields set. */
int gpd_buffer_place(gpd_registry *reg, gpd_client *c, gpd_pool *p, uint64_t owner, uint64_t size,
                     uint64_t asize, uint64_t align, int place, gpd_buffer **out) {
  gpd_buffer *b = NULL;
  gpd_slab *s;
  uint64_t off;
  int rc;
  if ((rc = gpd_place(reg, p, owner, size, asize, align, place, &s, &off)) != 0)
    return rc;
  if (s->dedicated)
    asize = s->bs.size;
  b = calloc(1, sizeof *b);
  if (!b) {
    rc = gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
    goto fail_range;
  }
  b->id = gpd_next_id(reg);
  b->slab = s;
  b->offset = off;
  b->size = asize;
  b->asked = size;
  b->created_ns = gpd_now_ns();
  /* The share token's secret: from the kernel-seeded generator in libc, without a system
   * call per allocation. */
  arc4random_buf(b->secret, sizeof b->secret);
  arc4random_buf(b->secret_ro, sizeof b->secret_ro);
  if (reg->be->ops->has_events && !(b->ready = gpd_event_get(reg, c))) {
    char msg[GPUPOOL__ERRMSG_MAX];
    snprintf(msg, sizeof msg, "%s", gpupool__errmsg());
    rc = gpupool__err(GPUPOOL_EBACKEND, "cannot get the buffer's ready event: %s", msg);
    goto fail_buf;
  }
  if (gpupool__hmap_put(&reg->buffers, b->id, b) != 0) {
    rc = gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
    goto fail_ev;
  }
  if (reg->keep)
    reg->keep->buffer_changed(reg, b);
  s->nbuffers++;
  p->used += asize;
  if (p->used > p->used_high)
    p->used_high = p->used;
  p->nbuffers++;
  *out = b;
  return 0;
fail_ev:
  gpd_event_put(reg, b->ready);
fail_buf:
  free(b);
fail_range:
  if (s->alloc)
    gpupool__alloc_put(s->alloc, off, asize);
  gpd_slab_maybe_retire(reg, s);
  return rc;
}

int gpd_allocate(gpd_registry *reg, gpd_client *c, gpd_pool *p, uint64_t size, uint64_t align,
                gpd_hold **out) {
  return gpd_allocate_as(reg, c, p, size, align, 0, out);
}

int gpd_allocate_as(gpd_registry *reg, gpd_client *c, gpd_pool *p, uint64_t size, uint64_t align, int place,
                    gpd_hold **out) {
  gpd_buffer *b = NULL;
  gpd_slab *s;
  uint64_t off, asize, owner;
  int rc;

  if (size == 0)
    return gpupool__err(GPUPOOL_EINVAL, "cannot allocate 0 bytes; ask for at least 1");
  if ((rc = gpd_pool_owner(reg, c, p, &owner)) != 0 || (rc = gpd_pool_alignment(p, &align)) != 0)
    return rc;
  if (size > GPUPOOL_SLAB_HARD_MAX)
    return gpd_place(reg, p, owner, size, size, align, 0, &s, &off); /* produces the ETOOBIG message */
  asize = gpd_round_up(size, p->cfg.alignment);
  if ((rc = gpd_quota_waiting_leases(reg, c)) != 0 || (rc = gpd_quota_memory(reg, c, asize)) != 0)
    return rc;
  if ((rc = gpd_buffer_place(reg, c, p, owner, size, asize, align, place, &b)) != 0)
    return rc;
  b->owner_uid = c->uid;
  b->owner_tenant = c->tenant;
  b->owner_pid = c->pid;
  b->owner_client = c->id;
  c->bytes += b->size;
  c->allocs++;
  gpd_uid_account(reg, c->tenant, (int64_t)b->size, 1);
  rc = gpd_hold_new(reg, c, b, 0, 1, out);
  if (rc != 0) {
    /* refs is 0: undo through the normal path so every counter goes back. */
    b->refs = 1;
    gpd_buffer_unref(reg, b);
    return rc;
  }
  return 0;
}

int gpd_release(gpd_registry *reg, gpd_client *c, uint64_t hold_id, int done_recorded, int *freed) {
  gpd_hold *h = NULL;
  int rc = gpd_hold_of(reg, c, hold_id, &h);
  if (rc != 0)
    return rc;
  *freed = h->buf->refs == 1;
  gpd_hold_drop(reg, h, done_recorded, NULL);
  return 0;
}

static void keep_timer_arm(gpd_registry *reg);

/* Drop a kept share: its buffer loses the keep's reference (and goes if that was the last). */
static void keep_drop(gpd_registry *reg, gpd_keep *k) {
  gpd_uid_usage *u = gpd_uid_usage_get(reg, k->tenant, 0);
  gpd_client *maker = k->client_id ? gpupool__hmap_get(&reg->clients, k->client_id) : NULL;
  if (reg->keep && !reg->stopped)
    reg->keep->share_gone(reg, k->id);
  if (k->prev)
    k->prev->next = k->next;
  else
    reg->keeps_head = k->next;
  if (k->next)
    k->next->prev = k->prev;
  else
    reg->keeps_tail = k->prev;
  gpupool__hmap_del(&reg->keeps, k->id);
  if (u) {
    u->holds--;
    gpd_uid_usage_put(reg, u);
  }
  if (maker)
    maker->nkept--;
  gpd_buffer_unref(reg, k->buf);
  free(k);
}

static void keep_timer_cb(uv_timer_t *t) {
  gpd_registry *reg = t->data;
  uint64_t now = gpd_now_ns(), n = 0;
  reg->keep_timer_on = 0;
  while (reg->keeps_head && reg->keeps_head->expires_ns <= now) {
    keep_drop(reg, reg->keeps_head);
    n++;
  }
  if (n)
    GPUPOOL__DEBUG("%" PRIu64 " kept share(s) expired unopened after share_keep_ms", n);
  keep_timer_arm(reg);
}

static void keep_timer_arm(gpd_registry *reg) {
  uint64_t now = gpd_now_ns(), ms;
  if (reg->keep_timer_on || reg->stopped || !reg->keeps_head)
    return;
  ms = reg->keeps_head->expires_ns > now ? (reg->keeps_head->expires_ns - now + 999999) / 1000000 : 0;
  uv_timer_start(&reg->keep_timer, keep_timer_cb, ms, 0);
  reg->keep_timer_on = 1;
}

void gpd_keeps_init(gpd_registry *reg) {
  gpupool__hmap_init(&reg->keeps);
  gpupool__hmap_init(&reg->reserves);
  uv_timer_init(reg->loop, &reg->keep_timer);
  reg->keep_timer.data = reg;
}

void gpd_keeps_stop(gpd_registry *reg) {
  if (reg->keep_timer_on)
    uv_timer_stop(&reg->keep_timer);
  reg->keep_timer_on = 0;
}

void gpd_keeps_close(gpd_registry *reg) {
  gpd_keeps_stop(reg);
  while (reg->keeps_head)
    keep_drop(reg, reg->keeps_head);
  gpupool__hmap_free(&reg->keeps);
  gpupool__hmap_free(&reg->reserves);
  uv_close((uv_handle_t *)&reg->keep_timer, NULL);
}

/* Into the list by expiry: almost always at its end (share_keep_ms after now), before it for
 * one made after a restart with a shorter share_keep_ms than a restored one's. */
static void keep_link(gpd_registry *reg, gpd_keep *k) {
  gpd_keep *at = reg->keeps_tail;
  while (at && at->expires_ns > k->expires_ns)
    at = at->prev;
  k->prev = at;
  k->next = at ? at->next : reg->keeps_head;
  if (k->next)
    k->next->prev = k;
  else
    reg->keeps_tail = k;
  if (at)
    at->next = k;
  else
    reg->keeps_head = k;
  if (!at && reg->keep_timer_on) { /* a new head: the timer may be set for a later one */
    uv_timer_stop(&reg->keep_timer);
    reg->keep_timer_on = 0;
  }
  keep_timer_arm(reg);
}

/* A new kept share of h for c: its id and secret made here, or (secret non-NULL) id and
 * secret as given (a token the client made from its reserve). */
static int keep_new(gpd_registry *reg, gpd_client *c, gpd_hold *h, uint64_t id, const uint8_t *secret,
                    gpd_keep **out) {
  gpd_uid_usage *u = gpd_uid_usage_get(reg, c->tenant, 1);
  gpd_keep *k;
  int rc;
  if (!u)
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  if ((rc = gpd_quota_kept_shares(reg, c, u)) != 0) {
    gpd_uid_usage_put(reg, u);
    return rc;
  }
  if (!(k = calloc(1, sizeof *k))) {
    gpd_uid_usage_put(reg, u);
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  }
  k->id = secret ? id : gpd_next_id(reg);
  k->buf = h->buf;
  k->read_only = h->read_only;
  k->tenant = c->tenant;
  k->client_id = c->id;
  k->expires_ns = gpd_now_ns() + (uint64_t)reg->cfg->share_keep_ms * 1000000u;
  if (secret)
    memcpy(k->secret, secret, sizeof k->secret);
  else
    arc4random_buf(k->secret, sizeof k->secret);
  if (gpupool__hmap_put(&reg->keeps, k->id, k) != 0) {
    free(k);
    gpd_uid_usage_put(reg, u);
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  }
  u->holds++;
  c->nkept++;
  k->buf->refs++;
  keep_link(reg, k);
  if (reg->keep)
    reg->keep->share_kept(reg, k);
  *out = k;
  return 0;
}

int gpd_keep_restore(gpd_registry *reg, uint64_t id, gpd_buffer *b, const uint8_t secret[16], int read_only,
                     uint64_t tenant, uint64_t expires_ns) {
  gpd_uid_usage *u = gpd_uid_usage_get(reg, tenant, 1);
  gpd_keep *k;
  if (!u)
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  if (!(k = calloc(1, sizeof *k))) {
    gpd_uid_usage_put(reg, u);
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  }
  k->id = id;
  k->buf = b;
  memcpy(k->secret, secret, sizeof k->secret);
  k->read_only = read_only;
  k->tenant = tenant;
  k->client_id = 0; /* its maker's connection went with the previous daemon */
  k->expires_ns = expires_ns;
  if (gpupool__hmap_put(&reg->keeps, k->id, k) != 0) {
    free(k);
    gpd_uid_usage_put(reg, u);
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  }
  u->holds++;
  b->refs++;
  keep_link(reg, k);
  return 0;
}

static void token_put(uint8_t token[GPUPOOL_TOKEN_SIZE], uint64_t id, const uint8_t secret[16]) {
  for (int i = 0; i < 8; i++)
    token[i] = (uint8_t)(id >> (8 * i));
  memcpy(token + 8, secret, 16);
}

static int secret_differs(const uint8_t *a, const uint8_t *b) {
  uint8_t diff = 0;
  for (size_t i = 0; i < 16; i++)
    diff |= (uint8_t)(a[i] ^ b[i]);
  return diff != 0;
}

int gpd_share(gpd_registry *reg, gpd_client *c, uint64_t hold_id, int keep, uint8_t token[GPUPOOL_TOKEN_SIZE]) {
  gpd_hold *h = NULL;
  gpd_keep *k = NULL;
  int rc = gpd_hold_of(reg, c, hold_id, &h);
  if (rc != 0)
    return rc;
  if (keep) {
    if ((rc = keep_new(reg, c, h, 0, NULL, &k)) != 0)
      return rc;
    token_put(token, k->id, k->secret);
    return 0;
  }
  /* A read-only hold shares read-only: its token carries the read-only secret. */
  token_put(token, h->buf->id, h->read_only ? h->buf->secret_ro : h->buf->secret);
  return 0;
}

/* Kept shares of hold_ids[0..n) for c, all or nothing; secrets NULL: ids and secrets made
 * here, else ids first.. and secrets[16 * i ...]. */
static int share_kept(gpd_registry *reg, gpd_client *c, const uint64_t *hold_ids, size_t n, int ready_together,
                      uint64_t first, const uint8_t *secrets, uint8_t (*tokens)[GPUPOOL_TOKEN_SIZE]) {
  gpd_hold *h = NULL;
  gpd_keep **ks = NULL;
  size_t made = 0;
  uint64_t group = 0;
  int rc = 0;
  for (size_t i = 0; i < n; i++)
    if ((rc = gpd_hold_of(reg, c, hold_ids[i], &h)) != 0)
      return rc;
  if (n && !(ks = calloc(n, sizeof *ks)))
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  if (ready_together && n > 1)
    group = gpd_next_id(reg);
  for (; made < n; made++) {
    h = gpupool__hmap_get(&reg->holds, hold_ids[made]);
    if ((rc = keep_new(reg, c, h, first + made, secrets ? secrets + 16 * made : NULL, &ks[made])) != 0)
      break;
    ks[made]->ready_group = group;
    if (tokens)
      token_put(tokens[made], ks[made]->id, ks[made]->secret);
  }
  if (rc != 0) {
    /* All or nothing: the kept shares made so far go (their buffers keep the client's holds). */
    char msg[GPUPOOL__ERRMSG_MAX];
    snprintf(msg, sizeof msg, "%s", gpupool__errmsg());
    while (made > 0)
      keep_drop(reg, ks[--made]);
    rc = gpupool__err(rc, "%s (none of the %zu holds of this request was shared)", msg, n);
  }
  free(ks);
  return rc;
}

int gpd_share_many(gpd_registry *reg, gpd_client *c, const uint64_t *hold_ids, size_t n, int keep,
                   int ready_together, uint8_t (*tokens)[GPUPOOL_TOKEN_SIZE]) {
  gpd_hold *h = NULL;
  int rc = 0;
  if (keep)
    return share_kept(reg, c, hold_ids, n, ready_together, 0, NULL, tokens);
  for (size_t i = 0; i < n; i++)
    if ((rc = gpd_hold_of(reg, c, hold_ids[i], &h)) != 0)
      return rc;
  for (size_t i = 0; i < n; i++)
    if ((rc = gpd_share(reg, c, hold_ids[i], 0, tokens[i])) != 0)
      return rc;
  return 0;
}

/* ---- reserved ids: kept shares whose tokens the client makes itself ----
 *
 * A client that does not want to wait for a Share's reply (a message handed on at once) asks
 * for a block of ids first; each later share of n holds takes its next n ids, in order, with
 * secrets the client drew, so the client knows the tokens before the daemon has read the
 * request. The blocks are aligned (GPD_RESERVE_IDS), filed by block in reg->reserves: an Open
 * of an id a connection reserved and has not used yet waits for its share (the server parks
 * it). */

static void reserve_unfile(gpd_registry *reg, gpd_client *c) {
  if (c->resv_end && gpupool__hmap_get(&reg->reserves, (c->resv_end - 1) / GPD_RESERVE_IDS) == c)
    gpupool__hmap_del(&reg->reserves, (c->resv_end - 1) / GPD_RESERVE_IDS);
  c->resv_next = c->resv_end = 0;
}

int gpd_reserve(gpd_registry *reg, gpd_client *c, uint32_t want, uint64_t *first, uint32_t *count) {
  uint64_t f;
  if (want > GPD_RESERVE_IDS)
    want = GPD_RESERVE_IDS;
  reserve_unfile(reg, c);
  /* The next whole block of ids, taken from the registry's one counter. */
  f = gpd_round_up(reg->next_id + 1, GPD_RESERVE_IDS);
  if (gpupool__hmap_put(&reg->reserves, f / GPD_RESERVE_IDS, c) != 0)
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  reg->next_id = f + GPD_RESERVE_IDS - 1;
  c->resv_next = f;
  c->resv_end = f + want;
  *first = f;
  *count = want;
  return 0;
}

gpd_client *gpd_reserve_owner(gpd_registry *reg, uint64_t id) {
  gpd_client *c = gpupool__hmap_get(&reg->reserves, id / GPD_RESERVE_IDS);
  return c && id >= c->resv_next && id < c->resv_end ? c : NULL;
}

void gpd_reserve_drop(gpd_registry *reg, gpd_client *c) {
  reserve_unfile(reg, c);
  free(c->fail_msg);
  c->fail_msg = NULL;
}

int gpd_share_reserved(gpd_registry *reg, gpd_client *c, const uint64_t *hold_ids, size_t n, int ready_together,
                       const uint8_t *secrets, uint64_t *first) {
  uint64_t f = c->resv_next, left = c->resv_end - c->resv_next;
  int rc;
  *first = f;
  if (n > left) {
    c->resv_next = c->resv_end; /* the client and the daemon no longer agree: nothing is left */
    rc = gpupool__err(GPUPOOL_EINVAL,
                      "Share.from_reserve shares %zu holds but only %" PRIu64 " reserved ids are left: "
                      "reserve more first (Share.reserve); nothing was shared", n, left);
  } else {
    c->resv_next += n;
    rc = share_kept(reg, c, hold_ids, n, ready_together, f, secrets, NULL);
  }
  if (rc != 0) {
    free(c->fail_msg);
    c->fail_first = f;
    c->fail_end = f + n;
    c->fail_msg = strdup(gpupool__errmsg());
  }
  return rc;
}

/* The buffer a token names for c (and its kept share, if it is one), or ENOENT. *read_only
 * becomes 1 when the token opens read-only whatever is asked. */
static int token_resolve(gpd_registry *reg, gpd_client *c, const uint8_t *token, size_t len, int *read_only,
                         gpd_buffer **bp, gpd_keep **kp) {
  uint64_t id = 0;
  gpd_buffer *b;
  gpd_keep *k = NULL;
  int bad = 0;
  if (len != GPUPOOL_TOKEN_SIZE)
    return gpupool__err(GPUPOOL_EINVAL, "share token has %zu bytes, expected %d", len, GPUPOOL_TOKEN_SIZE);
  for (int i = 0; i < 8; i++)
    id |= (uint64_t)token[i] << (8 * i);
  b = gpupool__hmap_get(&reg->buffers, id);
  if (b) {
    if (!secret_differs(b->secret, token + 8))
      ;
    else if (!secret_differs(b->secret_ro, token + 8))
      *read_only = 1; /* a token from a read-only hold opens read-only, whatever is asked */
    else
      bad = 1;
  } else if ((k = gpupool__hmap_get(&reg->keeps, id))) {
    /* A kept share opens once: the opener's hold takes the keep's place. */
    b = k->buf;
    bad = secret_differs(k->secret, token + 8) || k->claimed;
    if (k->read_only)
      *read_only = 1;
  } else {
    /* An id a connection reserved: its share may not have been read yet (wait for it), or
     * it failed (say why). */
    gpd_client *x = gpupool__hmap_get(&reg->reserves, id / GPD_RESERVE_IDS);
    if (x && id >= x->resv_next && id < x->resv_end) {
      reg->open_pending = id;
      return GPD_OPEN_PENDING;
    }
    if (x && x->fail_msg && id >= x->fail_first && id < x->fail_end)
      return gpupool__err(GPUPOOL_ENOENT, "share token names a share that failed: its sender (client %" PRIu64
                          ", pid %d) handed the token on before its share was read, and the share failed: %s",
                          x->id, (int)x->pid, x->fail_msg);
  }
  /* A buffer of another tenant is refused like a forged token: its holder would get the fd
   * of a slab that holds that tenant's other buffers too. */
  if (!b || bad || !gpd_owner_reachable(reg, c, b->slab->owner))
    return gpupool__err(GPUPOOL_ENOENT,
                        "share token does not name a live buffer of your tenant (the buffer was freed, a "
                        "kept share was opened already or expired after share_keep_ms, the token is forged, "
                        "or it belongs to another tenant: share across tenants through a pool shared with "
                        "a group)");
  *bp = b;
  *kp = k;
  return 0;
}

int gpd_open(gpd_registry *reg, gpd_client *c, const uint8_t *token, size_t len, int read_only,
            gpd_hold **out) {
  gpd_buffer *b = NULL;
  gpd_keep *k = NULL;
  int rc;
  if ((rc = token_resolve(reg, c, token, len, &read_only, &b, &k)) != 0)
    return rc;
  if ((rc = gpd_quota_waiting_leases(reg, c)) != 0)
    return rc;
  if ((rc = gpd_hold_new(reg, c, b, read_only, 0, out)) != 0)
    return rc;
  if (k) {
    (*out)->ready_group = k->ready_group;
    keep_drop(reg, k);
  }
  return 0;
}

int gpd_open_many(gpd_registry *reg, gpd_client *c, const uint8_t *const *tokens, const size_t *lens, size_t n,
                  int read_only, unsigned max_fds, gpd_hold **out, size_t *opened) {
  gpd_buffer **bs = NULL;
  gpd_keep **ks = NULL;
  int *ro = NULL;
  const gpd_slab *fd_slabs[GPUPOOL_WIRE_MAX_FDS];
  unsigned nfd = 0;
  size_t m = 0, made = 0;
  int rc = 0;
  *opened = 0;
  if (max_fds > GPUPOOL_WIRE_MAX_FDS)
    max_fds = GPUPOOL_WIRE_MAX_FDS;
  if (!(bs = calloc(n, sizeof *bs)) || !(ks = calloc(n, sizeof *ks)) || !(ro = calloc(n, sizeof *ro))) {
    rc = gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
    goto out;
  }
  /* Every token first, changing nothing but the claim marks (a kept share named twice in one
   * request opens once: the second is refused like an opened one). */
  for (; m < n; m++) {
    ro[m] = read_only;
    if ((rc = token_resolve(reg, c, tokens[m], lens[m], &ro[m], &bs[m], &ks[m])) == GPD_OPEN_PENDING)
      goto unclaim;
    if (rc != 0) {
      char msg[GPUPOOL__ERRMSG_MAX];
      snprintf(msg, sizeof msg, "%s", gpupool__errmsg());
      rc = gpupool__err(rc, "token %zu of %zu: %s (none of this request's tokens was opened)", m + 1, n, msg);
      goto unclaim;
    }
    /* The reply carries the fd of each slab gpd_fill_desc will send. */
    if (bs[m]->slab->bs.fd >= 0 && gpd_desc_sends_slab(c, bs[m]->slab, ro[m])) {
      unsigned j = 0;
      while (j < nfd && fd_slabs[j] != bs[m]->slab)
        j++;
      if (j == nfd) {
        if (nfd == max_fds && m > 0)
          break; /* the rest in another request */
        if (nfd < max_fds)
          fd_slabs[nfd++] = bs[m]->slab;
      }
    }
    if (ks[m])
      ks[m]->claimed = 1;
  }
  if ((rc = gpd_quota_waiting_leases(reg, c)) != 0 || (rc = gpd_batch_begin(reg, c)) != 0)
    goto unclaim;
  /* One done event for the message: its receiver opens one event, not one per buffer. */
  for (; made < m; made++)
    if ((rc = gpd_hold_new(reg, c, bs[made], ro[made], 0, &out[made])) != 0)
      break;
  gpd_batch_end(reg, c);
  if (rc != 0) {
    char msg[GPUPOOL__ERRMSG_MAX];
    snprintf(msg, sizeof msg, "%s", gpupool__errmsg());
    while (made > 0)
      gpd_hold_discard(reg, out[--made]);
    rc = gpupool__err(rc, "%s (none of this request's %zu tokens was opened)", msg, n);
    goto unclaim;
  }
  for (size_t i = 0; i < m; i++)
    if (ks[i]) {
      out[i]->ready_group = ks[i]->ready_group;
      keep_drop(reg, ks[i]);
    }
  *opened = m;
  goto out;
unclaim:
  for (size_t i = 0; i < m; i++)
    if (ks[i])
      ks[i]->claimed = 0;
out:
  free(bs);
  free(ks);
  free(ro);
  return rc;
}

int gpd_hold_idle(gpd_registry *reg, gpd_client *c, uint64_t hold_id, int *idle) {
  gpd_hold *h = NULL;
  gpd_buffer *b;
  int rc = gpd_hold_of(reg, c, hold_id, &h);
  *idle = 0;
  if (rc != 0)
    return rc;
  b = h->buf;
  /* refs counts holds, names, kept shares and copies reading it: 1 is this hold alone. */
  *idle = b->refs == 1 && !b->names && !b->died_in_use && !h->read_only && gpd_buffer_deps_clear(reg, b);
  return 0;
}

void gpd_hold_discard(gpd_registry *reg, gpd_hold *h) { gpd_hold_drop(reg, h, 0, NULL); }

/* Whether a description of a buffer in sl for c carries the slab (c has not mapped it, or
 * only read-only and now needs it writable). */
int gpd_desc_sends_slab(const gpd_client *c, const gpd_slab *sl, int read_only) {
  if (!gpupool__hmap_get(&c->mapped, sl->id))
    return 1;
  return !read_only && gpupool__hmap_get(&c->mapped_ro, sl->id) != NULL;
}
