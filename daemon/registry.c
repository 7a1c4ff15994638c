/*
 * The daemon's registry: pools, slabs, buffers, holds, names, events and the leases of
 * closed connections. See registry.h for who owns what. The rules that keep memory safe:
 *   - a buffer's range returns to its slab only in gpupool__finish_free(), reached once refs == 0
 *     and every dependency (recorded done events, leases of holders whose connection
 *     closed) has cleared;
 *   - a slab returns to the backend only in gpupool__slab_destroy(), reached once it is empty,
 *     retiring, and neither a connected client nor a held lease still maps it;
 *   - once the daemon stops (gpupool__registry_stop) nothing is reused any more.
 * Everything runs on the daemon's single loop thread.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <malloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "errors.h"
#include "log.h"
#include "registry.h"
#include "registry_internal.h"

uint64_t gpupool__now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

uint64_t gpupool__next_id(gpupool__registry *reg) { return ++reg->next_id; }

uint64_t gpupool__round_up(uint64_t v, uint64_t a) { return (v + a - 1) & ~(a - 1); }

int gpupool__grow(void **arr, uint32_t *cap, uint32_t need, size_t elem) {
  uint32_t ncap;
  void *n;
  if (need <= *cap)
    return 0;
  ncap = *cap ? *cap * 2 : 4;
  while (ncap < need)
    ncap *= 2;
  n = realloc(*arr, (size_t)ncap * elem);
  if (!n)
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  *arr = n;
  *cap = ncap;
  return 0;
}

/* ---- events ------------------------------------------------------------------------------ */

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

/* ---- leases ----------------------------------------------------------------------------- */

int gpupool__lease_new(gpupool__registry *reg, uid_t uid, gid_t gid, pid_t pid, gpupool__lease **out, int *peer) {
  gpupool__lease *l;
  int p[2];
  if (pipe2(p, O_CLOEXEC) != 0) {
    int e = errno;
    if (e == EMFILE || e == ENFILE)
      return gpupool__err(GPUPOOL_ELIMIT,
                          "gpupoold is out of file descriptors (%s): it cannot give this connection a lease, "
                          "so it could not tell when the memory it maps is free again, and refuses it instead. "
                          "Try again later; operators: raise the daemon's fd limit (LimitNOFILE= in "
                          "gpupoold.service, ulimit -n) or lower max_clients",
                          strerror(e));
    return gpupool__err(GPUPOOL_EIO, "gpupoold cannot give this connection a lease (pipe2: %s) and refuses it",
                        strerror(e));
  }
  l = calloc(1, sizeof *l);
  if (!l) {
    close(p[0]);
    close(p[1]);
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  }
  (void)fcntl(p[0], F_SETFL, O_NONBLOCK);
  /* Nothing is ever written: charge the daemon's user the fewest pipe pages. */
  (void)fcntl(p[1], F_SETPIPE_SZ, 4096);
  l->fd = p[0];
  l->refs = 1;
  l->uid = uid;
  l->tenant = gpupool__tenant_of(reg->cfg, uid, gid);
  l->pid = pid;
  l->reg = reg;
  *out = l;
  *peer = p[1];
  return 0;
}

/* 1 when no process holds the other end any more (EOF on the pipe). Bytes a holder wrote
 * are read and dropped: only EOF counts. */
static int lease_probe(gpupool__lease *l) {
  char buf[4096];
  for (int i = 0; i < 16; i++) {
    ssize_t n = read(l->fd, buf, sizeof buf);
    if (n == 0)
      return 1;
    if (n < 0 && errno == EINTR)
      continue;
    if (n < 0)
      return 0; /* EAGAIN: still held */
  }
  return 0;
}

static void lease_unwait(gpupool__lease *l) {
  gpupool__registry *reg = l->reg;
  gpupool__uid_usage *u;
  if (!l->waiting)
    return;
  l->waiting = 0;
  if (l->prev)
    l->prev->next = l->next;
  else
    reg->waiting = l->next;
  if (l->next)
    l->next->prev = l->prev;
  l->prev = l->next = NULL;
  reg->nwaiting--;
  if (l->counted && (u = gpupool__uid_usage_get(reg, l->tenant, 0))) {
    u->leases--;
    gpupool__uid_usage_put(reg, u);
  }
  l->counted = 0;
}

static void lease_closed(uv_handle_t *h) {
  gpupool__lease *l = h->data;
  if (l->fd >= 0)
    close(l->fd);
  l->fd = -1;
  l->polling = 0;
  if (l->refs == 0)
    free(l);
}

/* Close the daemon's end (through the poll handle when one watches it). */
static void lease_close_fd(gpupool__lease *l) {
  if (l->polling) {
    if (!uv_is_closing((uv_handle_t *)&l->poll))
      uv_close((uv_handle_t *)&l->poll, lease_closed);
    return;
  }
  if (l->fd >= 0)
    close(l->fd);
  l->fd = -1;
}

static void lease_gone(gpupool__lease *l) {
  if (l->gone)
    return;
  l->gone = 1;
  if (l->waiting)
    GPUPOOL__PEER_INFO(NULL, 0, "client %" PRIu64 " (pid %d uid %u): every process holding its lease has exited or closed it, "
                  "%.1f s after its connection closed; its memory can be reused",
                  l->client_id, (int)l->pid, (unsigned)l->uid, (double)(gpupool__now_ns() - l->since_ns) / 1e9);
  lease_unwait(l);
  lease_close_fd(l);
}

void gpupool__lease_unref(gpupool__lease *l) {
  if (--l->refs > 0)
    return;
  lease_unwait(l);
  lease_close_fd(l);
  if (!l->polling)
    free(l);
}

void gpupool__lease_discard(gpupool__lease *l) {
  if (l)
    gpupool__lease_unref(l);
}

static void lease_readable(uv_poll_t *p, int status, int events) {
  gpupool__lease *l = p->data;
  gpupool__registry *reg = l->reg;
  (void)events;
  if (status < 0) {
    /* Unknown is never "gone": the memory stays pinned rather than reused under a holder. */
    GPUPOOL__ERROR("cannot watch the lease of client %" PRIu64 " (pid %d): %s; its memory stays pinned until the "
                   "daemon restarts",
                   l->client_id, (int)l->pid, uv_strerror(status));
    uv_poll_stop(p);
    return;
  }
  if (!lease_probe(l))
    return;
  lease_gone(l);
  gpupool__sweep(reg);
  if (reg->on_memory)
    reg->on_memory(reg, NULL);
}

/* The connection closed while its client held or mapped memory: wait for the lease, unless
 * it is already gone. Returns 1 when it is waiting. */
int gpupool__lease_wait(gpupool__registry *reg, gpupool__lease *l) {
  gpupool__uid_usage *u;
  int rc;
  if (l->gone)
    return 0;
  if (lease_probe(l)) {
    lease_gone(l);
    return 0;
  }
  l->since_ns = gpupool__now_ns();
  if (!reg->stopped) {
    if ((rc = uv_poll_init(reg->loop, &l->poll, l->fd)) != 0) {
      GPUPOOL__ERROR("cannot watch the lease of client %" PRIu64 " (pid %d): %s; its memory stays pinned until "
                     "the daemon restarts",
                     l->client_id, (int)l->pid, uv_strerror(rc));
    } else {
      l->polling = 1;
      l->poll.data = l;
      uv_poll_start(&l->poll, UV_READABLE, lease_readable);
    }
  }
  l->waiting = 1;
  l->next = reg->waiting;
  if (reg->waiting)
    reg->waiting->prev = l;
  reg->waiting = l;
  reg->nwaiting++;
  /* Counted only where the record could be made; lease_unwait takes back only what was. */
  l->counted = (u = gpupool__uid_usage_get(reg, l->tenant, 1)) != NULL;
  if (l->counted)
    u->leases++;
  return 1;
}

/* ---- backend pool instances ------------------------------------------------------------------ */

/* One backend pool per owner (see gpupool__pinst): the backend's pool fd maps every
 * allocation in the pool. */
int gpupool__per_owner(const gpupool__registry *reg) { return reg->be->desc->pool_fd_maps_all; }

static gpupool__pinst *inst_find(gpupool__pool *p, uint64_t owner) {
  if (p->insts && p->insts->owner == GPUPOOL__OWNER_ANY)
    return p->insts;
  for (gpupool__pinst *in = p->insts; in; in = in->next)
    if (in->owner == owner)
      return in;
  return NULL;
}

int gpupool__inst_new(gpupool__registry *reg, gpupool__pool *p, uint64_t owner, gpupool__pinst **out) {
  gpupool__pinst *in = calloc(1, sizeof *in);
  int rc;
  if (!in)
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  rc = reg->be->ops->pool_create(reg->be, &p->cfg, &in->bp, &in->fd);
  if (rc != 0) {
    char msg[GPUPOOL__ERRMSG_MAX];
    snprintf(msg, sizeof msg, "%s", gpupool__errmsg());
    free(in);
    return gpupool__err(rc, "cannot create pool '%s': %s", p->cfg.name, msg);
  }
  in->pool = p;
  in->owner = owner;
  in->serial = ++p->insts_created;
  in->next = p->insts;
  if (p->insts)
    p->insts->prev = in;
  p->insts = in;
  p->ninsts++;
  if (owner != GPUPOOL__OWNER_ANY) {
    char label[80];
    gpupool__tenant_label(reg->cfg, owner, label, sizeof label);
    GPUPOOL__DEBUG("pool %s: backend pool #%" PRIu64 " created for %s", p->cfg.name, in->serial, label);
  }
  *out = in;
  return 0;
}

void gpupool__inst_destroy(gpupool__registry *reg, gpupool__pinst *in) {
  gpupool__pool *p = in->pool;
  if (in->prev)
    in->prev->next = in->next;
  else
    p->insts = in->next;
  if (in->next)
    in->next->prev = in->prev;
  p->ninsts--;
  p->held -= in->held;
  /* Every slab of it was freed first (and on CUDA its stream synchronized); the daemon never
   * grants its own pools access for other devices, so no access state outlives the handle
   * (clients clear theirs before destroying their imports, DESIGN.md). */
  reg->be->ops->pool_destroy(in->bp);
  free(in);
  reg->memory_returned = 1;
}

/* An owner's backend pool that no slab and no connected client uses is destroyed, so that
 * what it reserved really returns (an IPC pool gives nothing back before). */
void gpupool__inst_maybe_destroy(gpupool__registry *reg, gpupool__pinst *in) {
  if (!in || in->owner == GPUPOOL__OWNER_ANY || in->nslabs || in->attached)
    return;
  GPUPOOL__DEBUG("pool %s: backend pool #%" PRIu64 " is idle; destroyed, %" PRIu64 " bytes return",
                 in->pool->cfg.name, in->serial, in->held);
  gpupool__inst_destroy(reg, in);
}

/* ---- slabs ----------------------------------------------------------------------------------- */

void gpupool__slab_destroy(gpupool__registry *reg, gpupool__slab *s) {
  gpupool__pool *p = s->pool;
  gpupool__pinst *in = s->inst;
  GPUPOOL__DEBUG("pool %s: slab %" PRIu64 " (%" PRIu64 " bytes) returned to the backend", p->cfg.name, s->id,
                 s->bs.size);
  reg->be->ops->slab_free(in->bp, &s->bs);
  in->reserved -= s->bs.size;
  in->nslabs--;
  if (!reg->be->desc->pool_keeps_memory) {
    in->held -= s->bs.size;
    p->held -= s->bs.size;
  }
  if (s->prev)
    s->prev->next = s->next;
  else
    p->slabs = s->next;
  if (s->next)
    s->next->prev = s->prev;
  gpupool__hmap_del(&reg->slabs, s->id);
  p->reserved -= s->bs.size;
  p->nslabs--;
  for (uint32_t i = 0; i < s->nmappers; i++)
    if (s->mappers[i].lease)
      gpupool__lease_unref(s->mappers[i].lease);
  gpupool__alloc_delete(s->alloc);
  free(s->mappers);
  free(s);
  reg->memory_returned = 1;
  gpupool__inst_maybe_destroy(reg, in);
}

