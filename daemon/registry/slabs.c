/*
 * Backend pools per owner, slabs, placing a buffer in them and sweeping what is freed: a
 * buffer's range returns to its slab only in gpd_finish_free() and a slab to the backend
 * only in gpd_slab_destroy() (see registry.c for the rules), and the capacity of a
 * configured pool bounds its backend pools together.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "errors.h"
#include "list.h"
#include "log.h"
#include "registry_internal.h"
#include "state.h"

/* One backend pool per owner (see gpd_pinst): the backend's pool fd maps every
 * allocation in the pool. */
int gpd_per_owner(const gpd_registry *reg) { return reg->be->desc->pool_fd_maps_all; }

static gpd_pinst *inst_find(gpd_pool *p, uint64_t owner) {
  if (p->insts && p->insts->owner == GPUPOOL__OWNER_ANY)
    return p->insts;
  for (gpd_pinst *in = p->insts; in; in = in->next)
    if (in->owner == owner)
      return in;
  return NULL;
}

int gpd_inst_new(gpd_registry *reg, gpd_pool *p, uint64_t owner, gpd_pinst **out) {
  gpd_pinst *in = calloc(1, sizeof *in);
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
    gpd_tenant_label(reg->cfg, owner, label, sizeof label);
    GPUPOOL__DEBUG("pool %s: backend pool #%" PRIu64 " created for %s", p->cfg.name, in->serial, label);
  }
  *out = in;
  return 0;
}

