/*
 * The daemon's registry: pools, slabs, buffers, holds, names, events and the leases of
 * closed connections. See registry.h for who owns what. The rules that keep memory safe:
 *   - a buffer's range returns to its slab only in gpd_finish_free() (slabs.c), reached
 *     once refs == 0 and every dependency (recorded done events, leases of holders whose
 *     connection closed) has cleared;
 *   - a slab returns to the backend only in gpd_slab_destroy() (slabs.c), reached once
 *     it is empty, retiring, and neither a connected client nor a held lease still maps it;
 *   - once the daemon stops (gpd_registry_stop) nothing is reused any more.
 * Everything runs on the daemon's single loop thread.
 *
 * This file: the registry's lifetime, its clients (a connection's state, and what its going
 * away drops) and the descriptions sent to them. The other rooms are listed in
 * registry_internal.h.
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
#include "state.h"

/* ---- clients --------------------------------------------------------------------------------- */

void gpd_client_init(gpd_registry *reg, gpd_client *c) {
  c->id = gpd_next_id(reg);
  c->tenant = gpd_tenant_of(reg->cfg, c->uid, c->gid);
  c->connected_ns = gpd_now_ns();
  gpupool__hmap_init(&c->mapped);
  gpupool__hmap_init(&c->mapped_ro);
  gpupool__hmap_init(&c->attached);
  gpupool__hmap_put(&reg->clients, c->id, c);
}

void gpd_client_drop(gpd_registry *reg, gpd_client *c) {
  gpd_lease *lease = c->lease;
  int waiting = 0;

  c->lease = NULL;
  gpd_reserve_drop(reg, c);
  gpd_parts_client_gone(reg, c);
  if (lease) {
    lease->client_id = c->id;
    if (c->nholds > 0 || c->mapped.len > 0)
      waiting = gpd_lease_wait(reg, lease);
    if (waiting)
      GPUPOOL__PEER_INFO(&c->log_rl, c->id, "client %" PRIu64 " (pid %d uid %u, %s) closed its connection holding %" PRIu64
                    " buffer(s) and mapping %zu slab(s) while a process still holds its lease; that memory is "
                    "reused once every such process has exited or closed the lease",
                    c->id, (int)c->pid, (unsigned)c->uid, c->name, c->nholds, c->mapped.len);
    if (reg->keep)
      reg->keep->client_gone(reg, c, lease, waiting);
  }
  while (c->holds)
    gpd_hold_drop(reg, c->holds, 0, waiting ? lease : NULL);
  gpd_client_events_drop(reg, c);
  for (int i = 0; i < reg->npools; i++) {
    for (gpd_slab *s = reg->pools[i].slabs, *n; s; s = n) {
      n = s->next;
      for (uint32_t j = 0; j < s->nmappers; j++) {
        if (s->mappers[j].client_id != c->id)
          continue;
        if (waiting) {
          s->mappers[j].client_id = 0;
          s->mappers[j].lease = lease;
          lease->refs++;
        } else {
          gpd_slab_remove_mapper_at(s, j);
        }
        break;
      }
      gpd_slab_try_release(reg, s);
    }
  }
  gpupool__hmap_del(&reg->clients, c->id);
  /* Its backend pools may go now: a process that still maps slabs of them keeps those slabs
   * (and so the pools) through its lease; one that only imported a pool holds nothing the
   * daemon could give to someone else (a destroyed pool is never handed out again). */
  for (size_t i = 0; i < c->attached.cap; i++)
    if (gpupool__hmap_slot_used(&c->attached, i)) {
      gpd_pinst *in = c->attached.slots[i].val;
      in->attached--;
      gpd_inst_maybe_destroy(reg, in);
    }
  gpupool__hmap_free(&c->attached);
  gpupool__hmap_free(&c->mapped);
  gpupool__hmap_free(&c->mapped_ro);
  free(c->revoke);
  c->revoke = NULL;
  c->nrevoke = c->caprevoke = 0;
  if (lease)
    gpd_lease_unref(lease);
  gpd_sweep(reg);
}

/* ---- descriptions ---------------------------------------------------------------------------- */

