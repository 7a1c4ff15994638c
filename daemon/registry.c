/*
 * The daemon's registry: pools, slabs, buffers, holds, names, events and dead clients.
 * See registry.h for who owns what. The rules that keep memory safe:
 *   - a buffer's range returns to its slab only in finish_free(), reached once refs == 0
 *     and every dependency (recorded done events, exited holder processes) has cleared;
 *   - a slab returns to the backend only in slab_destroy(), reached once it is empty,
 *     retiring, and no live client or not-yet-exited dead client still maps it.
 * Everything runs on the daemon's single loop thread.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "errors.h"
#include "log.h"
#include "registry.h"

#define MIB ((uint64_t)1 << 20)
#define SLAB_GRAIN (2 * MIB)

uint64_t gpupool__now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static uint64_t next_id(gpupool__registry *reg) { return ++reg->next_id; }

static uint64_t round_up(uint64_t v, uint64_t a) { return (v + a - 1) & ~(a - 1); }

static int grow(void **arr, uint32_t *cap, uint32_t need, size_t elem) {
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
  if (grow((void **)&reg->events, &reg->capevents, reg->nevents + 1, sizeof *reg->events) != 0)
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

static void event_put(gpupool__registry *reg, gpupool__event *e) {
  if (!e)
    return;
  e->next_free = reg->free_events;
  reg->free_events = e;
}

/* ---- dead clients -------------------------------------------------------------------------- */

static void corpse_closed(uv_handle_t *h) {
  gpupool__corpse *c = h->data;
  if (c->pidfd >= 0)
    close(c->pidfd);
  free(c);
}

static void corpse_unref(gpupool__corpse *c) {
  if (--c->refs > 0)
    return;
  if (c->pidfd >= 0) {
    uv_close((uv_handle_t *)&c->poll, corpse_closed);
  } else {
    free(c);
  }
}

static void corpse_exited(uv_poll_t *p, int status, int events) {
  gpupool__corpse *c = p->data;
  (void)status;
  (void)events;
  c->exited = 1;
  uv_poll_stop(p);
  GPUPOOL__INFO("client process %d has exited; its memory can be reused", (int)c->pid);
  gpupool__sweep(c->reg);
  if (c->reg->on_memory)
    c->reg->on_memory(c->reg, NULL);
}

/* Takes ownership of pidfd (may be -1: no way to watch the process, treated as exited). */
static gpupool__corpse *corpse_new(gpupool__registry *reg, pid_t pid, int pidfd) {
  gpupool__corpse *c = calloc(1, sizeof *c);
  if (!c) {
    if (pidfd >= 0)
      close(pidfd);
    return NULL;
  }
  c->pid = pid;
  c->pidfd = pidfd;
  c->reg = reg;
  c->refs = 1; /* dropped at the end of gpupool__client_drop */
  if (pidfd < 0 || uv_poll_init(reg->loop, &c->poll, pidfd) != 0) {
    c->exited = 1;
    if (pidfd >= 0) {
      close(pidfd);
      c->pidfd = -1;
    }
    return c;
  }
  c->poll.data = c;
  uv_poll_start(&c->poll, UV_READABLE, corpse_exited);
  /* The watch matters only while the daemon serves (its own handles keep the loop running);
   * alone it must not hold up a shutdown until every such client process has exited. */
  uv_unref((uv_handle_t *)&c->poll);
  return c;
}

/* ---- slabs ----------------------------------------------------------------------------------- */

static void slab_destroy(gpupool__registry *reg, gpupool__slab *s) {
  gpupool__pool *p = s->pool;
  GPUPOOL__DEBUG("pool %s: slab %" PRIu64 " (%" PRIu64 " bytes) returned to the backend", p->cfg.name,
           s->id, s->bs.size);
  reg->be->ops->slab_free(p->bp, &s->bs);
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
    if (s->mappers[i].corpse)
      corpse_unref(s->mappers[i].corpse);
  gpupool__alloc_delete(s->alloc);
  free(s->mappers);
  free(s);
  reg->memory_returned = 1;
}

static void slab_try_release(gpupool__registry *reg, gpupool__slab *s) {
  if (s->retiring && s->nbuffers == 0 && s->nmappers == 0)
    slab_destroy(reg, s);
}