void gpd_inst_destroy(gpd_registry *reg, gpd_pinst *in) {
  gpd_pool *p = in->pool;
  GPUPOOL__LIST_UNLINK(p->insts, in, prev, next);
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
void gpd_inst_maybe_destroy(gpd_registry *reg, gpd_pinst *in) {
  if (!in || in->owner == GPUPOOL__OWNER_ANY || in->nslabs || in->attached)
    return;
  GPUPOOL__DEBUG("pool %s: backend pool #%" PRIu64 " is idle; destroyed, %" PRIu64 " bytes return",
                 in->pool->cfg.name, in->serial, in->held);
  gpd_inst_destroy(reg, in);
}

/* Whether p's backend pool keeps what its slabs reserved until it is destroyed (CUDA's
 * stream-ordered pools; a survive=yes pool's slabs are allocations of their own). */
static int keeps_memory(const gpd_registry *reg, const gpd_pool *p) {
  return reg->be->desc->pool_keeps_memory && !p->cfg.survive;
}

void gpd_slab_destroy(gpd_registry *reg, gpd_slab *s) {
  gpd_pool *p = s->pool;
  gpd_pinst *in = s->inst;
  GPUPOOL__DEBUG("pool %s: slab %" PRIu64 " (%" PRIu64 " bytes) returned to the backend", p->cfg.name, s->id,
                 s->bs.size);
  if (s->daemon_map)
    munmap(s->daemon_map, (size_t)s->bs.size);
  if (reg->keep)
    reg->keep->slab_gone(reg, s);
  reg->be->ops->slab_free(in->bp, &s->bs);
  in->reserved -= s->bs.size;
  in->nslabs--;
  if (!keeps_memory(reg, p)) {
    in->held -= s->bs.size;
    p->held -= s->bs.size;
  }
  GPUPOOL__LIST_UNLINK(p->slabs, s, prev, next);
  gpupool__hmap_del(&reg->slabs, s->id);
  p->reserved -= s->bs.size;
  p->nslabs--;
  for (uint32_t i = 0; i < s->nmappers; i++)
    if (s->mappers[i].lease)
      gpd_lease_unref(s->mappers[i].lease);
  gpupool__alloc_delete(s->alloc);
  free(s->mappers);
  free(s);
  reg->memory_returned = 1;
  gpd_inst_maybe_destroy(reg, in);
}

int gpd_slab_daemon_map(gpd_slab *s, uint8_t **base) {
  void *m;
  if (!s->daemon_map) {
    if (!s->bs.fd_maps) /* device memory: staged (gpd_pr_stage_needed), never mapped here */
      return gpupool__err(GPUPOOL_EBACKEND, "slab %" PRIu64 " has no fd the daemon could map", s->id);
    m = mmap(NULL, (size_t)s->bs.size, PROT_READ | PROT_WRITE, MAP_SHARED, s->bs.fd, 0);
    if (m == MAP_FAILED)
      return gpupool__err(GPUPOOL_EBACKEND, "cannot map slab %" PRIu64 " (%" PRIu64 " bytes) in the daemon: %s",
                          s->id, s->bs.size, strerror(errno));
    s->daemon_map = m;
  }
  *base = s->daemon_map;
  return 0;
}

void gpd_slab_try_release(gpd_registry *reg, gpd_slab *s) {
  if (s->retiring && s->nbuffers == 0 && s->nmappers == 0)
    gpd_slab_destroy(reg, s);
}

static void client_add_revoke(gpd_client *c, uint64_t slab_id) {
  for (uint32_t i = 0; i < c->nrevoke; i++)
    if (c->revoke[i] == slab_id)
      return;
  if (gpd_grow((void **)&c->revoke, &c->caprevoke, c->nrevoke + 1, sizeof *c->revoke) == 0)
    c->revoke[c->nrevoke++] = slab_id;
}

/* Stop using s; ask its mappers to unmap; destroy it once nobody maps it. Returns 1 when
 * it was destroyed now. */
static int slab_retire(gpd_registry *reg, gpd_slab *s) {
  s->retiring = 1;
  for (uint32_t i = 0; i < s->nmappers; i++) {
    gpd_client *c;
    if (!s->mappers[i].client_id)
      continue;
    c = gpupool__hmap_get(&reg->clients, s->mappers[i].client_id);
    if (!c)
      continue;
    gpupool__hmap_del(&c->mapped, s->id);
    gpupool__hmap_del(&c->mapped_ro, s->id);
    client_add_revoke(c, s->id);
    if (reg->keep)
      reg->keep->client_changed(reg, c);
  }
  if (s->nbuffers == 0 && s->nmappers == 0) {
    gpd_slab_destroy(reg, s);
    return 1;
  }
  return 0;
}

/* An empty slab a placement may take back at once: a regular one, or a kept slab. */
static int slab_spare(const gpd_slab *s) {
  return !s->retiring && s->nbuffers == 0 && (!s->dedicated || s->kept);
}

void gpd_slab_maybe_retire(gpd_registry *reg, gpd_slab *s) {
  uint32_t empty = 0;
  if (s->nbuffers != 0 || s->retiring)
    return;
  if (s->dedicated) {
    /* A kept slab (a replica's or a fetched copy's) waits for the next version's of its owner
     * and size, up to GPD_REPLICA_SLABS_KEPT of them in a pool (a client allocation's, up to
     * the pool's keep_dedicated); a placement that needs the room takes it back (gpd_place),
     * as does gpupoolctl trim. */
    if (s->kept && !reg->stopped) {
      for (gpd_slab *o = s->pool->slabs; o; o = o->next)
        if (o->kept && slab_spare(o))
          empty++;
      if (empty <= (s->kept == GPD_PLACE_ALLOC ? s->pool->cfg.keep_dedicated : GPD_REPLICA_SLABS_KEPT))
        return;
    }
    slab_retire(reg, s);
    return;
  }
  for (gpd_slab *o = s->pool->slabs; o; o = o->next)
    if (!o->dedicated && !o->retiring && o->nbuffers == 0)
      empty++;
  if (empty > s->pool->cfg.keep_slabs)
    slab_retire(reg, s);
}

/* What instance in would keep from the system with `size` more bytes of slabs. */
static uint64_t held_with(const gpd_registry *reg, const gpd_pool *p, const gpd_pinst *in, uint64_t size) {
  uint64_t held = in ? in->held : 0, after = (in ? in->reserved : 0) + size;
  return keeps_memory(reg, p) && held > after ? held : after;
}

/* filled: bytes from the start of the slab that the caller overwrites before any client is
 * told of it (the backend need not clear them). */
static int slab_make(gpd_registry *reg, gpd_pool *p, uint64_t size, int dedicated, uint64_t filled, uint64_t owner,
                     uint64_t id, int adopt_fd, gpd_slab **out);
static int slab_new(gpd_registry *reg, gpd_pool *p, uint64_t size, int dedicated, uint64_t filled, uint64_t owner,
                    gpd_slab **out) {
  return slab_make(reg, p, size, dedicated, filled, owner, 0, -1, out);
}

int gpd_slab_adopt(gpd_registry *reg, gpd_pool *p, uint64_t id, int fd, uint64_t size, int dedicated,
                   uint64_t owner, gpd_slab **out) {
  int rc;
  if (!reg->be->ops->slab_adopt)
    rc = gpupool__err(GPUPOOL_EBACKEND, "the %s backend cannot take over a slab", reg->be->desc->name);
  else if (!dedicated && size != p->cfg.slab_size)
    rc = gpupool__err(GPUPOOL_EINVAL, "a regular slab of %" PRIu64 " bytes, but the pool's slab_size is now %"
                      PRIu64 " bytes", size, p->cfg.slab_size);
  else
    return slab_make(reg, p, size, dedicated, 0, owner, id, fd, out); /* (takes fd in every case) */
  close(fd);
  return rc;
}

/* adopt_fd >= 0: the slab is a previous daemon's (gpd_slab_adopt), with that id; adopt_fd is
 * taken in every case (the backend's once it adopted it, closed here before that). */
static int slab_make(gpd_registry *reg, gpd_pool *p, uint64_t size, int dedicated, uint64_t filled, uint64_t owner,
                     uint64_t id, int adopt_fd, gpd_slab **out) {
  gpd_pinst *in = inst_find(p, owner);
  gpd_slab *s;
  uint64_t held;
  int rc;

  /* The capacity bounds what every owner's backend pool keeps, together. */
  if (p->held - (in ? in->held : 0) + held_with(reg, p, in, size) > p->cfg.capacity) {
    if (adopt_fd >= 0)
      close(adopt_fd);
    return GPUPOOL_ENOSPC;
  }
  if (!in && (rc = gpd_inst_new(reg, p, owner, &in)) != 0) {
    if (adopt_fd >= 0)
      close(adopt_fd);
    return rc;
  }
  s = calloc(1, sizeof *s);
  if (!s) {
    rc = gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
    if (adopt_fd >= 0)
      close(adopt_fd);
    goto fail;
  }
  rc = adopt_fd >= 0 ? reg->be->ops->slab_adopt(in->bp, adopt_fd, size, &s->bs)
                     : reg->be->ops->slab_alloc(in->bp, size, filled, &s->bs);
  if (rc != 0) {
    if (adopt_fd >= 0)
      close(adopt_fd); /* (the backend takes it on success only) */
    goto fail;
  }
  if (!dedicated) {
    rc = gpupool__alloc_new(s->bs.size, &s->alloc);
    if (rc != 0) {
      reg->be->ops->slab_free(in->bp, &s->bs);
      goto fail;
    }
  }
  s->id = id ? id : gpd_next_id(reg);
  s->pool = p;
  s->inst = in;
  s->dedicated = dedicated;
  s->owner = owner;
  if ((rc = gpupool__hmap_put(&reg->slabs, s->id, s)) != 0) {
    gpupool__alloc_delete(s->alloc);
    reg->be->ops->slab_free(in->bp, &s->bs);
    goto fail;
  }
  held = held_with(reg, p, in, s->bs.size);
  if (keeps_memory(reg, p)) {
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
  s->stored = adopt_fd >= 0; /* (a kept slab is in the store already) */
  if (reg->keep)
    reg->keep->slab_new(reg, s);
  *out = s;
  return 0;
fail:
  free(s);
  gpd_inst_maybe_destroy(reg, in);
  return rc;
}

int gpd_slab_add_mapper(gpd_slab *s, uint64_t client_id) {
  if (gpd_grow((void **)&s->mappers, &s->capmappers, s->nmappers + 1, sizeof *s->mappers) != 0)
    return GPUPOOL_ENOMEM;
  s->mappers[s->nmappers].client_id = client_id;
  s->mappers[s->nmappers].lease = NULL;
  s->nmappers++;
  return 0;
}

void gpd_slab_remove_mapper_at(gpd_slab *s, uint32_t i) {
  s->mappers[i] = s->mappers[--s->nmappers];
}

int gpd_buffer_deps_clear(gpd_registry *reg, gpd_buffer *b) {
  while (b->ndone > 0) {
    gpd_event *e = b->done[b->ndone - 1];
    int q = reg->be->ops->event_query(e->be);
    if (q == 0)
      return 0;
    if (q < 0)
      GPUPOOL__WARN("event %u query failed (%s); treating it as complete", e->id, gpupool__errmsg());
    gpd_event_put(reg, e);
    b->ndone--;
  }
  while (b->nleases > 0) {
    gpd_lease *l = b->leases[b->nleases - 1];
    if (!l->gone)
      return 0;
    gpd_lease_unref(l);
    b->nleases--;
  }
  return 1;
}

void gpd_finish_free(gpd_registry *reg, gpd_buffer *b) {
  gpd_slab *s = b->slab;
  gpd_pool *p = s->pool;
  if (b->died_in_use && s->alloc) {
    /* Work the dead holder queued may still touch this range until its GPU context is torn
     * down, which the daemon cannot see: never reuse it inside this slab. */
    if (!s->retiring)
      GPUPOOL__INFO("pool %s: slab %" PRIu64 " takes no new buffers and goes back to the backend once empty: "
                    "buffer %" PRIu64 " in it was held by a client that went away without saying its GPU work on "
                    "it was done",
                    p->cfg.name, s->id, b->id);
    s->retiring = 1;
  } else if (b->died_in_use && s->kept) {
    s->retiring = 1; /* never kept for the next replica either */
  } else if (s->alloc && gpupool__alloc_put(s->alloc, b->offset, b->size) != 0) {
    GPUPOOL__ERROR("pool %s: range %" PRIu64 "+%" PRIu64 " of slab %" PRIu64 " refused by the allocator",
             p->cfg.name, b->offset, b->size, s->id);
  }
  s->nbuffers--;
  p->used -= b->size;
  p->nbuffers--;
  gpd_event_put(reg, b->ready);
  gpd_layout_unref(reg, b->layout);
  /* Only now is the range really back: until here it stays on its owner's account. */
  gpd_uid_account(reg, b->owner_tenant, -(int64_t)b->size, -1);
  if (reg->keep)
    reg->keep->buffer_gone(reg, b->id);
  free(b->done);
  free(b->leases);
  free(b);
  reg->memory_returned = 1;
  if (s->retiring && s->nbuffers == 0 && !reg->stopped)
    slab_retire(reg, s);
  else
    gpd_slab_maybe_retire(reg, s);
}

static void sweep_timer_cb(uv_timer_t *t) {
  gpd_registry *reg = t->data;
  uint64_t t0 = gpd_now_ns(), n = reg->npending;
  gpd_sweep(reg);
  if (gpd_now_ns() - t0 > 50000)
    GPUPOOL__DEBUG("slow sweep: %" PRIu64 " us over %" PRIu64 " pending buffers", (gpd_now_ns() - t0) / 1000, n);
  if (reg->memory_returned && reg->on_memory)
    reg->on_memory(reg, NULL);
}

static void sweep_timer_update(gpd_registry *reg) {
  int need = 0;
  if (reg->stopped)
    return;
  for (gpd_buffer *b = reg->pending; b; b = b->pending_next)
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

void gpd_buffer_unref(gpd_registry *reg, gpd_buffer *b) {
  gpd_client *owner;
  if (--b->refs > 0)
    return;
  gpd_buffer_replaced(reg, b);
  gpupool__hmap_del(&reg->buffers, b->id);
  owner = b->owner_client ? gpupool__hmap_get(&reg->clients, b->owner_client) : NULL;
  if (owner) {
    owner->bytes -= b->size;
    owner->allocs--;
  }
  if (gpd_buffer_deps_clear(reg, b)) {
    gpd_finish_free(reg, b);
    return;
  }
  b->pending_next = reg->pending;
  reg->pending = b;
  reg->npending++;
  sweep_timer_update(reg);
}

void gpd_sweep(gpd_registry *reg) {
  gpd_buffer **pp = &reg->pending;
  while (*pp) {
    gpd_buffer *b = *pp;
    if (gpd_buffer_deps_clear(reg, b)) {
      *pp = b->pending_next;
      reg->npending--;
      gpd_finish_free(reg, b);
    } else {
      pp = &b->pending_next;
    }
  }
  for (int i = 0; i < reg->npools; i++) {
    gpd_slab *s = reg->pools[i].slabs, *next;
    for (; s; s = next) {
      next = s->next;
      for (uint32_t j = 0; j < s->nmappers;) {
        if (s->mappers[j].lease && s->mappers[j].lease->gone) {
          gpd_lease_unref(s->mappers[j].lease);
          gpd_slab_remove_mapper_at(s, j);
        } else {
          j++;
        }
      }
      gpd_slab_try_release(reg, s);
    }
  }
  sweep_timer_update(reg);
}

/* Capacity no backend pool keeps (the backend may have reserved past it: never below 0). */
static uint64_t unheld(const gpd_pool *p) { return p->held < p->cfg.capacity ? p->cfg.capacity - p->held : 0; }

uint64_t gpd_pool_free_bytes(const gpd_pool *p) {
  /* Unheld capacity, what owners' backend pools keep beyond their slabs (usable by that owner
   * only: an over-estimate for any one request, which is what a pre-check needs), and the
   * holes in slabs. */
  uint64_t f = unheld(p);
  for (const gpd_pinst *in = p->insts; in; in = in->next)
    f += in->held - in->reserved;
  for (gpd_slab *s = p->slabs; s; s = s->next)
    if (s->alloc && !s->retiring)
      f += gpupool__alloc_capacity(s->alloc) - gpupool__alloc_used(s->alloc);
    else if (s->kept && slab_spare(s))
      f += s->bs.size; /* a kept slab, taken back when a placement needs its room */
  return f;
}

static int no_space(gpd_registry *reg, gpd_pool *p, uint64_t owner, uint64_t asked, uint64_t rounded) {
  const gpd_pinst *in = inst_find(p, owner);
  uint64_t largest = 0, in_slabs = 0, pending_bytes = 0, most;
  /* What a new slab of this owner could take: capacity no backend pool keeps, plus what this
   * owner's own backend pool keeps beyond its slabs. */
  uint64_t unreserved = unheld(p) + (in ? in->held - in->reserved : 0);
  for (gpd_slab *s = p->slabs; s; s = s->next)
    if (s->alloc && !s->retiring && s->owner == owner) {
      uint64_t l = gpupool__alloc_largest_free(s->alloc);
      if (l > largest)
        largest = l;
      in_slabs += gpupool__alloc_capacity(s->alloc) - gpupool__alloc_used(s->alloc);
    }
  for (gpd_buffer *b = reg->pending; b; b = b->pending_next)
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
                      gpd_per_owner(reg) ? "; other tenants' backend pools keep what they reserved until they are idle"
                                     : "");
}

/* Place `size` bytes (already aligned) in p. */
/* Place a buffer for owner (a tenant, or the group a shared pool belongs to): in a slab of
 * that owner only (every holder of a buffer receives its slab's fd, so slabs are never shared
 * between tenants), or in a new one. */
int gpd_place(gpd_registry *reg, gpd_pool *p, uint64_t owner, uint64_t asked, uint64_t size,
                   uint64_t align, int place, gpd_slab **slab, uint64_t *off) {
  int rc, attempt;
  if (size > p->cfg.slab_size || (place == GPD_PLACE_FETCHED && size >= GPD_COPY_DEDICATED_MIN)) {
    uint64_t dsize = gpd_round_up(size, SLAB_GRAIN);
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
    /* A replica (or a fetched copy) takes a kept slab of its owner and size when there is
     * one: the previous version's on this device, freed (no holder left, every done event
     * complete), and still mapped by the clients that held it. Nothing to allocate, clear,
     * export or import: the copy overwrites what the buffer uses, and the rest held only
     * this owner's bytes. In a pool with keep_dedicated, a client's own allocation does the
     * same: it gets bytes only its owner wrote, as a range reused in a regular slab does. */
    if (place || p->cfg.keep_dedicated)
      for (gpd_slab *s = p->slabs; s; s = s->next)
        if (s->kept && !s->frozen && slab_spare(s) && s->owner == owner && s->bs.size == dsize) {
          GPUPOOL__DEBUG("pool %s: kept slab %" PRIu64 " of %" PRIu64 " bytes reused", p->cfg.name, s->id,
                         s->bs.size);
          *slab = s;
          *off = 0;
          return 0;
        }
    for (attempt = 0; attempt < 2; attempt++) {
      rc = slab_new(reg, p, dsize, 1, place ? asked : 0, owner, slab);
      if (rc == 0) {
        (*slab)->kept = place ? place : p->cfg.keep_dedicated ? GPD_PLACE_ALLOC : 0;
        *off = 0;
        return 0;
      }
      if (rc != GPUPOOL_ENOSPC)
        return rc;
      /* Make room: finish what can be finished and give back empty cached slabs. */
      gpd_sweep(reg);
      for (gpd_slab *s = p->slabs, *n; s; s = n) {
        n = s->next;
        if (slab_spare(s))
          slab_retire(reg, s);
      }
    }
    return no_space(reg, p, owner, asked, size);
  }
  for (attempt = 0; attempt < 2; attempt++) {
    for (gpd_slab *s = p->slabs; s; s = s->next) {
      if (!s->alloc || s->retiring || s->frozen || s->owner != owner)
        continue;
      if (gpupool__alloc_get(s->alloc, size, align, off) == 0) {
        *slab = s;
        return 0;
      }
    }
    rc = slab_new(reg, p, p->cfg.slab_size, 0, 0, owner, slab);
    if (rc == 0) {
      if (gpupool__alloc_get((*slab)->alloc, size, align, off) == 0)
        return 0;
      /* Cannot happen: a fresh slab fits anything up to slab_size. */
      return gpupool__err(GPUPOOL_EBACKEND, "internal error: fresh slab refused %" PRIu64 " bytes", size);
    }
    if (rc != GPUPOOL_ENOSPC)
      return rc;
    if (attempt == 0)
      gpd_sweep(reg);
    /* Other owners' empty cached slabs keep their backend pools (and what those reserved)
     * alive: give them back, so an idle backend pool goes and its memory returns. Kept
     * slabs (of any owner: this request fits none of them) go as well. */
    if (attempt == 0)
      for (gpd_slab *s = p->slabs, *n; s; s = n) {
        n = s->next;
        if (slab_spare(s) && (s->kept || (gpd_per_owner(reg) && s->owner != owner)))
          slab_retire(reg, s);
      }
  }
  return no_space(reg, p, owner, asked, size);
}

gpd_pool *gpd_pool_find(gpd_registry *reg, const char *name, uint32_t id) {
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

int gpd_attach(gpd_registry *reg, gpd_client *c, gpd_pool *p, int *fd) {
  gpd_pinst *in;
  uint64_t owner;
  int rc;
  *fd = -1;
  if ((rc = gpd_pool_owner(reg, c, p, &owner)) != 0)
    return rc;
  if (!gpd_per_owner(reg)) {
    *fd = p->insts->fd;
    return 0;
  }
  in = gpupool__hmap_get(&c->attached, p->id);
  if (!in) {
    if (!(in = inst_find(p, owner)) && (rc = gpd_inst_new(reg, p, owner, &in)) != 0)
      return rc;
    if (gpupool__hmap_put(&c->attached, p->id, in) != 0) {
      gpd_inst_maybe_destroy(reg, in);
      return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
    }
    in->attached++;
  }
  /* Cannot differ (see gpd_pool_owner): a client keeps the pool it imported for its connection. */
  if (in->owner != owner)
    return gpupool__err(GPUPOOL_EBACKEND, "internal error: pool '%s' changed owner for client %" PRIu64,
                        p->cfg.name, c->id);
  *fd = in->fd;
  return 0;
}

void gpd_unmapped(gpd_registry *reg, gpd_client *c, const uint64_t *ids, size_t n) {
  for (size_t k = 0; k < n; k++) {
    gpd_slab *s = gpupool__hmap_get(&reg->slabs, ids[k]);
    for (uint32_t i = 0; i < c->nrevoke; i++)
      if (c->revoke[i] == ids[k]) {
        c->revoke[i] = c->revoke[--c->nrevoke];
        break;
      }
    gpupool__hmap_del(&c->mapped, ids[k]);
    gpupool__hmap_del(&c->mapped_ro, ids[k]);
    if (reg->keep)
      reg->keep->client_changed(reg, c);
    if (!s)
      continue;
    for (uint32_t i = 0; i < s->nmappers; i++)
      if (s->mappers[i].client_id == c->id) {
        gpd_slab_remove_mapper_at(s, i);
        break;
      }
    gpd_slab_try_release(reg, s);
  }
}

void gpd_trim(gpd_registry *reg, uint32_t *freed, uint32_t *revoked) {
  *freed = *revoked = 0;
  gpd_sweep(reg);
  for (int i = 0; i < reg->npools; i++) {
    for (gpd_slab *s = reg->pools[i].slabs, *n; s; s = n) {
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

int gpd_pool_device(const gpd_registry *reg, const gpd_pool *p) {
  if (p->cfg.kind == GPUPOOL_MEM_DEVICE)
    return p->cfg.device;
  /* memfd memory standing for a GPU: for testing replica logic without GPUs */
  if (p->cfg.kind == GPUPOOL_MEM_HOST && reg->be->desc == &gpupool__backend_host && p->cfg.device >= 0)
    return p->cfg.device;
  return -1;
}