void gpupool__slab_try_release(gpupool__registry *reg, gpupool__slab *s) {
  if (s->retiring && s->nbuffers == 0 && s->nmappers == 0)
    gpupool__slab_destroy(reg, s);
}

static void client_add_revoke(gpupool__client *c, uint64_t slab_id) {
  for (uint32_t i = 0; i < c->nrevoke; i++)
    if (c->revoke[i] == slab_id)
      return;
  if (gpupool__grow((void **)&c->revoke, &c->caprevoke, c->nrevoke + 1, sizeof *c->revoke) == 0)
    c->revoke[c->nrevoke++] = slab_id;
}

/* Stop using s; ask its mappers to unmap; destroy it once nobody maps it. Returns 1 when
 * it was destroyed now. */
static int slab_retire(gpupool__registry *reg, gpupool__slab *s) {
  s->retiring = 1;
  for (uint32_t i = 0; i < s->nmappers; i++) {
    gpupool__client *c;
    if (!s->mappers[i].client_id)
      continue;
    c = gpupool__hmap_get(&reg->clients, s->mappers[i].client_id);
    if (!c)
      continue;
    gpupool__hmap_del(&c->mapped, s->id);
    gpupool__hmap_del(&c->mapped_ro, s->id);
    client_add_revoke(c, s->id);
  }
  if (s->nbuffers == 0 && s->nmappers == 0) {
    gpupool__slab_destroy(reg, s);
    return 1;
  }
  return 0;
}

void gpupool__slab_maybe_retire(gpupool__registry *reg, gpupool__slab *s) {
  uint32_t empty = 0;
  if (s->nbuffers != 0 || s->retiring)
    return;
  if (s->dedicated) {
    slab_retire(reg, s);
    return;
  }
  for (gpupool__slab *o = s->pool->slabs; o; o = o->next)
    if (!o->dedicated && !o->retiring && o->nbuffers == 0)
      empty++;
  if (empty > s->pool->cfg.keep_slabs)
    slab_retire(reg, s);
}

/* What instance in would keep from the system with `size` more bytes of slabs. */
static uint64_t held_with(const gpupool__registry *reg, const gpupool__pinst *in, uint64_t size) {
  uint64_t held = in ? in->held : 0, after = (in ? in->reserved : 0) + size;
  return reg->be->desc->pool_keeps_memory && held > after ? held : after;
}

static int slab_new(gpupool__registry *reg, gpupool__pool *p, uint64_t size, int dedicated, uint64_t owner,
                    gpupool__slab **out) {
  gpupool__pinst *in = inst_find(p, owner);
  gpupool__slab *s;
  uint64_t held;
  int rc;

  /* The capacity bounds what every owner's backend pool keeps, together. */
  if (p->held - (in ? in->held : 0) + held_with(reg, in, size) > p->cfg.capacity)
    return GPUPOOL_ENOSPC;
  if (!in && (rc = gpupool__inst_new(reg, p, owner, &in)) != 0)
    return rc;
  s = calloc(1, sizeof *s);
  if (!s) {
    rc = gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
    goto fail;
  }
  rc = reg->be->ops->slab_alloc(in->bp, size, &s->bs);
  if (rc != 0)
    goto fail;
  if (!dedicated) {
    rc = gpupool__alloc_new(s->bs.size, &s->alloc);
    if (rc != 0) {
      reg->be->ops->slab_free(in->bp, &s->bs);
      goto fail;
    }
  }
  s->id = gpupool__next_id(reg);
  s->pool = p;
  s->inst = in;
  s->dedicated = dedicated;
  s->owner = owner;
  if ((rc = gpupool__hmap_put(&reg->slabs, s->id, s)) != 0) {
    gpupool__alloc_delete(s->alloc);
    reg->be->ops->slab_free(in->bp, &s->bs);
    goto fail;
  }
  held = held_with(reg, in, s->bs.size);
  if (reg->be->desc->pool_keeps_memory) {
    /* The backend may reserve more than the slab (rounding, or a freed slab's memory that
     * does not fit this one): count what it says it keeps, from now on. */
    gpupool__bpool_stats st;
    if (reg->be->ops->pool_stats(in->bp, &st) == 0 && st.reserved_cur > held)
      held = st.reserved_cur;
  }
  p->held += held - in->held;
  in->held = held;
  in->reserved += s->bs.size;
  in->nslabs++;
  s->next = p->slabs;
  if (p->slabs)
    p->slabs->prev = s;
  p->slabs = s;
  p->nslabs++;
  p->reserved += s->bs.size;
  if (p->reserved > p->reserved_high)
    p->reserved_high = p->reserved;
  GPUPOOL__DEBUG("pool %s: new %sslab %" PRIu64 " of %" PRIu64 " bytes", p->cfg.name,
           dedicated ? "dedicated " : "", s->id, s->bs.size);
  *out = s;
  return 0;
fail:
  free(s);
  gpupool__inst_maybe_destroy(reg, in);
  return rc;
}

int gpupool__slab_add_mapper(gpupool__slab *s, uint64_t client_id) {
  if (gpupool__grow((void **)&s->mappers, &s->capmappers, s->nmappers + 1, sizeof *s->mappers) != 0)
    return GPUPOOL_ENOMEM;
  s->mappers[s->nmappers].client_id = client_id;
  s->mappers[s->nmappers].lease = NULL;
  s->nmappers++;
  return 0;
}

void gpupool__slab_remove_mapper_at(gpupool__slab *s, uint32_t i) {
  s->mappers[i] = s->mappers[--s->nmappers];
}

/* ---- buffers --------------------------------------------------------------------------------- */

static int buffer_deps_clear(gpupool__registry *reg, gpupool__buffer *b) {
  while (b->ndone > 0) {
    gpupool__event *e = b->done[b->ndone - 1];
    int q = reg->be->ops->event_query(e->be);
    if (q == 0)
      return 0;
    if (q < 0)
      GPUPOOL__WARN("event %u query failed (%s); treating it as complete", e->id, gpupool__errmsg());
    gpupool__event_put(reg, e);
    b->ndone--;
  }
  while (b->nleases > 0) {
    gpupool__lease *l = b->leases[b->nleases - 1];
    if (!l->gone)
      return 0;
    gpupool__lease_unref(l);
    b->nleases--;
  }
  return 1;
}

void gpupool__finish_free(gpupool__registry *reg, gpupool__buffer *b) {
  gpupool__slab *s = b->slab;
  gpupool__pool *p = s->pool;
  if (b->died_in_use && s->alloc) {
    /* Work the dead holder queued may still touch this range until its GPU context is torn
     * down, which the daemon cannot see: never reuse it inside this slab. */
    if (!s->retiring)
      GPUPOOL__INFO("pool %s: slab %" PRIu64 " takes no new buffers and goes back to the backend once empty: "
                    "buffer %" PRIu64 " in it was held by a client that went away without saying its GPU work on "
                    "it was done",
                    p->cfg.name, s->id, b->id);
    s->retiring = 1;
  } else if (s->alloc && gpupool__alloc_put(s->alloc, b->offset, b->size) != 0) {
    GPUPOOL__ERROR("pool %s: range %" PRIu64 "+%" PRIu64 " of slab %" PRIu64 " refused by the allocator",
             p->cfg.name, b->offset, b->size, s->id);
  }
  s->nbuffers--;
  p->used -= b->size;
  p->nbuffers--;
  gpupool__event_put(reg, b->ready);
  gpupool__layout_unref(reg, b->layout);
  /* Only now is the range really back: until here it stays on its owner's account. */
  gpupool__uid_account(reg, b->owner_tenant, -(int64_t)b->size, -1);
  free(b->done);
  free(b->leases);
  free(b);
  reg->memory_returned = 1;
  if (s->retiring && s->nbuffers == 0 && !reg->stopped)
    slab_retire(reg, s);
  else
    gpupool__slab_maybe_retire(reg, s);
}

static void sweep_timer_cb(uv_timer_t *t) {
  gpupool__registry *reg = t->data;
  uint64_t t0 = gpupool__now_ns(), n = reg->npending;
  gpupool__sweep(reg);
  if (gpupool__now_ns() - t0 > 50000)
    GPUPOOL__DEBUG("slow sweep: %" PRIu64 " us over %" PRIu64 " pending buffers", (gpupool__now_ns() - t0) / 1000, n);
  if (reg->memory_returned && reg->on_memory)
    reg->on_memory(reg, NULL);
}

static void sweep_timer_update(gpupool__registry *reg) {
  int need = 0;
  if (reg->stopped)
    return;
  for (gpupool__buffer *b = reg->pending; b; b = b->pending_next)
    if (b->ndone > 0) {
      need = 1;
      break;
    }
  if (need && !reg->sweep_timer_on) {
    uv_timer_start(&reg->sweep_timer, sweep_timer_cb, 1, 1);
    reg->sweep_timer_on = 1;
  } else if (!need && reg->sweep_timer_on) {
    uv_timer_stop(&reg->sweep_timer);
    reg->sweep_timer_on = 0;
  }
}

/* The uid's record, created when create is set; NULL when absent (or out of memory). */
gpupool__uid_usage *gpupool__uid_usage_get(gpupool__registry *reg, uint64_t tenant, int create) {
  gpupool__uid_usage *u = gpupool__hmap_get(&reg->uids, tenant);
  if (u || !create)
    return u;
  u = calloc(1, sizeof *u);
  if (!u || gpupool__hmap_put(&reg->uids, tenant, u) != 0) {
    free(u);
    return NULL;
  }
  u->tenant = tenant;
  return u;
}

/* Drop the record once nothing is counted in it. */
void gpupool__uid_usage_put(gpupool__registry *reg, gpupool__uid_usage *u) {
  if (u && u->allocs == 0 && u->bytes == 0 && u->names == 0 && u->members == 0 && u->holds == 0 &&
      u->leases == 0 &&
      u->conns == 0 && u->waiters == 0 && u->files == 0) {
    gpupool__hmap_del(&reg->uids, u->tenant);
    free(u);
  }
}

void gpupool__uid_account(gpupool__registry *reg, uint64_t tenant, int64_t bytes, int32_t allocs) {
  gpupool__uid_usage *u = gpupool__uid_usage_get(reg, tenant, bytes > 0);
  if (!u)
    return;
  u->bytes += (uint64_t)bytes;
  u->allocs += (uint32_t)allocs;
  gpupool__uid_usage_put(reg, u);
}

void gpupool__buffer_unref(gpupool__registry *reg, gpupool__buffer *b) {
  gpupool__client *owner;
  if (--b->refs > 0)
    return;
  gpupool__hmap_del(&reg->buffers, b->id);
  owner = b->owner_client ? gpupool__hmap_get(&reg->clients, b->owner_client) : NULL;
  if (owner) {
    owner->bytes -= b->size;
    owner->allocs--;
  }
  if (buffer_deps_clear(reg, b)) {
    gpupool__finish_free(reg, b);
    return;
  }
  b->pending_next = reg->pending;
  reg->pending = b;
  reg->npending++;
  sweep_timer_update(reg);
}