static void client_add_revoke(gpupool__client *c, uint64_t slab_id) {
  for (uint32_t i = 0; i < c->nrevoke; i++)
    if (c->revoke[i] == slab_id)
      return;
  if (grow((void **)&c->revoke, &c->caprevoke, c->nrevoke + 1, sizeof *c->revoke) == 0)
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
    client_add_revoke(c, s->id);
  }
  if (s->nbuffers == 0 && s->nmappers == 0) {
    slab_destroy(reg, s);
    return 1;
  }
  return 0;
}

static void slab_maybe_retire(gpupool__registry *reg, gpupool__slab *s) {
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

static int slab_new(gpupool__registry *reg, gpupool__pool *p, uint64_t size, int dedicated, gpupool__slab **out) {
  gpupool__slab *s;
  int rc;

  if (p->reserved + size > p->cfg.capacity)
    return GPUPOOL_ENOSPC;
  s = calloc(1, sizeof *s);
  if (!s)
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  rc = reg->be->ops->slab_alloc(p->bp, size, &s->bs);
  if (rc != 0)
    goto fail;
  if (!dedicated) {
    rc = gpupool__alloc_new(s->bs.size, &s->alloc);
    if (rc != 0) {
      reg->be->ops->slab_free(p->bp, &s->bs);
      goto fail;
    }
  }
  s->id = next_id(reg);
  s->pool = p;
  s->dedicated = dedicated;
  if ((rc = gpupool__hmap_put(&reg->slabs, s->id, s)) != 0) {
    gpupool__alloc_delete(s->alloc);
    reg->be->ops->slab_free(p->bp, &s->bs);
    goto fail;
  }
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
  return rc;
}

static int slab_add_mapper(gpupool__slab *s, uint64_t client_id) {
  if (grow((void **)&s->mappers, &s->capmappers, s->nmappers + 1, sizeof *s->mappers) != 0)
    return GPUPOOL_ENOMEM;
  s->mappers[s->nmappers].client_id = client_id;
  s->mappers[s->nmappers].corpse = NULL;
  s->nmappers++;
  return 0;
}

static void slab_remove_mapper_at(gpupool__slab *s, uint32_t i) {
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
    event_put(reg, e);
    b->ndone--;
  }
  while (b->ncorpses > 0) {
    gpupool__corpse *c = b->corpses[b->ncorpses - 1];
    if (!c->exited)
      return 0;
    corpse_unref(c);
    b->ncorpses--;
  }
  return 1;
}

static void finish_free(gpupool__registry *reg, gpupool__buffer *b) {
  gpupool__slab *s = b->slab;
  gpupool__pool *p = s->pool;
  if (s->alloc && gpupool__alloc_put(s->alloc, b->offset, b->size) != 0)
    GPUPOOL__ERROR("pool %s: range %" PRIu64 "+%" PRIu64 " of slab %" PRIu64 " refused by the allocator",
             p->cfg.name, b->offset, b->size, s->id);
  s->nbuffers--;
  p->used -= b->size;
  p->nbuffers--;
  event_put(reg, b->ready);
  free(b->done);
  free(b->corpses);
  free(b);
  reg->memory_returned = 1;
  slab_maybe_retire(reg, s);
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

static void uid_account(gpupool__registry *reg, uid_t uid, int64_t bytes, int32_t allocs) {
  gpupool__uid_usage *u = gpupool__hmap_get(&reg->uids, uid);
  if (!u) {
    if (bytes <= 0)
      return;
    u = calloc(1, sizeof *u);
    if (!u || gpupool__hmap_put(&reg->uids, uid, u) != 0) {
      free(u);
      return;
    }
    u->uid = uid;
  }
  u->bytes += (uint64_t)bytes;
  u->allocs += (uint32_t)allocs;
  if (u->allocs == 0 && u->bytes == 0) {
    gpupool__hmap_del(&reg->uids, uid);
    free(u);
  }
}

static void buffer_unref(gpupool__registry *reg, gpupool__buffer *b) {
  gpupool__client *owner;
  if (--b->refs > 0)
    return;
  gpupool__hmap_del(&reg->buffers, b->id);
  owner = b->owner_client ? gpupool__hmap_get(&reg->clients, b->owner_client) : NULL;
  if (owner) {
    owner->bytes -= b->size;
    owner->allocs--;
  }
  uid_account(reg, b->owner_uid, -(int64_t)b->size, -1);
  if (buffer_deps_clear(reg, b)) {
    finish_free(reg, b);
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
      finish_free(reg, b);
    } else {
      pp = &b->pending_next;
    }
  }
  for (int i = 0; i < reg->npools; i++) {
    gpupool__slab *s = reg->pools[i].slabs, *next;
    for (; s; s = next) {
      next = s->next;
      for (uint32_t j = 0; j < s->nmappers;) {
        if (s->mappers[j].corpse && s->mappers[j].corpse->exited) {
          corpse_unref(s->mappers[j].corpse);
          slab_remove_mapper_at(s, j);
        } else {
          j++;
        }
      }
      slab_try_release(reg, s);
    }
  }
  sweep_timer_update(reg);
}