void gpd_fill_pool_info(gpd_registry *reg, gpd_pool *p, Gpupool__Wire__PoolInfo *pi) {
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
  for (gpd_pinst *in = p->insts; in; in = in->next) {
    if (reg->be->ops->pool_stats(in->bp, &st) != 0)
      continue;
    pi->backend_reserved += st.reserved_cur;
    pi->backend_used += st.used_cur;
    if (!gpd_per_owner(reg)) {
      pi->backend_reserved_high = st.reserved_high;
      pi->backend_used_high = st.used_high;
    }
  }
  if (gpd_per_owner(reg)) {
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
  if (p->cfg.kind == GPUPOOL_MEM_HOST && gpd_pool_device(reg, p) >= 0)
    pi->simulated_device = (uint32_t)gpd_pool_device(reg, p) + 1;
  pi->buffers = p->nbuffers;
  pi->slabs = p->nslabs;
}

/* r names event e for the wire (id and IPC handle, which r points to, not copies); returns r. */
static Gpupool__Wire__EventRef *event_ref(Gpupool__Wire__EventRef *r, gpd_event *e) {
  gpupool__wire__event_ref__init(r);
  r->id = e->id;
  r->ipc_handle.data = e->handle;
  r->ipc_handle.len = GPUPOOL_EVENT_HANDLE_SIZE;
  return r;
}

void gpd_fill_desc(gpd_registry *reg, gpd_client *c, gpd_hold *h, const gpd_rname *rn, gpd_desc_storage *s) {
  gpd_buffer *b = h->buf;
  gpd_slab *sl = b->slab;

  gpupool__wire__buffer_desc__init(&s->desc);
  gpupool__wire__slab_ref__init(&s->slab);
  s->desc.buffer_id = b->id;
  s->desc.hold_id = h->id;
  s->desc.pool_id = sl->pool->id;
  s->desc.offset = b->offset;
  s->desc.size = b->asked;
  s->desc.read_only = h->read_only;
  s->desc.ready_group = h->ready_group;
  s->desc.name = (char *)(rn ? rn->name : "");
  s->slab.id = sl->id;
  s->slab.pool_id = sl->pool->id;
  s->slab.size = sl->bs.size;
  /* A kept slab (a replica's or a fetched copy's) stays mapped by its clients when empty, as a
   * regular slab does: the next version's on this device goes in it (gpd_place), with nothing
   * to import. */
  s->slab.dedicated = sl->dedicated && !sl->kept;
  s->fd = -1;
  {
    int mapped = gpupool__hmap_get(&c->mapped, sl->id) != NULL;
    int send = gpd_desc_sends_slab(c, sl, h->read_only);
    int remembered = mapped;
    if (!mapped) {
      /* Remember the mapping first: a slab handed out unrecorded could be freed under it. */
      remembered = gpupool__hmap_put(&c->mapped, sl->id, sl) == 0;
      if (remembered && gpd_slab_add_mapper(sl, c->id) != 0) {
        gpupool__hmap_del(&c->mapped, sl->id);
        remembered = 0;
      }
      if (remembered && reg->keep)
        reg->keep->client_changed(reg, c);
    }
    if (remembered && send) {
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
  if (b->ready)
    s->desc.ready = event_ref(&s->ready, b->ready);
  if (h->done)
    s->desc.done = event_ref(&s->done, h->done);
  {
    const gpd_name *nm = rn && rn->rc == 0 ? gpupool__smap_get(&reg->names, rn->key) : NULL;
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

int gpd_registry_init(gpd_registry *reg, uv_loop_t *loop, const gpd_config *cfg,
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
  gpd_keeps_init(reg);
  reg->pools = calloc((size_t)cfg->n_pools, sizeof *reg->pools);
  if (!reg->pools)
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory");
  for (int i = 0; i < cfg->n_pools; i++) {
    gpd_pool *p = &reg->pools[i];
    gpd_pinst *in = NULL;
    p->id = (uint32_t)i + 1;
    p->cfg = cfg->pools[i];
    /* One backend pool for every owner, or (per-owner backends) one made and destroyed now
     * so that a pool the backend refuses is refused at startup, not at first use. */
    if ((rc = gpd_inst_new(reg, p, GPUPOOL__OWNER_ANY, &in)) != 0)
      return rc; /* the message names the pool */
    if (gpd_per_owner(reg)) {
      gpd_inst_destroy(reg, in);
      p->insts_created = 0;
    }
    reg->npools++;
    char where[128];
    if (p->cfg.kind == GPUPOOL_MEM_HOST && gpd_pool_device(reg, p) >= 0)
      snprintf(where, sizeof where, "SIMULATED device memory of GPU %d (memfd standing for it, to test "
               "replicas without GPUs)", p->cfg.device);
    else if (p->cfg.kind == GPUPOOL_MEM_HOST)
      snprintf(where, sizeof where, "host memory (memfd)");
    else if (p->cfg.kind == GPUPOOL_MEM_HOST_NUMA)
      snprintf(where, sizeof where, "pinned host memory on NUMA node %d", p->cfg.numa_node);
    else
      snprintf(where, sizeof where, "device memory of GPU %d", p->cfg.device);
    GPUPOOL__INFO("pool '%s' ready: %s, capacity %" PRIu64 " MiB, slabs of %" PRIu64 " MiB, keeps %u empty slab(s)%s",
            p->cfg.name, where, p->cfg.capacity / MIB, p->cfg.slab_size / MIB, p->cfg.keep_slabs,
            gpd_per_owner(reg) ? "; one backend pool per tenant (or shared group), made on first use" : "");
  }
  return 0;
}

void gpd_registry_stop(gpd_registry *reg) {
  uint64_t bytes = 0, nbuf = 0, on_leases = 0, mapped_slabs = 0;
  if (reg->stopped)
    return;
  reg->stopped = 1;
  for (gpd_buffer *b = reg->pending; b; b = b->pending_next) {
    nbuf++;
    bytes += b->size;
    if (b->nleases)
      on_leases++;
  }
  for (int i = 0; i < reg->npools; i++)
    for (gpd_slab *s = reg->pools[i].slabs; s; s = s->next)
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
  for (gpd_lease *l = reg->waiting; l; l = l->next)
    if (l->polling)
      uv_poll_stop(&l->poll);
  if (reg->ext && reg->ext->stop)
    reg->ext->stop(reg);
  if (reg->sweep_timer_on) {
    uv_timer_stop(&reg->sweep_timer);
    reg->sweep_timer_on = 0;
  }
  gpd_keeps_stop(reg);
}

void gpd_registry_close(gpd_registry *reg) {
  gpd_state_stop(reg); /* what is freed below stays in the fd store, for the next daemon */
  /* Every client is gone: stop the copies (they hold their sources), drop kept shares (they
   * are references like names), drop names, then finish every pending free regardless of
   * events (the daemon is exiting; the backend's pools go with it). */
  if (reg->ext && reg->ext->close)
    reg->ext->close(reg);
  gpd_keeps_close(reg);
  gpd_parts_close(reg);
  for (size_t i = 0; i < reg->names.cap; i++) {
    if (!gpupool__smap_slot_used(&reg->names, i))
      continue;
    gpd_name_free(reg, reg->names.slots[i].val);
  }
  gpupool__smap_free(&reg->names);
  while (reg->pending) {
    gpd_buffer *b = reg->pending;
    reg->pending = b->pending_next;
    for (uint32_t i = 0; i < b->ndone; i++)
      gpd_event_put(reg, b->done[i]);
    for (uint32_t i = 0; i < b->nleases; i++)
      gpd_lease_unref(b->leases[i]);
    b->ndone = b->nleases = 0;
    gpd_finish_free(reg, b);
  }
  for (int i = 0; i < reg->npools; i++) {
    gpd_pool *p = &reg->pools[i];
    /* Slabs that live processes still map are given back too: what the daemon lets go of is
     * its own reference (a host slab's memfd, a CUDA allocation), and the processes' own
     * mappings keep the memory for as long as they need it. */
    while (p->slabs)
      gpd_slab_destroy(reg, p->slabs);
    while (p->insts)
      gpd_inst_destroy(reg, p->insts);
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
      gpd_layout *l = reg->layouts.slots[i].val;
      gpd_members_free(l->members, l->n);
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