void gpupool__sweep(gpupool__registry *reg) {
  gpupool__buffer **pp = &reg->pending;
  while (*pp) {
    gpupool__buffer *b = *pp;
    if (buffer_deps_clear(reg, b)) {
      *pp = b->pending_next;
      reg->npending--;
      gpupool__finish_free(reg, b);
    } else {
      pp = &b->pending_next;
    }
  }
  for (int i = 0; i < reg->npools; i++) {
    gpupool__slab *s = reg->pools[i].slabs, *next;
    for (; s; s = next) {
      next = s->next;
      for (uint32_t j = 0; j < s->nmappers;) {
        if (s->mappers[j].lease && s->mappers[j].lease->gone) {
          gpupool__lease_unref(s->mappers[j].lease);
          gpupool__slab_remove_mapper_at(s, j);
        } else {
          j++;
        }
      }
      gpupool__slab_try_release(reg, s);
    }
  }
  sweep_timer_update(reg);
}

/* Capacity no backend pool keeps (the backend may have reserved past it: never below 0). */
static uint64_t unheld(const gpupool__pool *p) { return p->held < p->cfg.capacity ? p->cfg.capacity - p->held : 0; }

uint64_t gpupool__pool_free_bytes(const gpupool__pool *p) {
  /* Unheld capacity, what owners' backend pools keep beyond their slabs (usable by that owner
   * only: an over-estimate for any one request, which is what a pre-check needs), and the
   * holes in slabs. */
  uint64_t f = unheld(p);
  for (const gpupool__pinst *in = p->insts; in; in = in->next)
    f += in->held - in->reserved;
  for (gpupool__slab *s = p->slabs; s; s = s->next)
    if (s->alloc && !s->retiring)
      f += gpupool__alloc_capacity(s->alloc) - gpupool__alloc_used(s->alloc);
  return f;
}

static int no_space(gpupool__registry *reg, gpupool__pool *p, uint64_t owner, uint64_t asked, uint64_t rounded) {
  const gpupool__pinst *in = inst_find(p, owner);
  uint64_t largest = 0, in_slabs = 0, pending_bytes = 0, most;
  /* What a new slab of this owner could take: capacity no backend pool keeps, plus what this
   * owner's own backend pool keeps beyond its slabs. */
  uint64_t unreserved = unheld(p) + (in ? in->held - in->reserved : 0);
  for (gpupool__slab *s = p->slabs; s; s = s->next)
    if (s->alloc && !s->retiring && s->owner == owner) {
      uint64_t l = gpupool__alloc_largest_free(s->alloc);
      if (l > largest)
        largest = l;
      in_slabs += gpupool__alloc_capacity(s->alloc) - gpupool__alloc_used(s->alloc);
    }
  for (gpupool__buffer *b = reg->pending; b; b = b->pending_next)
    if (b->slab->pool == p)
      pending_bytes += b->size;
  /* What one request could get now: the largest hole in this user's slabs, or a new slab
   * (dedicated above slab_size) from the unreserved capacity. */
  most = unreserved & ~(SLAB_GRAIN - 1);
  if (most > GPUPOOL_SLAB_HARD_MAX)
    most = GPUPOOL_SLAB_HARD_MAX;
  if (most < p->cfg.slab_size) /* too little for a new slab: only the holes are left */
    most = 0;
  if (largest > most)
    most = largest;
  return gpupool__err(GPUPOOL_ENOSPC,
                      "pool '%s' is out of memory: asked for %" PRIu64 " bytes (%" PRIu64
                      " after alignment); the largest request that would succeed now is %" PRIu64
                      " bytes (free: %" PRIu64 " bytes inside this tenant's slabs, largest contiguous %" PRIu64
                      ", and %" PRIu64 " bytes of unreserved capacity of %" PRIu64
                      "); %" PRIu64 " bytes wait for holders' GPU work or exited processes before reuse%s. "
                      "Release buffers, pass a timeout to wait for memory, or raise the pool's capacity",
                      p->cfg.name, asked, rounded, most, in_slabs, largest, unreserved, p->cfg.capacity,
                      pending_bytes,
                      gpupool__per_owner(reg) ? "; other tenants' backend pools keep what they reserved until they are idle"
                                     : "");
}

/* Place `size` bytes (already aligned) in p. */
/* ---- tenants ---------------------------------------------------------------------------------- */

uint64_t gpupool__tenant_of(const gpupool__config *cfg, uid_t uid, gid_t gid) {
  for (int i = 0; i < cfg->n_tenants; i++)
    if (gpupool__member_of(&cfg->tenants[i], uid, gid))
      return TENANT_SET | (uint64_t)i;
  return (uint64_t)uid;
}

void gpupool__tenant_label(const gpupool__config *cfg, uint64_t owner, char *buf, size_t len) {
  if (owner & GROUP_SET)
    snprintf(buf, len, "group:%s", cfg->groups[owner & 0xffff].name);
  else if (owner & TENANT_SET)
    snprintf(buf, len, "tenant:%s", cfg->tenants[owner & 0xffff].name);
  else
    snprintf(buf, len, "uid:%u", (unsigned)owner);
}

/* May c use memory (slabs, buffers, names) owned by owner? */
int gpupool__owner_reachable(const gpupool__registry *reg, const gpupool__client *c, uint64_t owner) {
  if (owner == c->tenant)
    return 1;
  return (owner & GROUP_SET) && gpupool__member_of(&reg->cfg->groups[owner & 0xffff], c->uid, c->gid);
}

int gpupool__name_key(gpupool__registry *reg, const gpupool__client *c, const char *name, char *key,
                      size_t len, uint64_t *owner) {
  char label[80];
  int rc = gpupool__wire_check_name(name);
  if (rc != 0)
    return rc;
  if (!strncmp(name, "group:", 6)) {
    const char *g = name + 6, *slash = strchr(g, '/');
    int idx = -1;
    for (int i = 0; slash && i < reg->cfg->n_groups; i++)
      if ((size_t)(slash - g) == strlen(reg->cfg->groups[i].name) && !strncmp(g, reg->cfg->groups[i].name, (size_t)(slash - g)))
        idx = i;
    if (!slash || !slash[1])
      return gpupool__err(GPUPOOL_ENAME, "'%s': a group name is written group:GROUP/NAME", name);
    if (idx < 0 || !gpupool__member_of(&reg->cfg->groups[idx], c->uid, c->gid))
      return gpupool__err(GPUPOOL_EPERM, "'%s': this daemon has no group '%.*s' with uid %u or gid %u in it "
                          "(groups are [group NAME] sections of its config)", name, (int)(slash - g), g,
                          (unsigned)c->uid, (unsigned)c->gid);
    *owner = GROUP_SET | (uint64_t)idx;
    snprintf(key, len, "%s", name);
    return 0;
  }
  *owner = c->tenant;
  gpupool__tenant_label(reg->cfg, c->tenant, label, sizeof label);
  snprintf(key, len, "%s/%s", label, name);
  return 0;
}

/* Whose memory c's buffers in p are: the group a shared pool belongs to, else c's tenant.
 * Every buffer c can receive in p has this owner (allocate places it so; open, get and
 * publish admit only slabs gpupool__owner_reachable() allows, and a group owns slabs only in its
 * shared pool, where every slab is the group's), so on per-owner backends the pool id names
 * exactly one backend pool for c. */
int gpupool__pool_owner(gpupool__registry *reg, const gpupool__client *c, const gpupool__pool *p, uint64_t *owner) {
  int share = reg->cfg->pool_share[p - reg->pools];
  *owner = c->tenant;
  if (share < 0)
    return 0;
  /* A shared pool's memory belongs to its group: every member can read all of it. */
  if (!gpupool__member_of(&reg->cfg->groups[share], c->uid, c->gid))
    return gpupool__err(GPUPOOL_EPERM, "pool '%s' is shared with group '%s', which does not include uid %u "
                        "or gid %u; use another pool, or ask the operator to add you to the group",
                        p->cfg.name, reg->cfg->groups[share].name, (unsigned)c->uid, (unsigned)c->gid);
  *owner = GROUP_SET | (uint64_t)share;
  return 0;
}

/* Place a buffer for owner (a tenant, or the group a shared pool belongs to): in a slab of
 * that owner only (every holder of a buffer receives its slab's fd, so slabs are never shared
 * between tenants), or in a new one. */
int gpupool__place(gpupool__registry *reg, gpupool__pool *p, uint64_t owner, uint64_t asked, uint64_t size,
                   uint64_t align, gpupool__slab **slab, uint64_t *off) {
  int rc, attempt;
  if (size > p->cfg.slab_size) {
    uint64_t dsize = gpupool__round_up(size, SLAB_GRAIN);
    if (size > GPUPOOL_SLAB_HARD_MAX)
      return gpupool__err(GPUPOOL_ETOOBIG,
                          "allocation of %" PRIu64 " bytes exceeds the 4 GiB limit on one exported allocation "
                          "(larger ones crash or corrupt importing processes in the CUDA driver); "
                          "split the tensor into buffers of at most 4 GiB",
                          asked);
    if (dsize > p->cfg.capacity)
      return gpupool__err(GPUPOOL_ETOOBIG,
                          "allocation of %" PRIu64 " bytes is larger than pool '%s' (capacity %" PRIu64
                          " bytes); raise the pool's capacity in the config",
                          asked, p->cfg.name, p->cfg.capacity);
    for (attempt = 0; attempt < 2; attempt++) {
      rc = slab_new(reg, p, dsize, 1, owner, slab);
      if (rc == 0) {
        *off = 0;
        return 0;
      }
      if (rc != GPUPOOL_ENOSPC)
        return rc;
      /* Make room: finish what can be finished and give back empty cached slabs. */
      gpupool__sweep(reg);
      for (gpupool__slab *s = p->slabs, *n; s; s = n) {
        n = s->next;
        if (!s->dedicated && !s->retiring && s->nbuffers == 0)
          slab_retire(reg, s);
      }
    }
    return no_space(reg, p, owner, asked, size);
  }
  for (attempt = 0; attempt < 2; attempt++) {
    for (gpupool__slab *s = p->slabs; s; s = s->next) {
      if (!s->alloc || s->retiring || s->owner != owner)
        continue;
      if (gpupool__alloc_get(s->alloc, size, align, off) == 0) {
        *slab = s;
        return 0;
      }
    }
    rc = slab_new(reg, p, p->cfg.slab_size, 0, owner, slab);
    if (rc == 0) {
      if (gpupool__alloc_get((*slab)->alloc, size, align, off) == 0)
        return 0;
      /* Cannot happen: a fresh slab fits anything up to slab_size. */
      return gpupool__err(GPUPOOL_EBACKEND, "internal error: fresh slab refused %" PRIu64 " bytes", size);
    }
    if (rc != GPUPOOL_ENOSPC)
      return rc;
    if (attempt == 0)
      gpupool__sweep(reg);
    /* Other owners' empty cached slabs keep their backend pools (and what those reserved)
     * alive: give them back, so an idle backend pool goes and its memory returns. */
    if (attempt == 0 && gpupool__per_owner(reg))
      for (gpupool__slab *s = p->slabs, *n; s; s = n) {
        n = s->next;
        if (!s->dedicated && !s->retiring && s->nbuffers == 0 && s->owner != owner)
          slab_retire(reg, s);
      }
  }
  return no_space(reg, p, owner, asked, size);
}

/* ---- holds ----------------------------------------------------------------------------------- */