uint64_t gpupool__pool_free_bytes(const gpupool__pool *p) {
  uint64_t f = p->cfg.capacity - p->reserved;
  for (gpupool__slab *s = p->slabs; s; s = s->next)
    if (s->alloc && !s->retiring)
      f += gpupool__alloc_capacity(s->alloc) - gpupool__alloc_used(s->alloc);
  return f;
}

static int no_space(gpupool__registry *reg, gpupool__pool *p, uint64_t asked, uint64_t rounded) {
  uint64_t largest = 0, in_slabs = 0, pending_bytes = 0;
  for (gpupool__slab *s = p->slabs; s; s = s->next)
    if (s->alloc && !s->retiring) {
      uint64_t l = gpupool__alloc_largest_free(s->alloc);
      if (l > largest)
        largest = l;
      in_slabs += gpupool__alloc_capacity(s->alloc) - gpupool__alloc_used(s->alloc);
    }
  for (gpupool__buffer *b = reg->pending; b; b = b->pending_next)
    if (b->slab->pool == p)
      pending_bytes += b->size;
  return gpupool__err(GPUPOOL_ENOSPC,
                      "pool '%s' is out of memory: asked for %" PRIu64 " bytes (%" PRIu64
                      " after alignment); free: %" PRIu64 " bytes inside slabs (largest contiguous %" PRIu64
                      ") and %" PRIu64 " bytes of unreserved capacity (of %" PRIu64
                      "); %" PRIu64 " bytes wait for holders' GPU work or exited processes before reuse. "
                      "Release buffers, pass a timeout to wait for memory, or raise the pool's capacity",
                      p->cfg.name, asked, rounded, in_slabs, largest, p->cfg.capacity - p->reserved,
                      p->cfg.capacity, pending_bytes);
}

/* Place `size` bytes (already aligned) in p. */
static int place(gpupool__registry *reg, gpupool__pool *p, uint64_t asked, uint64_t size, uint64_t align,
                 gpupool__slab **slab, uint64_t *off) {
  int rc, attempt;
  if (size > p->cfg.slab_size) {
    uint64_t dsize = round_up(size, SLAB_GRAIN);
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
      rc = slab_new(reg, p, dsize, 1, slab);
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
    return no_space(reg, p, asked, size);
  }
  for (attempt = 0; attempt < 2; attempt++) {
    for (gpupool__slab *s = p->slabs; s; s = s->next) {
      if (!s->alloc || s->retiring)
        continue;
      if (gpupool__alloc_get(s->alloc, size, align, off) == 0) {
        *slab = s;
        return 0;
      }
    }
    rc = slab_new(reg, p, p->cfg.slab_size, 0, slab);
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
  }
  return no_space(reg, p, asked, size);
}

/* ---- holds ----------------------------------------------------------------------------------- */

static int hold_new(gpupool__registry *reg, gpupool__client *c, gpupool__buffer *b, int read_only, int owner,
                    gpupool__hold **out) {
  gpupool__hold *h = calloc(1, sizeof *h);
  if (!h)
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  h->id = next_id(reg);
  h->buf = b;
  h->client = c;
  h->read_only = read_only;
  h->owner = owner;
  if (reg->be->ops->has_events) {
    h->done = event_get(reg);
    if (!h->done) {
      free(h);
      return gpupool__err(GPUPOOL_EBACKEND, "cannot create an inter-process event for the hold");
    }
  }
  if (gpupool__hmap_put(&reg->holds, h->id, h) != 0) {
    event_put(reg, h->done);
    free(h);
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  }
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
  if (grow((void **)&b->done, &b->capdone, b->ndone + 1, sizeof *b->done) != 0)
    return GPUPOOL_ENOMEM;
  b->done[b->ndone++] = e;
  return 0;
}