int gpupool__hold_new(gpupool__registry *reg, gpupool__client *c, gpupool__buffer *b, int read_only, int owner,
                      gpupool__hold **out) {
  const gpupool__config *cfg = reg->cfg;
  gpupool__uid_usage *u = gpupool__uid_usage_get(reg, c->tenant, 1);
  gpupool__hold *h;
  if (!u)
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  if (cfg->max_holds_per_client && c->nholds >= cfg->max_holds_per_client) {
    gpupool__uid_usage_put(reg, u);
    return gpupool__err(GPUPOOL_ELIMIT,
                        "this client already has %" PRIu64 " holds, the limit (max_holds_per_client) is %u; "
                        "release buffers it no longer uses", c->nholds, cfg->max_holds_per_client);
  }
  if (cfg->max_holds_per_uid && u->holds >= cfg->max_holds_per_uid) {
    gpupool__uid_usage_put(reg, u);
    char who[80];
    gpupool__tenant_label(cfg, c->tenant, who, sizeof who);
    return gpupool__err(GPUPOOL_ELIMIT, "%s already has %" PRIu64 " holds, the limit (max_holds_per_uid) is %u",
                        who, u->holds, cfg->max_holds_per_uid);
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
  if (h->prev)
    h->prev->next = h->next;
  else
    c->holds = h->next;
  if (h->next)
    h->next->prev = h->prev;
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

/* ---- public operations ----------------------------------------------------------------------- */

gpupool__pool *gpupool__pool_find(gpupool__registry *reg, const char *name, uint32_t id) {
  if (name && *name) {
    for (int i = 0; i < reg->npools; i++)
      if (!strcmp(reg->pools[i].cfg.name, name))
        return &reg->pools[i];
    return NULL;
  }
  if (id == 0)
    return reg->npools ? &reg->pools[0] : NULL;
  for (int i = 0; i < reg->npools; i++)
    if (reg->pools[i].id == id)
      return &reg->pools[i];
  return NULL;
}

int gpupool__attach(gpupool__registry *reg, gpupool__client *c, gpupool__pool *p, int *fd) {
  gpupool__pinst *in;
  uint64_t owner;
  int rc;
  *fd = -1;
  if ((rc = gpupool__pool_owner(reg, c, p, &owner)) != 0)
    return rc;
  if (!gpupool__per_owner(reg)) {
    *fd = p->insts->fd;
    return 0;
  }
  in = gpupool__hmap_get(&c->attached, p->id);
  if (!in) {
    if (!(in = inst_find(p, owner)) && (rc = gpupool__inst_new(reg, p, owner, &in)) != 0)
      return rc;
    if (gpupool__hmap_put(&c->attached, p->id, in) != 0) {
      gpupool__inst_maybe_destroy(reg, in);
      return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
    }
    in->attached++;
  }
  /* Cannot differ (see gpupool__pool_owner): a client keeps the pool it imported for its connection. */
  if (in->owner != owner)
    return gpupool__err(GPUPOOL_EBACKEND, "internal error: pool '%s' changed owner for client %" PRIu64,
                        p->cfg.name, c->id);
  *fd = in->fd;
  return 0;
}

/* Refuses new holds to a uid whose closed connections already pin memory through too many
 * leases: every such hold could become one more (a daemon fd and pinned memory each). */
int gpupool__check_waiting_leases(gpupool__registry *reg, const gpupool__client *c) {
  const gpupool__uid_usage *u = gpupool__hmap_get(&reg->uids, c->tenant);
  uint32_t max = reg->cfg->max_waiting_leases_per_uid;
  char who[80];
  if (!max || !u || u->leases < max)
    return 0;
  gpupool__tenant_label(reg->cfg, c->tenant, who, sizeof who);
  return gpupool__err(GPUPOOL_ELIMIT,
                      "%s has %u closed connections whose processes still hold their lease and map gpupool "
                      "memory (the limit, max_waiting_leases_per_uid, is %u): it gets no new buffers until some of "
                      "those processes exit. Find the processes of this tenant that closed their gpupool connection "
                      "but keep its memory mapped (forked children, workers that closed their sockets), end them "
                      "or have them call gpupool_disconnect, or raise max_waiting_leases_per_uid",
                      who, u->leases, max);
}

int gpupool__check_limits(gpupool__registry *reg, gpupool__client *c, uint64_t size) {
  const gpupool__config *cfg = reg->cfg;
  gpupool__uid_usage *u = gpupool__hmap_get(&reg->uids, c->tenant);
  char who[80];
  int rc;
  if ((rc = gpupool__check_waiting_leases(reg, c)) != 0)
    return rc;
  gpupool__tenant_label(cfg, c->tenant, who, sizeof who);
  if (cfg->max_allocs_per_client && c->allocs + 1 > cfg->max_allocs_per_client)
    return gpupool__err(GPUPOOL_ELIMIT,
                        "client already has %u live allocations, the limit (max_allocs_per_client) is %u; "
                        "release buffers or ask the operator to raise the limit",
                        c->allocs, cfg->max_allocs_per_client);
  if (cfg->max_bytes_per_client && c->bytes + size > cfg->max_bytes_per_client)
    return gpupool__err(GPUPOOL_ELIMIT,
                        "allocating %" PRIu64 " bytes would bring this client to %" PRIu64
                        " bytes, over its limit (max_bytes_per_client) of %" PRIu64 " bytes",
                        size, c->bytes + size, cfg->max_bytes_per_client);
  if (cfg->max_allocs_per_uid && u && u->allocs + 1 > cfg->max_allocs_per_uid)
    return gpupool__err(GPUPOOL_ELIMIT,
                        "%s already has %u live allocations, the limit (max_allocs_per_uid) is %u",
                        who, u->allocs, cfg->max_allocs_per_uid);
  if (cfg->max_bytes_per_uid && (u ? u->bytes : 0) + size > cfg->max_bytes_per_uid)
    return gpupool__err(GPUPOOL_ELIMIT,
                        "allocating %" PRIu64 " bytes would bring %s to %" PRIu64
                        " bytes, over its limit (max_bytes_per_uid) of %" PRIu64 " bytes",
                        size, who, (u ? u->bytes : 0) + size, cfg->max_bytes_per_uid);
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
  if ((rc = gpupool__check_limits(reg, c, asize)) != 0)
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
  if ((rc = gpupool__check_waiting_leases(reg, c)) != 0)
    return rc;
  return gpupool__hold_new(reg, c, b, read_only, 0, out);
}

/* ---- names, versions, bundles ----------------------------------------------------------------- */

/* Freeing a layout of at least this many members gives the freed heap pages back. */
#define TRIM_AFTER_MEMBERS 4096

void gpupool__members_free(gpupool__member *m, uint32_t n) {
  for (uint32_t i = 0; m && i < n; i++) {
    free(m[i].name);
    free(m[i].meta);
  }
  free(m);
}

static void members_account(gpupool__registry *reg, uint64_t tenant, int64_t delta) {
  gpupool__uid_usage *u;
  if (!delta || !(u = gpupool__uid_usage_get(reg, tenant, 0)))
    return;
  u->members = (uint64_t)((int64_t)u->members + delta);
  gpupool__uid_usage_put(reg, u);
}

/* Member tables and member names come from clients, so they are hashed with the seeded hash:
 * a client that cannot predict it cannot line up tables or names on one slot. */
/* What identifies a member's description: the fields in use, not the struct's bytes. */
static void meta_hash(gpupool__hash_state *st, const gpupool_tensor_meta *m) {
  uint8_t present = m != NULL;
  gpupool__hash_update(st, &present, 1);
  if (!m)
    return;
  gpupool__hash_update(st, &m->dtype_code, sizeof m->dtype_code);
  gpupool__hash_update(st, &m->dtype_bits, sizeof m->dtype_bits);
  gpupool__hash_update(st, &m->dtype_lanes, sizeof m->dtype_lanes);
  gpupool__hash_update(st, &m->ndim, sizeof m->ndim);
  gpupool__hash_update(st, m->shape, (size_t)m->ndim * sizeof m->shape[0]);
  gpupool__hash_update(st, &m->strides_present, sizeof m->strides_present);
  if (m->strides_present)
    gpupool__hash_update(st, m->strides, (size_t)m->ndim * sizeof m->strides[0]);
  gpupool__hash_update(st, &m->byte_offset, sizeof m->byte_offset);
}

static int meta_equal(const gpupool_tensor_meta *a, const gpupool_tensor_meta *b) {
  if (!a || !b)
    return a == b;
  return a->dtype_code == b->dtype_code && a->dtype_bits == b->dtype_bits && a->dtype_lanes == b->dtype_lanes &&
         a->ndim == b->ndim && !memcmp(a->shape, b->shape, (size_t)a->ndim * sizeof a->shape[0]) &&
         a->strides_present == b->strides_present &&
         (!a->strides_present || !memcmp(a->strides, b->strides, (size_t)a->ndim * sizeof a->strides[0])) &&
         a->byte_offset == b->byte_offset;
}

static uint64_t table_hash(uint64_t tenant, const gpupool__member *m, uint32_t n, uint32_t nbufs) {
  gpupool__hash_state st;
  gpupool__hash_init(&st);
  gpupool__hash_update(&st, &tenant, sizeof tenant);
  gpupool__hash_update(&st, &n, sizeof n);
  gpupool__hash_update(&st, &nbufs, sizeof nbufs);
  for (uint32_t i = 0; i < n; i++) {
    gpupool__hash_update(&st, m[i].name, strlen(m[i].name) + 1);
    gpupool__hash_update(&st, &m[i].buffer, sizeof m[i].buffer);
    gpupool__hash_update(&st, &m[i].offset, sizeof m[i].offset);
    gpupool__hash_update(&st, &m[i].size, sizeof m[i].size);
    meta_hash(&st, m[i].meta);
  }
  return gpupool__hash_final(&st) | 1;
}

static int table_equal(const gpupool__layout *l, uint64_t tenant, const gpupool__member *m, uint32_t n,
                       uint32_t nbufs) {
  if (l->tenant != tenant || l->n != n || l->nbufs != nbufs)
    return 0;
  for (uint32_t i = 0; i < n; i++)
    if (strcmp(l->members[i].name, m[i].name) || l->members[i].buffer != m[i].buffer ||
        l->members[i].offset != m[i].offset || l->members[i].size != m[i].size ||
        !meta_equal(l->members[i].meta, m[i].meta))
      return 0;
  return 1;
}

/* A layout (one reference, the caller's) over members (taken over; freed on failure or when an
 * equal table of the tenant exists, whose layout is then shared: two bundles allocated alike,
 * as double buffering does, have one layout id, so a consumer's cached table serves both),
 * which lie in nbufs buffers; counted against tenant's members once per layout. A new table
 * must fit in max_members_per_uid (less `freed`, members a new version releases); a shared
 * one adds no members. */
int gpupool__layout_new(gpupool__registry *reg, uint64_t tenant, gpupool__member *members, uint32_t n,
                        uint32_t nbufs, uint64_t freed, gpupool__layout **out) {
  uint64_t h = table_hash(tenant, members, n, nbufs);
  gpupool__layout *same_hash = gpupool__hmap_get(&reg->layout_hash, h), *l;
  int rc;
  if (same_hash && table_equal(same_hash, tenant, members, n, nbufs)) {
    gpupool__members_free(members, n);
    same_hash->refs++;
    *out = same_hash;
    return 0;
  }
  if ((rc = gpupool__members_fit(reg, tenant, n, freed)) != 0) {
    gpupool__members_free(members, n);
    return rc;
  }
  l = calloc(1, sizeof *l);
  if (!l || !(l->need = calloc(nbufs ? nbufs : 1, sizeof *l->need))) {
    free(l);
    gpupool__members_free(members, n);
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  }
  l->id = gpupool__next_id(reg);
  l->refs = 1;
  l->tenant = tenant;
  l->members = members;
  l->n = n;
  l->nbufs = nbufs;
  for (uint32_t i = 0; i < n; i++)
    if (members[i].offset + members[i].size > l->need[members[i].buffer])
      l->need[members[i].buffer] = members[i].offset + members[i].size;
  if (gpupool__hmap_put(&reg->layouts, l->id, l) != 0) {
    free(l->need);
    free(l);
    gpupool__members_free(members, n);
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  }
  l->hash = h;
  if (!same_hash) /* (a different table with the same hash keeps the slot) */
    (void)gpupool__hmap_put(&reg->layout_hash, h, l); /* out of memory: just not shared */
  gpupool__uid_usage *u = gpupool__uid_usage_get(reg, tenant, 1);
  if (u)
    u->members += n;
  reg->nmembers += n;
  *out = l;
  return 0;
}

void gpupool__layout_unref(gpupool__registry *reg, gpupool__layout *l) {
  if (!l || --l->refs > 0)
    return;
  gpupool__hmap_del(&reg->layouts, l->id);
  if (gpupool__hmap_get(&reg->layout_hash, l->hash) == l)
    gpupool__hmap_del(&reg->layout_hash, l->hash);
  members_account(reg, l->tenant, -(int64_t)l->n);
  reg->nmembers -= l->n;
  gpupool__members_free(l->members, l->n);
#ifdef __GLIBC__
  /* A large table is tens of thousands of small blocks (names, descriptions) spread over the
   * heap; malloc keeps their pages after free, so the daemon would stay at the high-water
   * mark of the largest tables a client ever sent. Handing the free pages back costs a walk
   * of the heap, paid only after tables this large. */
  if (l->n >= TRIM_AFTER_MEMBERS)
    malloc_trim(0);
#endif
  free(l->need);
  free(l);
}

/* Whether n more members fit in tenant's max_members_per_uid and in the daemon's max_members
 * (less `freed`, members a new version releases). */
int gpupool__members_fit(gpupool__registry *reg, uint64_t tenant, uint64_t n, uint64_t freed) {
  const gpupool__config *cfg = reg->cfg;
  gpupool__uid_usage *u = gpupool__hmap_get(&reg->uids, tenant);
  uint64_t have = u ? u->members : 0, all = reg->nmembers > freed ? reg->nmembers - freed : 0;
  char who[80];
  /* The per-tenant limit bounds one user; this one bounds them all together, since every
   * tenant may fill its own budget. */
  if (cfg->max_members && all + n > cfg->max_members)
    return gpupool__err(GPUPOOL_ELIMIT,
                        "%" PRIu64 " more members would bring the daemon to %" PRIu64 " members in member tables, "
                        "over its limit (max_members) of %u; release or unpublish bundles, or raise max_members "
                        "in the daemon's config", n, all + n, cfg->max_members);
  have = have > freed ? have - freed : 0;
  if (!cfg->max_members_per_uid || have + n <= cfg->max_members_per_uid)
    return 0;
  gpupool__tenant_label(cfg, tenant, who, sizeof who);
  return gpupool__err(GPUPOOL_ELIMIT,
                      "%" PRIu64 " more members would bring %s to %" PRIu64 " members in bundles, over the limit "
                      "(max_members_per_uid) of %u; unpublish or release bundles it no longer needs",
                      n, who, have + n, cfg->max_members_per_uid);
}

/* Drops what a name's current version refers to (its buffers' references, its members). */
static void name_clear(gpupool__registry *reg, gpupool__name *n) {
  if (n->file) {
    gpupool__file_close(reg, n->file);
    n->file = NULL;
  }
  gpupool__layout_unref(reg, n->layout);
  n->layout = NULL;
  for (uint32_t i = 0; i < n->nbufs; i++) {
    n->bufs[i]->names--;
    gpupool__buffer_unref(reg, n->bufs[i]);
  }
  free(n->bufs);
  n->bufs = NULL;
  n->nbufs = 0;
}

void gpupool__name_free(gpupool__registry *reg, gpupool__name *n) {
  name_clear(reg, n);
  free(n->name);
  free(n);
}

/* Checks for a publish under `name` by c of buffers bufs: the namespace, the buffers' owner,
 * the name limits (for a new name) and the member limits. *key gets the name's key and *old
 * the name's entry when it exists. */
int gpupool__new_name_fits(gpupool__registry *reg, uint64_t tenant) {
  const gpupool__config *cfg = reg->cfg;
  gpupool__uid_usage *u = gpupool__uid_usage_get(reg, tenant, 0);
  char who[80];
  if (cfg->max_names && reg->nnames >= cfg->max_names)
    return gpupool__err(GPUPOOL_ELIMIT, "the daemon already holds %" PRIu64 " names, the limit (max_names) is %u",
                        reg->nnames, cfg->max_names);
  if (cfg->max_names_per_uid && u && u->names >= cfg->max_names_per_uid) {
    gpupool__tenant_label(cfg, tenant, who, sizeof who);
    return gpupool__err(GPUPOOL_ELIMIT,
                        "%s already has %u names published, the limit (max_names_per_uid) is %u; "
                        "unpublish names it no longer needs (names outlive their publisher)",
                        who, u->names, cfg->max_names_per_uid);
  }
  return 0;
}

static int publish_check(gpupool__registry *reg, gpupool__client *c, const char *name, gpupool__buffer *const *bufs,
                         uint32_t nbufs, char *key, size_t keylen, gpupool__name **old) {
  const gpupool__config *cfg = reg->cfg;
  gpupool__uid_usage *u;
  uint64_t owner;
  char who[80];
  int rc;
  if ((rc = gpupool__name_key(reg, c, name, key, keylen, &owner)) != 0)
    return rc;
  for (uint32_t i = 0; i < nbufs; i++)
    if (bufs[i]->slab->owner != owner) {
      char label[80];
      gpupool__tenant_label(cfg, bufs[i]->slab->owner, label, sizeof label);
      return gpupool__err(GPUPOOL_EPERM,
                          "'%s' would make a buffer of %s readable outside it; publish it in that namespace "
                          "(%s)", name, label,
                          (bufs[i]->slab->owner & GROUP_SET) ? "as group:GROUP/NAME" : "under a plain name");
    }
  *old = gpupool__smap_get(&reg->names, key);
  if (*old && (*old)->file)
    return gpupool__err(GPUPOOL_EEXIST, "'%s' names a published file; unpublish it before publishing buffers "
                        "under that name", name);
  u = gpupool__uid_usage_get(reg, c->tenant, 0);
  /* Republished by another tenant of the namespace (a group's name), the name moves to its
   * count: that tenant's limit applies as to a new name. */
  if (*old && (*old)->tenant != c->tenant && cfg->max_names_per_uid && u && u->names >= cfg->max_names_per_uid) {
    gpupool__tenant_label(cfg, c->tenant, who, sizeof who);
    return gpupool__err(GPUPOOL_ELIMIT,
                        "%s already has %u names published, the limit (max_names_per_uid) is %u; "
                        "republishing '%s' would make it one more", who, u->names, cfg->max_names_per_uid, name);
  }
  return *old ? 0 : gpupool__new_name_fits(reg, c->tenant);
}

/* Make (bufs, layout) the current version of `key`, creating the name or replacing its
 * previous version in one step. Takes over bufs (an array of nbufs buffers, each given one
 * reference here) and the caller's reference on layout. Cannot fail once the name exists. */
static int publish_commit(gpupool__registry *reg, gpupool__client *c, const char *key, gpupool__name *n,
                          gpupool__buffer **bufs, uint32_t nbufs, gpupool__layout *layout,
                          int read_only, const gpupool_tensor_meta *meta, uint64_t *version) {
  uint64_t prev = 0;
  if (!n) {
    n = calloc(1, sizeof *n);
    if (!n || !(n->name = strdup(key)) || gpupool__smap_put(&reg->names, key, n) != 0) {
      if (n)
        free(n->name);
      free(n);
      gpupool__layout_unref(reg, layout);
      free(bufs);
      return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
    }
    reg->nnames++;
    gpupool__uid_usage *u = gpupool__uid_usage_get(reg, c->tenant, 1);
    if (u)
      u->names++; /* (the record holds at least this client's hold: it exists) */
    n->tenant = c->tenant;
  } else {
    prev = n->version;
  }
  /* The new version's references first: a buffer kept from the previous version must not
   * drop to zero in between. */
  for (uint32_t i = 0; i < nbufs; i++) {
    bufs[i]->refs++;
    bufs[i]->names++;
  }
  name_clear(reg, n);
  if (n->tenant != c->tenant) {
    /* Republished by another member of the namespace: the name now counts against it. */
    gpupool__uid_usage *u = gpupool__uid_usage_get(reg, n->tenant, 0);
    if (u) {
      u->names--;
      gpupool__uid_usage_put(reg, u);
    }
    u = gpupool__uid_usage_get(reg, c->tenant, 1);
    if (u)
      u->names++;
    n->tenant = c->tenant;
  }
  n->bufs = bufs;
  n->nbufs = nbufs;
  n->layout = layout;
  n->version = prev + 1;
  n->uid = c->uid;
  n->read_only = read_only;
  n->created_ns = gpupool__now_ns();
  n->has_meta = meta != NULL;
  if (meta) {
    n->meta = *meta;
    bufs[0]->meta = *meta;
    bufs[0]->has_meta = 1;
  }
  if (version)
    *version = n->version;
  return 0;
}

int gpupool__publish(gpupool__registry *reg, gpupool__client *c, uint64_t hold_id, const char *name,
                     const Gpupool__Wire__TensorMeta *meta, gid_t share_gid, int share_all, uint64_t *version) {
  gpupool__hold *h = NULL;
  gpupool__name *old = NULL;
  gpupool__buffer **bufs;
  gpupool_tensor_meta m;
  int rc, has_meta = meta && meta->present;
  char key[GPUPOOL_NAME_KEY_MAX + 1];

  if ((rc = gpupool__hold_of(reg, c, hold_id, &h)) != 0)
    return rc;
  if (share_gid || share_all)
    return gpupool__err(GPUPOOL_EINVAL,
                        "publishing to other users (share_gid/share_all) is gone: its readers would get "
                        "the fd of a slab holding the publisher's other buffers. Allocate in a pool the "
                        "operator shares with a group (share = GROUP) and publish as group:GROUP/NAME");
  if ((rc = publish_check(reg, c, name, &h->buf, 1, key, sizeof key, &old)) != 0)
    return rc;
  if (has_meta && (rc = gpupool__wire_meta_from(meta, h->buf->asked, &m)) != 0)
    return rc;
  if (!(bufs = malloc(sizeof *bufs)))
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  bufs[0] = h->buf;
  /* A name never upgrades the hold it was published from. */
  return publish_commit(reg, c, key, old, bufs, 1, NULL, h->read_only, has_meta ? &m : NULL, version);
}

/* Refuses a table whose member names repeat (an open-addressing set of the names: O(n), as
 * long as the names cannot be chosen to share a slot, hence the seeded hash). */
int gpupool__members_unique(const gpupool__member *m, size_t n) {
  size_t cap = 16, i;
  uint32_t *slots;
  while (cap < 2 * n)
    cap *= 2;
  if (!(slots = calloc(cap, sizeof *slots)))
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  for (i = 0; i < n; i++) {
    size_t k = (size_t)gpupool__hash_bytes(m[i].name, strlen(m[i].name)) & (cap - 1);
    for (; slots[k]; k = (k + 1) & (cap - 1))
      if (!strcmp(m[i].name, m[slots[k] - 1].name)) {
        free(slots);
        return gpupool__err(GPUPOOL_EINVAL, "member name '%s' appears twice (again at member %zu); member names "
                            "must be unique in a bundle", m[i].name, i);
      }
    slots[k] = (uint32_t)i + 1;
  }
  free(slots);
  return 0;
}

/* Checks a member's name, range and tensor description and copies it into *out. */
int gpupool__member_from_wire(const char *name, uint64_t offset, uint64_t size, const Gpupool__Wire__TensorMeta *tm,
                              uint64_t limit, size_t idx, gpupool__member *out) {
  gpupool_tensor_meta m;
  int rc;
  if (!name || gpupool__wire_check_name(name) != 0)
    return gpupool__err(GPUPOOL_ENAME, "member %zu: %s", idx,
                        name ? gpupool__errmsg() : "no name; every member needs a name of 1..255 bytes");
  if (size == 0)
    return gpupool__err(GPUPOOL_EINVAL, "member %zu ('%s') has size 0; members need at least 1 byte", idx, name);
  if (offset > limit || size > limit - offset)
    return gpupool__err(GPUPOOL_EINVAL,
                        "member %zu ('%s'): range [%" PRIu64 ", +%" PRIu64 ") does not fit in its buffer of %" PRIu64
                        " bytes", idx, name, offset, size, limit);
  if (tm && tm->present && (rc = gpupool__wire_meta_from(tm, size, &m)) != 0)
    return gpupool__err(rc, "member %zu ('%s'): %s", idx, name, gpupool__errmsg());
  memset(out, 0, sizeof *out);
  out->offset = offset;
  out->size = size;
  if (!(out->name = strdup(name)))
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  if (tm && tm->present) {
    if (!(out->meta = malloc(sizeof *out->meta))) {
      free(out->name);
      out->name = NULL;
      return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
    }
    *out->meta = m;
  }
  return 0;
}

int gpupool__check_member_count(gpupool__registry *reg, size_t n) {
  if (n == 0)
    return gpupool__err(GPUPOOL_EINVAL, "a bundle needs at least one member");
  if (n > reg->cfg->max_bundle_members)
    return gpupool__err(GPUPOOL_ELIMIT,
                        "bundle of %zu members is over the limit (max_bundle_members) of %u; split it into "
                        "several names", n, reg->cfg->max_bundle_members);
  return 0;
}

int gpupool__publish_bundle(gpupool__registry *reg, gpupool__client *c, const char *name, const uint64_t *hold_ids,
                            size_t nholds, Gpupool__Wire__BundleMember *const *wm, size_t nmembers,
                            uint64_t layout_id, uint64_t *version) {
  gpupool__buffer **bufs = NULL;
  gpupool__member *members = NULL;
  gpupool__layout *layout = NULL;
  gpupool__name *old = NULL;
  uint32_t *used = NULL;
  char key[GPUPOOL_NAME_KEY_MAX + 1];
  size_t i, nm = 0;
  uint32_t fd_slabs = 0;
  int rc, read_only = 0;
  gpupool__hmap seen;

  gpupool__hmap_init(&seen);
  if (layout_id && nmembers)
    return gpupool__err(GPUPOOL_EINVAL, "a bundle is published with its members or with a layout id, not both");
  if (layout_id) {
    layout = gpupool__hmap_get(&reg->layouts, layout_id);
    if (!layout || layout->tenant != c->tenant)
      return gpupool__err(GPUPOOL_ENOENT, "member table %" PRIu64 " is not one this daemon has for your tenant (it "
                          "went with the last bundle that used it); publish the members themselves", layout_id);
    if (nholds != layout->nbufs)
      return gpupool__err(GPUPOOL_EINVAL, "member table %" PRIu64 " spans %u buffers, not %zu", layout_id,
                          layout->nbufs, nholds);
    nmembers = layout->n;
  } else if ((rc = gpupool__check_member_count(reg, nmembers)) != 0) {
    return rc;
  }
  if (nholds == 0 || nholds > nmembers)
    return gpupool__err(GPUPOOL_EINVAL, "a bundle of %zu members lies in 1 to %zu buffers, not %zu", nmembers,
                        nmembers, nholds);
  if (!(bufs = calloc(nholds, sizeof *bufs)) || !(used = calloc(nholds, sizeof *used)) ||
      (!layout && !(members = calloc(nmembers, sizeof *members)))) {
    rc = gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
    goto fail;
  }
  /* Buffer and slab ids come from one counter: one set tells repeats of either. */
  for (i = 0; i < nholds; i++) {
    gpupool__hold *h = NULL;
    if ((rc = gpupool__hold_of(reg, c, hold_ids[i], &h)) != 0)
      goto fail;
    if (gpupool__hmap_get(&seen, h->buf->id)) {
      rc = gpupool__err(GPUPOOL_EINVAL, "buffer %" PRIu64 " is listed twice (hold %" PRIu64 " and another); list "
                        "each buffer once", h->buf->id, hold_ids[i]);
      goto fail;
    }
    bufs[i] = h->buf;
    read_only |= h->read_only;
    if (layout && layout->need[i] > h->buf->asked) {
      rc = gpupool__err(GPUPOOL_EINVAL, "member table %" PRIu64 " needs %" PRIu64 " bytes in buffer %zu, which has %"
                        PRIu64, layout_id, layout->need[i], i, h->buf->asked);
      goto fail;
    }
    /* Each getter needs the fd of every slab it has not mapped, all in one reply frame. */
    if (h->buf->slab->bs.fd >= 0 && !gpupool__hmap_get(&seen, h->buf->slab->id)) {
      if (++fd_slabs > GPUPOOL_WIRE_MAX_FDS) {
        rc = gpupool__err(GPUPOOL_EINVAL,
                          "the bundle's buffers lie in more than %d slabs, more than one reply can carry; "
                          "allocate its members with gpupool_bundle_alloc, which packs them into few buffers",
                          GPUPOOL_WIRE_MAX_FDS);
        goto fail;
      }
      if (gpupool__hmap_put(&seen, h->buf->slab->id, h->buf->slab) != 0) {
        rc = gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
        goto fail;
      }
    }
    if (gpupool__hmap_put(&seen, h->buf->id, h->buf) != 0) {
      rc = gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
      goto fail;
    }
  }
  if (!layout) {
    for (nm = 0; nm < nmembers; nm++) {
      const Gpupool__Wire__BundleMember *m = wm[nm];
      if (m->buffer >= nholds) {
        rc = gpupool__err(GPUPOOL_EINVAL, "member %zu ('%s') names buffer %u of a bundle of %zu buffers", nm,
                          m->name ? m->name : "", m->buffer, nholds);
        goto fail;
      }
      if ((rc = gpupool__member_from_wire(m->name, m->offset, m->size, m->tensor, bufs[m->buffer]->asked, nm,
                                 &members[nm])) != 0)
        goto fail;
      members[nm].buffer = m->buffer;
      used[m->buffer] = 1;
    }
    for (i = 0; i < nholds; i++)
      if (!used[i]) {
        rc = gpupool__err(GPUPOOL_EINVAL, "no member lies in buffer %zu (hold %" PRIu64 "); list only the buffers "
                          "the members use", i, hold_ids[i]);
        goto fail;
      }
    if ((rc = gpupool__members_unique(members, nmembers)) != 0)
      goto fail;
  }
  if ((rc = publish_check(reg, c, name, bufs, (uint32_t)nholds, key, sizeof key, &old)) != 0)
    goto fail;
  if (layout) {
    layout->refs++;
  } else {
    /* The previous version's table goes with it when nothing else uses it. */
    uint64_t freed = old && old->layout && old->layout->refs == 1 && old->layout->tenant == c->tenant
                         ? old->layout->n : 0;
    rc = gpupool__layout_new(reg, c->tenant, members, (uint32_t)nmembers, (uint32_t)nholds, freed, &layout);
    members = NULL; /* taken over, also on failure */
    nm = 0;
    if (rc != 0)
      goto fail;
  }
  free(used);
  gpupool__hmap_free(&seen);
  return publish_commit(reg, c, key, old, bufs, (uint32_t)nholds, layout, read_only, NULL, version);
fail:
  gpupool__members_free(members, (uint32_t)nm);
  free(bufs);
  free(used);
  gpupool__hmap_free(&seen);
  return rc;
}

int gpupool__find_name(gpupool__registry *reg, gpupool__client *c, const char *name, gpupool__name **out) {
  char key[GPUPOOL_NAME_KEY_MAX + 1];
  uint64_t owner;
  int rc = gpupool__name_key(reg, c, name, key, sizeof key, &owner);
  if (rc != 0)
    return rc;
  *out = gpupool__smap_get(&reg->names, key);
  if (!*out)
    return gpupool__err(GPUPOOL_ENOENT, "no buffer is published under '%s'", name);
  return 0;
}

static int find_newer(gpupool__registry *reg, gpupool__client *c, const char *name, uint64_t newer_than,
                      gpupool__name **out) {
  int rc = gpupool__find_name(reg, c, name, out);
  if (rc == 0 && (*out)->file)
    return gpupool__err(GPUPOOL_EINVAL, "'%s' names a published file, not a buffer: get it with gpupool_get_file "
                        "(Python: Client.get_file_array)", name);
  if (rc == 0 && (*out)->version <= newer_than)
    return gpupool__err(GPUPOOL_ENOENT, "'%s' is at version %" PRIu64 ", not newer than %" PRIu64, name,
                        (*out)->version, newer_than);
  if (rc == 0)
    rc = gpupool__check_waiting_leases(reg, c);
  return rc;
}

int gpupool__get(gpupool__registry *reg, gpupool__client *c, const char *name, int read_only, uint64_t newer_than,
                 gpupool__hold **out, uint64_t *version) {
  gpupool__name *n;
  int rc = find_newer(reg, c, name, newer_than, &n);
  if (rc != 0)
    return rc;
  /* Any bundle, one member included: a plain get would hand over its whole buffer without
   * the member's range and description. */
  if (n->layout || n->nbufs != 1)
    return gpupool__err(GPUPOOL_EINVAL,
                        "'%s' is a bundle of %u member%s in %u buffer%s; get it with gpupool_bundle_get "
                        "(Python: get_dict)", name, n->layout ? n->layout->n : 0,
                        n->layout && n->layout->n == 1 ? "" : "s", n->nbufs,
                        n->nbufs == 1 ? "" : "s");
  if (version)
    *version = n->version;
  return gpupool__hold_new(reg, c, n->bufs[0], read_only || n->read_only, 0, out);
}

int gpupool__get_bundle(gpupool__registry *reg, gpupool__client *c, const char *name, int read_only,
                        uint64_t newer_than, gpupool__hold ***holds, const gpupool__name **out) {
  gpupool__name *n;
  gpupool__hold **hs;
  int rc = find_newer(reg, c, name, newer_than, &n);
  if (rc != 0)
    return rc;
  if (!(hs = calloc(n->nbufs, sizeof *hs)))
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  for (uint32_t i = 0; i < n->nbufs; i++)
    if ((rc = gpupool__hold_new(reg, c, n->bufs[i], read_only || n->read_only, 0, &hs[i])) != 0) {
      while (i-- > 0)
        gpupool__hold_drop(reg, hs[i], 0, NULL);
      free(hs);
      return rc;
    }
  *holds = hs;
  *out = n;
  return 0;
}

void gpupool__hold_discard(gpupool__registry *reg, gpupool__hold *h) { gpupool__hold_drop(reg, h, 0, NULL); }

void gpupool__bundle_plan_free(gpupool__bundle_plan *plan) {
  if (!plan)
    return;
  if (plan->layout)
    gpupool__layout_unref(plan->reg, plan->layout);
  else
    gpupool__members_free(plan->members, plan->nmembers);
  free(plan->chunks);
  free(plan);
}

int gpupool__bundle_plan_new(gpupool__registry *reg, gpupool__client *c, gpupool__pool *p,
                             Gpupool__Wire__MemberSpec *const *specs, size_t n, uint64_t align,
                             gpupool__bundle_plan **out) {
  gpupool__bundle_plan *plan;
  uint64_t owner, cur = 0, limit;
  size_t i;
  int rc;

  if ((rc = gpupool__check_member_count(reg, n)) != 0)
    return rc;
  if ((rc = gpupool__pool_owner(reg, c, p, &owner)) != 0 || (rc = gpupool__pool_alignment(p, &align)) != 0)
    return rc;
  /* A chunk is one exported allocation: at most 4 GiB (the CUDA driver's limit on one). */
  limit = GPUPOOL_SLAB_HARD_MAX & ~(align - 1);
  if (!(plan = calloc(1, sizeof *plan)) || !(plan->members = calloc(n, sizeof *plan->members)) ||
      !(plan->chunks = calloc(n, sizeof *plan->chunks))) {
    gpupool__bundle_plan_free(plan);
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  }
  plan->pool = p;
  plan->reg = reg;
  plan->align = align;
  for (i = 0; i < n; i++) {
    const Gpupool__Wire__MemberSpec *sp = specs[i];
    gpupool__member *m = &plan->members[i];
    uint64_t off;
    if ((rc = gpupool__member_from_wire(sp->name, 0, sp->size, sp->tensor, UINT64_MAX, i, m)) != 0)
      goto fail;
    plan->nmembers = (uint32_t)i + 1;
    if (sp->size > limit) {
      rc = gpupool__err(GPUPOOL_ETOOBIG,
                        "member %zu ('%s') of %" PRIu64 " bytes is larger than one allocation of pool '%s' may be "
                        "(%" PRIu64 " bytes); split it", i, sp->name, sp->size, p->cfg.name, limit);
      goto fail;
    }
    off = gpupool__round_up(cur, align);
    if (plan->nchunks == 0 || off + sp->size > limit || off < cur) {
      /* Start a new chunk (the first one, or this member does not fit in the current one). */
      if (plan->nchunks)
        plan->chunks[plan->nchunks - 1] = cur;
      plan->nchunks++;
      off = 0;
    }
    m->buffer = plan->nchunks - 1;
    m->offset = off;
    cur = off + sp->size;
  }
  plan->chunks[plan->nchunks - 1] = cur;
  for (i = 0; i < plan->nchunks; i++) {
    if (plan->total + plan->chunks[i] < plan->total) {
      rc = gpupool__err(GPUPOOL_EINVAL, "the bundle's total size overflows");
      goto fail;
    }
    plan->total += plan->chunks[i];
  }
  if (plan->total > p->cfg.capacity) {
    rc = gpupool__err(GPUPOOL_ETOOBIG,
                      "bundle of %" PRIu64 " bytes is larger than pool '%s' (capacity %" PRIu64 " bytes)",
                      plan->total, p->cfg.name, p->cfg.capacity);
    goto fail;
  }
  if ((rc = gpupool__members_unique(plan->members, n)) != 0)
    goto fail;
  rc = gpupool__layout_new(reg, c->tenant, plan->members, (uint32_t)n, plan->nchunks, 0, &plan->layout);
  if (rc != 0) {
    plan->members = NULL; /* freed by layout_new */
    plan->nmembers = 0;
    goto fail;
  }
  *out = plan;
  return 0;
fail:
  gpupool__bundle_plan_free(plan);
  return rc;
}

int gpupool__bundle_allocate(gpupool__registry *reg, gpupool__client *c, const gpupool__bundle_plan *plan,
                             gpupool__hold ***holds) {
  gpupool__hold **hs = calloc(plan->nchunks, sizeof *hs);
  int rc = 0;
  if (!hs)
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  for (uint32_t i = 0; i < plan->nchunks; i++)
    if ((rc = gpupool__allocate(reg, c, plan->pool, plan->chunks[i], plan->align, &hs[i])) != 0) {
      char msg[GPUPOOL__ERRMSG_MAX];
      int returned = reg->memory_returned;
      snprintf(msg, sizeof msg, "%s", gpupool__errmsg());
      /* Giving back the chunks just taken returns nothing that was free before this call:
       * it must not wake the waiting allocations (this one among them, which would be
       * tried again at once, fail the same way, and so on forever). */
      while (i-- > 0)
        gpupool__hold_drop(reg, hs[i], 0, NULL);
      reg->memory_returned = returned;
      free(hs);
      if (plan->nchunks > 1)
        return gpupool__err(rc, "bundle of %" PRIu64 " bytes in %u buffers: %s", plan->total, plan->nchunks, msg);
      return gpupool__err(rc, "%s", msg);
    }
  /* Each chunk keeps the layout, so the bundle can be published by its id while it lives. */
  for (uint32_t i = 0; i < plan->nchunks; i++) {
    hs[i]->buf->layout = plan->layout;
    plan->layout->refs++;
  }
  *holds = hs;
  return 0;
}

/* Take n out of the table and free it. */
static void name_remove(gpupool__registry *reg, gpupool__name *n) {
  gpupool__uid_usage *u;
  gpupool__smap_del(&reg->names, n->name);
  reg->nnames--;
  if ((u = gpupool__uid_usage_get(reg, n->tenant, 0))) {
    u->names--;
    gpupool__uid_usage_put(reg, u);
  }
  gpupool__name_free(reg, n);
}

int gpupool__unpublish(gpupool__registry *reg, gpupool__client *c, const char *name) {
  gpupool__name *n;
  int rc = gpupool__find_name(reg, c, name, &n);
  if (rc != 0)
    return rc;
  /* Found in the caller's own namespace (its tenant's, or a group it is in): its members
   * share it, so any of them may take a name out. */
  name_remove(reg, n);
  return 0;
}

int gpupool__unpublish_key(gpupool__registry *reg, const char *key) {
  gpupool__name *n = gpupool__smap_get(&reg->names, key);
  if (!n)
    return gpupool__err(GPUPOOL_ENOENT, "no name is filed under '%s' (names are listed with their tenant, e.g. "
                        "uid:1000/weights, by gpupoolctl names)", key);
  name_remove(reg, n);
  return 0;
}

void gpupool__unmapped(gpupool__registry *reg, gpupool__client *c, const uint64_t *ids, size_t n) {
  for (size_t k = 0; k < n; k++) {
    gpupool__slab *s = gpupool__hmap_get(&reg->slabs, ids[k]);
    for (uint32_t i = 0; i < c->nrevoke; i++)
      if (c->revoke[i] == ids[k]) {
        c->revoke[i] = c->revoke[--c->nrevoke];
        break;
      }
    gpupool__hmap_del(&c->mapped, ids[k]);
    gpupool__hmap_del(&c->mapped_ro, ids[k]);
    if (!s)
      continue;
    for (uint32_t i = 0; i < s->nmappers; i++)
      if (s->mappers[i].client_id == c->id) {
        gpupool__slab_remove_mapper_at(s, i);
        break;
      }
    gpupool__slab_try_release(reg, s);
  }
}

void gpupool__trim(gpupool__registry *reg, uint32_t *freed, uint32_t *revoked) {
  *freed = *revoked = 0;
  gpupool__sweep(reg);
  for (int i = 0; i < reg->npools; i++) {
    for (gpupool__slab *s = reg->pools[i].slabs, *n; s; s = n) {
      n = s->next;
      if (s->retiring || s->nbuffers != 0)
        continue;
      if (slab_retire(reg, s))
        (*freed)++;
      else
        (*revoked)++;
    }
  }
}

/* ---- clients --------------------------------------------------------------------------------- */

void gpupool__client_init(gpupool__registry *reg, gpupool__client *c) {
  c->id = gpupool__next_id(reg);
  c->tenant = gpupool__tenant_of(reg->cfg, c->uid, c->gid);
  c->connected_ns = gpupool__now_ns();
  gpupool__hmap_init(&c->mapped);
  gpupool__hmap_init(&c->mapped_ro);
  gpupool__hmap_init(&c->attached);
  gpupool__hmap_put(&reg->clients, c->id, c);
}

void gpupool__client_drop(gpupool__registry *reg, gpupool__client *c) {
  gpupool__lease *lease = c->lease;
  int waiting = 0;

  c->lease = NULL;
  if (lease) {
    lease->client_id = c->id;
    if (c->nholds > 0 || c->mapped.len > 0)
      waiting = gpupool__lease_wait(reg, lease);
    if (waiting)
      GPUPOOL__PEER_INFO(&c->log_rl, c->id, "client %" PRIu64 " (pid %d uid %u, %s) closed its connection holding %" PRIu64
                    " buffer(s) and mapping %zu slab(s) while a process still holds its lease; that memory is "
                    "reused once every such process has exited or closed the lease",
                    c->id, (int)c->pid, (unsigned)c->uid, c->name, c->nholds, c->mapped.len);
  }
  while (c->holds)
    gpupool__hold_drop(reg, c->holds, 0, waiting ? lease : NULL);
  for (int i = 0; i < reg->npools; i++) {
    for (gpupool__slab *s = reg->pools[i].slabs, *n; s; s = n) {
      n = s->next;
      for (uint32_t j = 0; j < s->nmappers; j++) {
        if (s->mappers[j].client_id != c->id)
          continue;
        if (waiting) {
          s->mappers[j].client_id = 0;
          s->mappers[j].lease = lease;
          lease->refs++;
        } else {
          gpupool__slab_remove_mapper_at(s, j);
        }
        break;
      }
      gpupool__slab_try_release(reg, s);
    }
  }
  gpupool__hmap_del(&reg->clients, c->id);
  /* Its backend pools may go now: a process that still maps slabs of them keeps those slabs
   * (and so the pools) through its lease; one that only imported a pool holds nothing the
   * daemon could give to someone else (a destroyed pool is never handed out again). */
  for (size_t i = 0; i < c->attached.cap; i++)
    if (gpupool__hmap_slot_used(&c->attached, i)) {
      gpupool__pinst *in = c->attached.slots[i].val;
      in->attached--;
      gpupool__inst_maybe_destroy(reg, in);
    }
  gpupool__hmap_free(&c->attached);
  gpupool__hmap_free(&c->mapped);
  gpupool__hmap_free(&c->mapped_ro);
  free(c->revoke);
  c->revoke = NULL;
  c->nrevoke = c->caprevoke = 0;
  if (lease)
    gpupool__lease_unref(lease);
  gpupool__sweep(reg);
}

/* ---- descriptions ---------------------------------------------------------------------------- */

void gpupool__fill_pool_info(gpupool__registry *reg, gpupool__pool *p, Gpupool__Wire__PoolInfo *pi) {
  gpupool__bpool_stats st = {0};
  gpupool__wire__pool_info__init(pi);
  pi->id = p->id;
  pi->name = p->cfg.name;
  pi->backend = reg->be->desc->kind;
  pi->location = gpupool__wire_location(p->cfg.kind);
  pi->device = p->cfg.kind == GPUPOOL_MEM_HOST ? -1 : p->cfg.device;
  pi->numa_node = p->cfg.kind == GPUPOOL_MEM_HOST_NUMA ? p->cfg.numa_node : -1;
  pi->capacity = p->cfg.capacity;
  pi->slab_size = p->cfg.slab_size;
  pi->max_alloc = p->cfg.capacity < GPUPOOL_SLAB_HARD_MAX ? p->cfg.capacity : GPUPOOL_SLAB_HARD_MAX;
  pi->used = p->used;
  pi->reserved = p->reserved;
  pi->used_high = p->used_high;
  pi->reserved_high = p->reserved_high;
  /* The backend's counters, summed over the owners' backend pools. */
  for (gpupool__pinst *in = p->insts; in; in = in->next) {
    if (reg->be->ops->pool_stats(in->bp, &st) != 0)
      continue;
    pi->backend_reserved += st.reserved_cur;
    pi->backend_used += st.used_cur;
    if (!gpupool__per_owner(reg)) {
      pi->backend_reserved_high = st.reserved_high;
      pi->backend_used_high = st.used_high;
    }
  }
  if (gpupool__per_owner(reg)) {
    /* Instances peak at different times and take their marks with them when destroyed: the
     * highest sum seen. */
    if (pi->backend_reserved > p->backend_reserved_high)
      p->backend_reserved_high = pi->backend_reserved;
    if (pi->backend_used > p->backend_used_high)
      p->backend_used_high = pi->backend_used;
    pi->backend_reserved_high = p->backend_reserved_high;
    pi->backend_used_high = p->backend_used_high;
  }
  pi->held = p->held;
  pi->instances = p->ninsts;
  pi->buffers = p->nbuffers;
  pi->slabs = p->nslabs;
}

void gpupool__fill_desc(gpupool__registry *reg, gpupool__client *c, gpupool__hold *h, const char *name, gpupool__desc_storage *s) {
  gpupool__buffer *b = h->buf;
  gpupool__slab *sl = b->slab;

  gpupool__wire__buffer_desc__init(&s->desc);
  gpupool__wire__slab_ref__init(&s->slab);
  s->desc.buffer_id = b->id;
  s->desc.hold_id = h->id;
  s->desc.pool_id = sl->pool->id;
  s->desc.offset = b->offset;
  s->desc.size = b->asked;
  s->desc.read_only = h->read_only;
  s->desc.name = (char *)(name ? name : "");
  s->slab.id = sl->id;
  s->slab.pool_id = sl->pool->id;
  s->slab.size = sl->bs.size;
  s->slab.dedicated = sl->dedicated;
  s->fd = -1;
  {
    int mapped = gpupool__hmap_get(&c->mapped, sl->id) != NULL;
    int mapped_ro = mapped && gpupool__hmap_get(&c->mapped_ro, sl->id) != NULL;
    int remembered = mapped;
    if (!mapped) {
      /* Remember the mapping first: a slab handed out unrecorded could be freed under it. */
      remembered = gpupool__hmap_put(&c->mapped, sl->id, sl) == 0;
      if (remembered && gpupool__slab_add_mapper(sl, c->id) != 0) {
        gpupool__hmap_del(&c->mapped, sl->id);
        remembered = 0;
      }
    }
    if (remembered && (!mapped || (mapped_ro && !h->read_only))) {
      /* The first buffer of this slab for this client, or the first it may write: send how to
       * map it, with the slab's fd where the backend has one (read-only for a read-only
       * hold, so the kernel enforces it). Out of memory above, nothing is sent, and the
       * client refuses the buffer for want of export data (its hold is released). */
      s->slab.export_data.data = sl->bs.export_data;
      s->slab.export_data.len = sl->bs.export_len;
      s->slab.writable = !h->read_only;
      if (sl->bs.fd >= 0) {
        s->fd = h->read_only ? sl->bs.fd_ro : sl->bs.fd;
        s->slab.fd_attached = 1;
      }
      if (h->read_only)
        (void)gpupool__hmap_put(&c->mapped_ro, sl->id, sl);
      else
        gpupool__hmap_del(&c->mapped_ro, sl->id);
    }
  }
  s->desc.slab = &s->slab;
  if (b->ready) {
    gpupool__wire__event_ref__init(&s->ready);
    s->ready.id = b->ready->id;
    s->ready.ipc_handle.data = b->ready->handle;
    s->ready.ipc_handle.len = GPUPOOL_EVENT_HANDLE_SIZE;
    s->desc.ready = &s->ready;
  }
  if (h->done) {
    gpupool__wire__event_ref__init(&s->done);
    s->done.id = h->done->id;
    s->done.ipc_handle.data = h->done->handle;
    s->done.ipc_handle.len = GPUPOOL_EVENT_HANDLE_SIZE;
    s->desc.done = &s->done;
  }
  {
    char key[GPUPOOL_NAME_KEY_MAX + 1];
    uint64_t owner;
    const gpupool__name *nm = name && *name && gpupool__name_key(reg, c, name, key, sizeof key, &owner) == 0
                                  ? gpupool__smap_get(&reg->names, key)
                                  : NULL;
    const gpupool_tensor_meta *m = nm && nm->nbufs == 1 && nm->bufs[0] == b && !nm->layout
                                       ? (nm->has_meta ? &nm->meta : NULL)
                                   : b->has_meta      ? &b->meta
                                                      : NULL;
    if (!m)
      return;
    gpupool__wire_meta_to(m, &s->meta);
    s->desc.tensor = &s->meta;
  }
}

/* ---- lifetime -------------------------------------------------------------------------------- */

int gpupool__registry_init(gpupool__registry *reg, uv_loop_t *loop, const gpupool__config *cfg,
                     gpupool__backend *be) {
  int rc = 0;
  memset(reg, 0, sizeof *reg);
  reg->cfg = cfg;
  reg->be = be;
  reg->loop = loop;
  gpupool__hmap_init(&reg->buffers);
  gpupool__hmap_init(&reg->holds);
  gpupool__hmap_init(&reg->slabs);
  gpupool__hmap_init(&reg->clients);
  gpupool__hmap_init(&reg->uids);
  gpupool__smap_init(&reg->names);
  gpupool__hmap_init(&reg->layouts);
  gpupool__hmap_init(&reg->layout_hash);
  uv_timer_init(loop, &reg->sweep_timer);
  reg->sweep_timer.data = reg;
  reg->pools = calloc((size_t)cfg->n_pools, sizeof *reg->pools);
  if (!reg->pools)
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory");
  for (int i = 0; i < cfg->n_pools; i++) {
    gpupool__pool *p = &reg->pools[i];
    gpupool__pinst *in = NULL;
    p->id = (uint32_t)i + 1;
    p->cfg = cfg->pools[i];
    /* One backend pool for every owner, or (per-owner backends) one made and destroyed now
     * so that a pool the backend refuses is refused at startup, not at first use. */
    if ((rc = gpupool__inst_new(reg, p, GPUPOOL__OWNER_ANY, &in)) != 0)
      return rc; /* the message names the pool */
    if (gpupool__per_owner(reg)) {
      gpupool__inst_destroy(reg, in);
      p->insts_created = 0;
    }
    reg->npools++;
    char where[64];
    if (p->cfg.kind == GPUPOOL_MEM_HOST)
      snprintf(where, sizeof where, "host memory (memfd)");
    else if (p->cfg.kind == GPUPOOL_MEM_HOST_NUMA)
      snprintf(where, sizeof where, "pinned host memory on NUMA node %d", p->cfg.numa_node);
    else
      snprintf(where, sizeof where, "device memory of GPU %d", p->cfg.device);
    GPUPOOL__INFO("pool '%s' ready: %s, capacity %" PRIu64 " MiB, slabs of %" PRIu64 " MiB, keeps %u empty slab(s)%s",
            p->cfg.name, where, p->cfg.capacity / MIB, p->cfg.slab_size / MIB, p->cfg.keep_slabs,
            gpupool__per_owner(reg) ? "; one backend pool per tenant (or shared group), made on first use" : "");
  }
  return 0;
}

void gpupool__registry_stop(gpupool__registry *reg) {
  uint64_t bytes = 0, nbuf = 0, on_leases = 0, mapped_slabs = 0;
  if (reg->stopped)
    return;
  reg->stopped = 1;
  for (gpupool__buffer *b = reg->pending; b; b = b->pending_next) {
    nbuf++;
    bytes += b->size;
    if (b->nleases)
      on_leases++;
  }
  for (int i = 0; i < reg->npools; i++)
    for (gpupool__slab *s = reg->pools[i].slabs; s; s = s->next)
      for (uint32_t j = 0; j < s->nmappers; j++)
        if (s->mappers[j].lease && !s->mappers[j].lease->gone) {
          mapped_slabs++;
          break;
        }
  if (reg->nwaiting || nbuf)
    GPUPOOL__INFO("stopping with %" PRIu64 " closed connection(s) whose processes still hold their lease, %" PRIu64
                  " buffer(s) (%" PRIu64 " bytes) not yet reusable (%" PRIu64 " waiting for such processes, the rest "
                  "for GPU work) and %" PRIu64 " slab(s) still mapped by them; not waiting: a stopped daemon "
                  "reuses nothing, so that memory stays valid for them",
                  reg->nwaiting, nbuf, bytes, on_leases, mapped_slabs);
  for (gpupool__lease *l = reg->waiting; l; l = l->next)
    if (l->polling)
      uv_poll_stop(&l->poll);
  if (reg->sweep_timer_on) {
    uv_timer_stop(&reg->sweep_timer);
    reg->sweep_timer_on = 0;
  }
}

void gpupool__registry_close(gpupool__registry *reg) {
  /* Every client is gone: drop names, then finish every pending free regardless of events
   * (the daemon is exiting; the backend's pools go with it). */
  for (size_t i = 0; i < reg->names.cap; i++) {
    if (!gpupool__smap_slot_used(&reg->names, i))
      continue;
    gpupool__name_free(reg, reg->names.slots[i].val);
  }
  gpupool__smap_free(&reg->names);
  while (reg->pending) {
    gpupool__buffer *b = reg->pending;
    reg->pending = b->pending_next;
    for (uint32_t i = 0; i < b->ndone; i++)
      gpupool__event_put(reg, b->done[i]);
    for (uint32_t i = 0; i < b->nleases; i++)
      gpupool__lease_unref(b->leases[i]);
    b->ndone = b->nleases = 0;
    gpupool__finish_free(reg, b);
  }
  for (int i = 0; i < reg->npools; i++) {
    gpupool__pool *p = &reg->pools[i];
    /* Slabs that live processes still map are given back too: what the daemon lets go of is
     * its own reference (a host slab's memfd, a CUDA allocation), and the processes' own
     * mappings keep the memory for as long as they need it. */
    while (p->slabs)
      gpupool__slab_destroy(reg, p->slabs);
    while (p->insts)
      gpupool__inst_destroy(reg, p->insts);
  }
  for (uint32_t i = 0; i < reg->nevents; i++) {
    reg->be->ops->event_destroy(reg->events[i]->be);
    free(reg->events[i]);
  }
  free(reg->events);
  /* Layouts still referenced by buffers that were never freed (kept on purpose when a
   * dependency could not be recorded). */
  for (size_t i = 0; i < reg->layouts.cap; i++)
    if (gpupool__hmap_slot_used(&reg->layouts, i)) {
      gpupool__layout *l = reg->layouts.slots[i].val;
      gpupool__members_free(l->members, l->n);
      free(l->need);
      free(l);
    }
  gpupool__hmap_free(&reg->layouts);
  gpupool__hmap_free(&reg->layout_hash);
  for (size_t i = 0; i < reg->uids.cap; i++)
    if (gpupool__hmap_slot_used(&reg->uids, i))
      free(reg->uids.slots[i].val);
  gpupool__hmap_free(&reg->uids);
  gpupool__hmap_free(&reg->buffers);
  gpupool__hmap_free(&reg->holds);
  gpupool__hmap_free(&reg->slabs);
  gpupool__hmap_free(&reg->clients);
  free(reg->pools);
  if (reg->sweep_timer_on)
    uv_timer_stop(&reg->sweep_timer);
  uv_close((uv_handle_t *)&reg->sweep_timer, NULL);
}