static void add_corpse_dep(gpupool__buffer *b, gpupool__corpse *c) {
  if (grow((void **)&b->corpses, &b->capcorpses, b->ncorpses + 1, sizeof *b->corpses) != 0)
    return; /* cannot track it: the range is reused without waiting (logged by grow) */
  c->refs++;
  b->corpses[b->ncorpses++] = c;
}

static void hold_drop(gpupool__registry *reg, gpupool__hold *h, int done_recorded, gpupool__corpse *corpse) {
  gpupool__client *c = h->client;
  gpupool__buffer *b = h->buf;
  if (h->prev)
    h->prev->next = h->next;
  else
    c->holds = h->next;
  if (h->next)
    h->next->prev = h->prev;
  c->nholds--;
  gpupool__hmap_del(&reg->holds, h->id);
  if (h->done) {
    if (done_recorded && add_done_dep(b, h->done) == 0)
      h->done = NULL;
    else
      event_put(reg, h->done);
  }
  if (corpse && !corpse->exited)
    add_corpse_dep(b, corpse);
  free(h);
  buffer_unref(reg, b);
}

static int hold_of(gpupool__registry *reg, gpupool__client *c, uint64_t id, gpupool__hold **out) {
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

static int check_limits(gpupool__registry *reg, gpupool__client *c, uint64_t size) {
  const gpupool__config *cfg = reg->cfg;
  gpupool__uid_usage *u = gpupool__hmap_get(&reg->uids, c->uid);
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
                        "uid %u already has %u live allocations, the limit (max_allocs_per_uid) is %u",
                        (unsigned)c->uid, u->allocs, cfg->max_allocs_per_uid);
  if (cfg->max_bytes_per_uid && (u ? u->bytes : 0) + size > cfg->max_bytes_per_uid)
    return gpupool__err(GPUPOOL_ELIMIT,
                        "allocating %" PRIu64 " bytes would bring uid %u to %" PRIu64
                        " bytes, over its limit (max_bytes_per_uid) of %" PRIu64 " bytes",
                        size, (unsigned)c->uid, (u ? u->bytes : 0) + size, cfg->max_bytes_per_uid);
  return 0;
}

int gpupool__allocate(gpupool__registry *reg, gpupool__client *c, gpupool__pool *p, uint64_t size, uint64_t align,
                gpupool__hold **out) {
  gpupool__buffer *b = NULL;
  gpupool__slab *s;
  uint64_t off, asize;
  int rc;

  if (size == 0)
    return gpupool__err(GPUPOOL_EINVAL, "cannot allocate 0 bytes; ask for at least 1");
  if (align == 0)
    align = p->cfg.alignment;
  if (align & (align - 1) || align > SLAB_GRAIN)
    return gpupool__err(GPUPOOL_EINVAL, "alignment %" PRIu64 " must be a power of two up to 2 MiB", align);
  if (align < p->cfg.alignment)
    align = p->cfg.alignment;
  if (size > GPUPOOL_SLAB_HARD_MAX)
    return place(reg, p, size, size, align, &s, &off); /* produces the ETOOBIG message */
  asize = round_up(size, p->cfg.alignment);
  if ((rc = check_limits(reg, c, asize)) != 0)
    return rc;
  if ((rc = place(reg, p, size, asize, align, &s, &off)) != 0)
    return rc;
  if (s->dedicated)
    asize = s->bs.size;
  b = calloc(1, sizeof *b);
  if (!b) {
    rc = gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
    goto fail_range;
  }
  b->id = next_id(reg);
  b->slab = s;
  b->offset = off;
  b->size = asize;
  b->asked = size;
  b->owner_uid = c->uid;
  b->owner_pid = c->pid;
  b->owner_client = c->id;
  b->created_ns = gpupool__now_ns();
  /* The share token's secret: from the kernel-seeded generator in libc, without a system
   * call per allocation. */
  arc4random_buf(b->secret, sizeof b->secret);
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
  uid_account(reg, c->uid, (int64_t)asize, 1);
  rc = hold_new(reg, c, b, 0, 1, out);
  if (rc != 0) {
    /* refs is 0: undo through the normal path so every counter goes back. */
    b->refs = 1;
    buffer_unref(reg, b);
    return rc;
  }
  return 0;
fail_ev:
  event_put(reg, b->ready);
fail_buf:
  free(b);
fail_range:
  if (s->alloc)
    gpupool__alloc_put(s->alloc, off, asize);
  slab_maybe_retire(reg, s);
  return rc;
}

int gpupool__release(gpupool__registry *reg, gpupool__client *c, uint64_t hold_id, int done_recorded, int *freed) {
  gpupool__hold *h = NULL;
  int rc = hold_of(reg, c, hold_id, &h);
  if (rc != 0)
    return rc;
  *freed = h->buf->refs == 1;
  hold_drop(reg, h, done_recorded, NULL);
  return 0;
}

int gpupool__share(gpupool__registry *reg, gpupool__client *c, uint64_t hold_id, uint8_t token[GPUPOOL_TOKEN_SIZE]) {
  gpupool__hold *h = NULL;
  int rc = hold_of(reg, c, hold_id, &h);
  if (rc != 0)
    return rc;
  for (int i = 0; i < 8; i++)
    token[i] = (uint8_t)(h->buf->id >> (8 * i));
  memcpy(token + 8, h->buf->secret, sizeof h->buf->secret);
  return 0;
}

int gpupool__open(gpupool__registry *reg, gpupool__client *c, const uint8_t *token, size_t len, int read_only,
            gpupool__hold **out) {
  uint64_t id = 0;
  gpupool__buffer *b;
  uint8_t diff = 0;
  if (len != GPUPOOL_TOKEN_SIZE)
    return gpupool__err(GPUPOOL_EINVAL, "share token has %zu bytes, expected %d", len, GPUPOOL_TOKEN_SIZE);
  for (int i = 0; i < 8; i++)
    id |= (uint64_t)token[i] << (8 * i);
  b = gpupool__hmap_get(&reg->buffers, id);
  if (b)
    for (size_t i = 0; i < sizeof b->secret; i++)
      diff |= (uint8_t)(b->secret[i] ^ token[8 + i]);
  if (!b || diff)
    return gpupool__err(GPUPOOL_ENOENT,
                        "share token does not name a live buffer (the buffer was freed, or the token is forged)");
  return hold_new(reg, c, b, read_only, 0, out);
}

int gpupool__check_name(const char *name) {
  size_t n = strlen(name);
  if (n == 0)
    return gpupool__err(GPUPOOL_ENAME, "empty name; names are 1 to %d bytes", GPUPOOL_NAME_MAX);
  if (n > GPUPOOL_NAME_MAX)
    return gpupool__err(GPUPOOL_ENAME, "name of %zu bytes is longer than the limit of %d", n,
                        GPUPOOL_NAME_MAX);
  for (size_t i = 0; i < n; i++)
    if ((unsigned char)name[i] < 0x20 || name[i] == 0x7f)
      return gpupool__err(GPUPOOL_ENAME, "name contains a control character at byte %zu", i);
  return 0;
}

static int name_visible(const gpupool__name *n, const gpupool__client *c) {
  return c->uid == 0 || n->uid == c->uid || n->share_all || (n->share_gid && n->share_gid == c->gid);
}

static int meta_from_wire(const Gpupool__Wire__TensorMeta *w, gpupool_tensor_meta *m) {
  memset(m, 0, sizeof *m);
  if (w->n_shape > GPUPOOL_MAX_NDIM)
    return gpupool__err(GPUPOOL_EMETA, "tensor has %zu dimensions; the limit is %d", w->n_shape,
                        GPUPOOL_MAX_NDIM);
  if (w->n_strides != 0 && w->n_strides != w->n_shape)
    return gpupool__err(GPUPOOL_EMETA, "tensor has %zu strides for %zu dimensions", w->n_strides,
                        w->n_shape);
  if (w->dtype_code > 255 || w->dtype_bits > 255 || w->dtype_lanes > 65535)
    return gpupool__err(GPUPOOL_EMETA, "dtype (code %u, bits %u, lanes %u) is out of DLPack's range",
                        w->dtype_code, w->dtype_bits, w->dtype_lanes);
  m->dtype_code = (uint8_t)w->dtype_code;
  m->dtype_bits = (uint8_t)w->dtype_bits;
  m->dtype_lanes = (uint16_t)w->dtype_lanes;
  m->ndim = (int32_t)w->n_shape;
  for (size_t i = 0; i < w->n_shape; i++)
    m->shape[i] = w->shape[i];
  m->strides_present = w->n_strides != 0;
  for (size_t i = 0; i < w->n_strides; i++)
    m->strides[i] = w->strides[i];
  m->byte_offset = w->byte_offset;
  return 0;
}

int gpupool__publish(gpupool__registry *reg, gpupool__client *c, uint64_t hold_id, const char *name,
               const Gpupool__Wire__TensorMeta *meta, gid_t share_gid, int share_all) {
  gpupool__hold *h = NULL;
  gpupool__name *n, *old;
  gpupool_tensor_meta m;
  int rc, has_meta = meta && meta->present;

  if ((rc = hold_of(reg, c, hold_id, &h)) != 0)
    return rc;
  if ((rc = gpupool__check_name(name)) != 0)
    return rc;
  if (has_meta) {
    uint64_t span;
    int err;
    if ((rc = meta_from_wire(meta, &m)) != 0)
      return rc;
    span = gpupool_tensor_span(&m, &err);
    if (err)
      return err;
    if (span > h->buf->asked)
      return gpupool__err(GPUPOOL_EMETA,
                          "tensor spans %" PRIu64 " bytes (offset included) but the buffer has %" PRIu64,
                          span, h->buf->asked);
  }
  old = gpupool__smap_get(&reg->names, name);
  if (old)
    return gpupool__err(GPUPOOL_EEXIST,
                        "name '%s' is already published%s; unpublish it first or pick another name", name,
                        name_visible(old, c) ? "" : " by another user");
  if (reg->cfg->max_names && reg->nnames >= reg->cfg->max_names)
    return gpupool__err(GPUPOOL_ELIMIT, "the daemon already holds %" PRIu64 " names, the limit (max_names) is %u",
                        reg->nnames, reg->cfg->max_names);
  n = calloc(1, sizeof *n);
  if (!n || !(n->name = strdup(name))) {
    free(n);
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  }
  n->buf = h->buf;
  n->uid = c->uid;
  n->share_gid = share_gid;
  n->share_all = share_all;
  n->created_ns = gpupool__now_ns();
  if (has_meta) {
    n->meta = m;
    n->has_meta = 1;
  }
  if (gpupool__smap_put(&reg->names, name, n) != 0) {
    free(n->name);
    free(n);
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  }
  if (has_meta) {
    h->buf->meta = m;
    h->buf->has_meta = 1;
  }
  h->buf->refs++;
  h->buf->names++;
  reg->nnames++;
  return 0;
}

/* The name as c may see it: ENAME for a malformed name, ENOENT when absent or invisible. */
static int find_name(gpupool__registry *reg, gpupool__client *c, const char *name, gpupool__name **out) {
  int rc = gpupool__check_name(name);
  if (rc != 0)
    return rc;
  *out = gpupool__smap_get(&reg->names, name);
  if (!*out || !name_visible(*out, c))
    return gpupool__err(GPUPOOL_ENOENT, "no buffer is published under '%s'", name);
  return 0;
}

int gpupool__get(gpupool__registry *reg, gpupool__client *c, const char *name, int read_only, gpupool__hold **out) {
  gpupool__name *n;
  int rc = find_name(reg, c, name, &n);
  return rc != 0 ? rc : hold_new(reg, c, n->buf, read_only, 0, out);
}

int gpupool__unpublish(gpupool__registry *reg, gpupool__client *c, const char *name) {
  gpupool__name *n;
  int rc = find_name(reg, c, name, &n);
  if (rc != 0)
    return rc;
  if (n->uid != c->uid && c->uid != 0)
    return gpupool__err(GPUPOOL_EPERM, "name '%s' was published by uid %u; only that uid or root may unpublish it",
                        name, (unsigned)n->uid);
  gpupool__smap_del(&reg->names, name);
  reg->nnames--;
  n->buf->names--;
  buffer_unref(reg, n->buf);
  free(n->name);
  free(n);
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
    if (!s)
      continue;
    for (uint32_t i = 0; i < s->nmappers; i++)
      if (s->mappers[i].client_id == c->id) {
        slab_remove_mapper_at(s, i);
        break;
      }
    slab_try_release(reg, s);
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
  c->id = next_id(reg);
  c->connected_ns = gpupool__now_ns();
  gpupool__hmap_init(&c->mapped);
  gpupool__hmap_put(&reg->clients, c->id, c);
}

void gpupool__client_drop(gpupool__registry *reg, gpupool__client *c) {
  gpupool__corpse *corpse = NULL;
  int had_holds = c->nholds > 0, pidfd = c->pidfd;

  c->pidfd = -1;
  if (had_holds) {
    corpse = corpse_new(reg, c->pid, pidfd);
    pidfd = -1;
    GPUPOOL__INFO("client %" PRIu64 " (pid %d, %s) went away holding %" PRIu64
            " buffers; their memory is reused once the process has exited",
            c->id, (int)c->pid, c->name, c->nholds);
  } else if (pidfd >= 0) {
    close(pidfd);
  }
  while (c->holds)
    hold_drop(reg, c->holds, 0, corpse);
  for (int i = 0; i < reg->npools; i++) {
    for (gpupool__slab *s = reg->pools[i].slabs, *n; s; s = n) {
      n = s->next;
      for (uint32_t j = 0; j < s->nmappers; j++) {
        if (s->mappers[j].client_id != c->id)
          continue;
        if (corpse && !corpse->exited) {
          s->mappers[j].client_id = 0;
          s->mappers[j].corpse = corpse;
          corpse->refs++;
        } else {
          slab_remove_mapper_at(s, j);
        }
        break;
      }
      slab_try_release(reg, s);
    }
  }
  gpupool__hmap_del(&reg->clients, c->id);
  gpupool__hmap_free(&c->mapped);
  free(c->revoke);
  c->revoke = NULL;
  c->nrevoke = c->caprevoke = 0;
  if (corpse)
    corpse_unref(corpse);
  gpupool__sweep(reg);
}

/* ---- descriptions ---------------------------------------------------------------------------- */

void gpupool__fill_pool_info(gpupool__registry *reg, gpupool__pool *p, Gpupool__Wire__PoolInfo *pi) {
  gpupool__bpool_stats st = {0};
  gpupool__wire__pool_info__init(pi);
  pi->id = p->id;
  pi->name = p->cfg.name;
  pi->backend = reg->be->desc->kind;
  pi->location = p->cfg.kind == GPUPOOL_MEM_HOST        ? GPUPOOL__WIRE__LOCATION_KIND__LOCATION_HOST
                 : p->cfg.kind == GPUPOOL_MEM_HOST_NUMA ? GPUPOOL__WIRE__LOCATION_KIND__LOCATION_HOST_NUMA
                                                        : GPUPOOL__WIRE__LOCATION_KIND__LOCATION_DEVICE;
  pi->device = p->cfg.kind == GPUPOOL_MEM_HOST ? -1 : p->cfg.device;
  pi->numa_node = p->cfg.kind == GPUPOOL_MEM_HOST_NUMA ? p->cfg.numa_node : -1;
  pi->capacity = p->cfg.capacity;
  pi->slab_size = p->cfg.slab_size;
  pi->max_alloc = p->cfg.capacity < GPUPOOL_SLAB_HARD_MAX ? p->cfg.capacity : GPUPOOL_SLAB_HARD_MAX;
  pi->used = p->used;
  pi->reserved = p->reserved;
  pi->used_high = p->used_high;
  pi->reserved_high = p->reserved_high;
  if (reg->be->ops->pool_stats(p->bp, &st) == 0) {
    pi->backend_reserved = st.reserved_cur;
    pi->backend_used = st.used_cur;
    pi->backend_reserved_high = st.reserved_high;
    pi->backend_used_high = st.used_high;
  }
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
  if (!gpupool__hmap_get(&c->mapped, sl->id)) {
    /* First buffer of this slab for this client: send how to map it, and remember. */
    s->slab.export_data.data = sl->bs.export_data;
    s->slab.export_data.len = sl->bs.export_len;
    if (gpupool__hmap_put(&c->mapped, sl->id, sl) == 0 && slab_add_mapper(sl, c->id) != 0)
      gpupool__hmap_del(&c->mapped, sl->id);
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
    const gpupool__name *nm = name && *name ? gpupool__smap_get(&reg->names, name) : NULL;
    const gpupool_tensor_meta *m = nm && nm->buf == b ? (nm->has_meta ? &nm->meta : NULL)
                                   : b->has_meta      ? &b->meta
                                                      : NULL;
    if (!m)
      return;
    gpupool__wire__tensor_meta__init(&s->meta);
    s->meta.present = 1;
    s->meta.dtype_code = m->dtype_code;
    s->meta.dtype_bits = m->dtype_bits;
    s->meta.dtype_lanes = m->dtype_lanes;
    for (int i = 0; i < m->ndim; i++) {
      s->shape[i] = m->shape[i];
      s->strides[i] = m->strides[i];
    }
    s->meta.n_shape = (size_t)m->ndim;
    s->meta.shape = s->shape;
    s->meta.n_strides = m->strides_present ? (size_t)m->ndim : 0;
    s->meta.strides = s->strides;
    s->meta.byte_offset = m->byte_offset;
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
  uv_timer_init(loop, &reg->sweep_timer);
  reg->sweep_timer.data = reg;
  reg->pools = calloc((size_t)cfg->n_pools, sizeof *reg->pools);
  if (!reg->pools)
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory");
  for (int i = 0; i < cfg->n_pools; i++) {
    gpupool__pool *p = &reg->pools[i];
    p->id = (uint32_t)i + 1;
    p->cfg = cfg->pools[i];
    rc = be->ops->pool_create(be, &p->cfg, &p->bp, &p->fd);
    if (rc != 0) {
      char msg[GPUPOOL__ERRMSG_MAX];
      snprintf(msg, sizeof msg, "%s", gpupool__errmsg());
      return gpupool__err(rc, "cannot create pool '%s': %s", p->cfg.name, msg);
    }
    reg->npools++;
    char where[64];
    if (p->cfg.kind == GPUPOOL_MEM_HOST)
      snprintf(where, sizeof where, "host memory (memfd)");
    else if (p->cfg.kind == GPUPOOL_MEM_HOST_NUMA)
      snprintf(where, sizeof where, "pinned host memory on NUMA node %d", p->cfg.numa_node);
    else
      snprintf(where, sizeof where, "device memory of GPU %d", p->cfg.device);
    GPUPOOL__INFO("pool '%s' ready: %s, capacity %" PRIu64 " MiB, slabs of %" PRIu64 " MiB, keeps %u empty slab(s)",
            p->cfg.name, where, p->cfg.capacity / MIB, p->cfg.slab_size / MIB, p->cfg.keep_slabs);
  }
  return 0;
}

void gpupool__registry_close(gpupool__registry *reg) {
  /* Every client is gone: drop names, then finish every pending free regardless of events
   * (the daemon is exiting; the backend's pools go with it). */
  for (size_t i = 0; i < reg->names.cap; i++) {
    if (!gpupool__smap_slot_used(&reg->names, i))
      continue;
    gpupool__name *n = reg->names.slots[i].val;
    n->buf->names--;
    buffer_unref(reg, n->buf);
    free(n->name);
    free(n);
  }
  gpupool__smap_free(&reg->names);
  while (reg->pending) {
    gpupool__buffer *b = reg->pending;
    reg->pending = b->pending_next;
    for (uint32_t i = 0; i < b->ndone; i++)
      event_put(reg, b->done[i]);
    for (uint32_t i = 0; i < b->ncorpses; i++)
      corpse_unref(b->corpses[i]);
    b->ndone = b->ncorpses = 0;
    finish_free(reg, b);
  }
  for (int i = 0; i < reg->npools; i++) {
    gpupool__pool *p = &reg->pools[i];
    /* slab_destroy lets go of the dead mappers' process watches (live mappers are gone). */
    while (p->slabs)
      slab_destroy(reg, p->slabs);
    reg->be->ops->pool_destroy(p->bp);
  }
  for (uint32_t i = 0; i < reg->nevents; i++) {
    reg->be->ops->event_destroy(reg->events[i]->be);
    free(reg->events[i]);
  }
  free(reg->events);
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
