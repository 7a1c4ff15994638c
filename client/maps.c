/*
 * libgpupool-client, maps.c: What this process maps of the daemon's memory: imported pools, mapped
 * slabs (refcounted by buffers), opened events, slab revocations, and turning a reply's BufferDesc
 * into a buffer (materialize), and what is left of a connection that went away (stale generations,
 * released with their last mapping). See internal.h for how the client is put together.
 */
#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <grp.h>
#include <pwd.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

static void note_unmapped(gpupool_client *c, uint64_t id) {
  if (c->nunmapped == c->capunmapped) {
    size_t ncap = c->capunmapped ? c->capunmapped * 2 : 8;
    uint64_t *n = realloc(c->unmapped, ncap * sizeof *n);
    if (!n)
      return; /* the daemon frees the slab when this client disconnects instead */
    c->unmapped = n;
    c->capunmapped = ncap;
  }
  c->unmapped[c->nunmapped++] = id;
}

/* Undo the backend mapping(s) of s. */
int gpupool__be_unmap(gpupool_client *c, cslab *s, void *stream) {
  int rc = c->be->slab_unmap(s->pool->bp, s->base, s->size, s->priv, stream);
  if (s->base_rw && c->be->slab_unmap(s->pool->bp, s->base_rw, s->size, NULL, stream) != 0)
    rc = rc ? rc : GPUPOOL_EBACKEND;
  return rc;
}

void gpupool__slab_unmap(gpupool_client *c, cslab *s, void *stream) {
  gpupool__error why;
  int rc = gpupool__be_unmap(c, s, stream);
  if (rc != 0) {
    gpupool__error_take(&why, rc);
    fprintf(stderr, "libgpupool-client: unmapping slab %" PRIu64 ": %s\n", s->id, why.msg);
  }
  gpupool__hmap_del(&c->slabs, s->id);
  note_unmapped(c, s->id);
  free(s);
}

void gpupool__handle_revokes(gpupool_client *c, const uint64_t *slabs, size_t n) {
  gpupool__error why;
  int unmapped = 0, rc;
  for (size_t i = 0; i < n; i++) {
    cslab *s = gpupool__hmap_get(&c->slabs, slabs[i]);
    slab_export *e = gpupool__hmap_get(&c->exports, slabs[i]);
    if (e) {
      /* Stashed from a reply whose buffer never became ours (a cancelled or failed get):
       * its fd would otherwise keep the slab's memory until disconnect. */
      gpupool__hmap_del(&c->exports, slabs[i]);
      gpupool__export_free(e);
    }
    if (!s) {
      note_unmapped(c, slabs[i]);
      continue;
    }
    if (s->refs > 0)
      continue; /* cannot happen: the daemon revokes only empty slabs */
    gpupool__slab_unmap(c, s, NULL);
    unmapped = 1;
  }
  /* The report goes out with the next request: the frees must have run by then. */
  if (unmapped && c->be->sync && (rc = c->be->sync(NULL)) != 0) {
    gpupool__error_take(&why, rc);
    fprintf(stderr, "libgpupool-client: waiting for slab unmaps: %s\n", why.msg);
  }
}

static cpool *pool_by_id(gpupool_client *c, uint32_t id) {
  for (int i = 0; i < c->npools; i++)
    if (c->pools[i].id == id)
      return &c->pools[i];
  return NULL;
}

/* Attach pool p (once per connection), or say why not in *err. */
int gpupool__pool_attach(gpupool_client *c, cpool *p, gpupool__error *err) {
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__AttachPool ap = GPUPOOL__WIRE__ATTACH_POOL__INIT;
  gpupool__rep *rep;
  gpupool__cpool *bp;
  int fd, rc;

  if (p->bp)
    return 0;
  ap.pool_id = p->id;
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_ATTACH_POOL;
  req.attach_pool = &ap;
  if ((rc = gpupool__call(c, &req, &rep, &fd, err)) != 0)
    return rc;
  gpupool__wire__reply__free_unpacked(rep, NULL);
  /* fd is -1 for backends without a pool-wide fd (host: slabs come with their own). */
  if ((rc = c->be->pool_import(fd, p->kind, p->device, p->capacity, &bp)) != 0)
    return gpupool__error_take(err, rc);
  if (c->ndevices > 0 && (rc = c->be->pool_set_access(bp, c->devices, c->ndevices)) != 0) {
    gpupool__error_take(err, rc);
    c->be->pool_release(bp);
    return rc;
  }
  /* call() let go of the lock: another thread may have attached the pool meanwhile. */
  if (p->bp)
    c->be->pool_release(bp);
  else
    p->bp = bp;
  return 0;
}

static int event_get(gpupool_client *c, const Gpupool__Wire__EventRef *ref, gpupool__cevent **out) {
  gpupool__cevent *e;
  int rc;
  *out = NULL;
  if (!ref || !c->be->has_events || c->host_fences)
    return 0;
  e = gpupool__hmap_get(&c->events, ref->id);
  if (!e) {
    if ((rc = c->be->event_open(ref->ipc_handle.data, ref->ipc_handle.len, &e)) != 0)
      return rc;
    if (gpupool__hmap_put(&c->events, ref->id, e) != 0) {
      c->be->event_close(e);
      return gpupool__err(GPUPOOL_ENOMEM, "out of memory");
    }
  }
  *out = e;
  return 0;
}

/* Release hold_id on the daemon, or say why not in *err. */
int gpupool__send_release(gpupool_client *c, uint64_t hold_id, int done_recorded, gpupool__error *err) {
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__Release rl = GPUPOOL__WIRE__RELEASE__INIT;
  gpupool__rep *rep;
  int rc;
  rl.hold_id = hold_id;
  rl.done_recorded = done_recorded;
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_RELEASE;
  req.release = &rl;
  rc = gpupool__call(c, &req, &rep, NULL, err);
  if (rc == 0)
    gpupool__wire__reply__free_unpacked(rep, NULL);
  return rc;
}

/* Turn a BufferDesc into a buffer of this process: attach the pool, map the slab, open the
 * events, and (wait_ready) make `stream` wait on the producer's ready event. On failure the
 * daemon's hold is released so nothing stays behind, and *err says why. */
int gpupool__materialize(gpupool_client *c, const Gpupool__Wire__BufferDesc *d, int wait_ready, void *stream,
                         gpupool_buffer **out, gpupool__error *err) {
  gpupool_buffer *b;
  cpool *p;
  cslab *s;
  gpupool__cevent *ready = NULL, *done = NULL;
  gpupool_tensor_meta meta;
  int rc, new_slab = 0;
  /* The connection d came on. Attaching a pool lets go of the lock: if another thread
   * reconnects meanwhile, d's hold, pool and slab belong to a daemon that is gone, and its
   * ids may name something else on the new one. */
  uint64_t gen = c->reconnects;

  if (!d || !d->slab) {
    rc = gpupool__error_set(err, GPUPOOL_EPROTO, "reply without a buffer description");
    goto fail_taken;
  }
  p = pool_by_id(c, d->pool_id);
  if (!p) {
    rc = gpupool__error_set(err, GPUPOOL_EPROTO, "buffer in unknown pool %u", d->pool_id);
    goto fail_taken;
  }
  uint64_t t_m = TRACE_ON() ? gpupool__mono_ns() : 0;
  rc = gpupool__pool_attach(c, p, err);
  if (c->reconnects != gen) {
    return gpupool__error_set(err, GPUPOOL_ELOST, "gpupoold went away while this buffer was being mapped: its "
                              "hold went with the old daemon (get or allocate it again)");
  }
  if (rc != 0)
    goto fail_taken;
  if (t_m)
    gpupool__trace("attach", t_m, d->pool_id);
  s = gpupool__hmap_get(&c->slabs, d->slab->id);
  if (s && !d->read_only && !s->writable && !s->base_rw) {
    /* Mapped read-only so far; this hold may write: map it again, read-write. */
    slab_export *ex = gpupool__hmap_get(&c->exports, d->slab->id);
    void *priv = NULL;
    if (!ex || !ex->writable) {
      rc = gpupool__error_set(err, GPUPOOL_EPROTO, "the daemon sent no writable mapping for slab %" PRIu64,
                              d->slab->id);
      goto fail_taken;
    }
    gpupool__hmap_del(&c->exports, s->id);
    rc = c->be->slab_map(p->bp, ex->data, ex->len, s->size, ex->fd, 1, &s->base_rw, &priv);
    ex->fd = -1;
    gpupool__export_free(ex);
    if (rc != 0)
      goto fail;
    c->slab_maps++;
  }
  if (!s) {
    slab_export *ex = gpupool__hmap_get(&c->exports, d->slab->id);
    if (!ex) {
      rc = gpupool__error_set(err, GPUPOOL_EPROTO, "the daemon sent no export data for slab %" PRIu64, d->slab->id);
      goto fail_taken;
    }
    s = calloc(1, sizeof *s);
    if (!s) {
      rc = gpupool__error_set(err, GPUPOOL_ENOMEM, "out of memory");
      goto fail_taken;
    }
    s->id = d->slab->id;
    s->pool = p;
    s->size = d->slab->size;
    s->dedicated = d->slab->dedicated;
    s->writable = ex->writable;
    rc = c->be->slab_map(p->bp, ex->data, ex->len, s->size, ex->fd, ex->writable, &s->base, &s->priv);
    gpupool__hmap_del(&c->exports, s->id);
    ex->fd = -1; /* taken by slab_map */
    gpupool__export_free(ex);
    if (rc == 0)
      c->slab_maps++;
    if (rc != 0) {
      free(s);
      /* Tell the daemon we do not map it, so it does not wait for us. */
      note_unmapped(c, d->slab->id);
      goto fail;
    }
    if (gpupool__hmap_put(&c->slabs, s->id, s) != 0) {
      c->be->slab_unmap(p->bp, s->base, s->size, s->priv, NULL);
      note_unmapped(c, s->id);
      free(s);
      rc = gpupool__error_set(err, GPUPOOL_ENOMEM, "out of memory");
      goto fail_taken;
    }
    new_slab = 1;
  }
  if (d->offset > s->size || d->size > s->size - d->offset) {
    rc = gpupool__error_set(err, GPUPOOL_EPROTO, "buffer %" PRIu64 "+%" PRIu64 " lies outside its slab", d->offset,
                            d->size);
    goto fail_slab_taken;
  }
  if (!d->read_only && !s->writable && !s->base_rw) {
    /* A new slab whose export data came read-only, for a hold that may write. */
    rc = gpupool__error_set(err, GPUPOOL_EPROTO,
                            "the daemon sent a read-only mapping of slab %" PRIu64 " for a writable hold", s->id);
    goto fail_slab_taken;
  }
  if (t_m)
    gpupool__trace("slab", t_m, d->slab->id);
  if ((rc = event_get(c, d->ready, &ready)) != 0 || (rc = event_get(c, d->done, &done)) != 0)
    goto fail_slab;
  if (t_m)
    gpupool__trace("events", t_m, d->ready ? d->ready->id : 0);
  /* Make the caller's stream wait for the producer's work, unless it has already finished
   * (then the wait would only cost time). */
  if (wait_ready && ready && !(c->be->event_query && c->be->event_query(ready) == 1)) {
    if ((rc = c->be->stream_wait(ready, stream)) != 0)
      goto fail_slab;
    c->ready_waits++;
  }
  if (t_m)
    gpupool__trace("wait", t_m, 0);
  if (d->tensor && d->tensor->present && gpupool__wire_meta_from(d->tensor, d->size, &meta) != 0) {
    rc = gpupool__error_take(err, GPUPOOL_EPROTO);
    gpupool__error_prefix(err, "gpupoold sent tensor metadata this library refuses: ");
    goto fail_slab_taken;
  }
  b = calloc(1, sizeof *b);
  if (!b) {
    rc = gpupool__error_set(err, GPUPOOL_ENOMEM, "out of memory");
    goto fail_slab_taken;
  }
  b->c = c;
  b->hold_id = d->hold_id;
  b->buffer_id = d->buffer_id;
  b->slab = s;
  b->base = d->read_only || s->writable ? s->base : s->base_rw;
  b->offset = d->offset;
  b->size = d->size;
  b->read_only = d->read_only;
  b->ready_id = d->ready ? d->ready->id : 0;
  b->done_id = d->done ? d->done->id : 0;
  if (d->tensor && d->tensor->present) {
    b->meta = meta;
    b->has_meta = 1;
  }
  s->refs++;
  b->next = c->buffers;
  if (c->buffers)
    c->buffers->prev = b;
  c->buffers = b;
  *out = b;
  return 0;
fail_slab:
  gpupool__error_take(err, rc);
fail_slab_taken:
  if (new_slab && s->refs == 0)
    gpupool__slab_unmap(c, s, NULL);
  goto release;
fail:
  gpupool__error_take(err, rc);
fail_taken:
release:
  if (d && d->hold_id) {
    gpupool__error ignored; /* the failure above is the one to tell */
    gpupool__send_release(c, d->hold_id, 0, &ignored);
  }
  return rc;
}

/* Close the backend events and release the pools imported from one daemon: the live
 * connection's at disconnect, a stale generation's when its last mapping goes. */
void gpupool__release_imports(gpupool_client *c, gpupool__hmap *events, cpool *pools, int npools) {
  if (c->be && c->be->has_events)
    for (size_t i = 0; i < events->cap; i++)
      if (gpupool__hmap_slot_used(events, i))
        c->be->event_close(events->slots[i].val);
  gpupool__hmap_free(events);
  for (int i = 0; i < npools; i++)
    if (pools[i].bp)
      c->be->pool_release(pools[i].bp);
}

void gpupool__stale_gen_free(gpupool_client *c, stale_gen *g) {
  stale_gen **pp;
  for (pp = &c->stale; *pp && *pp != g; pp = &(*pp)->next)
    ;
  if (*pp)
    *pp = g->next;
  gpupool__release_imports(c, &g->events, g->pools, g->npools);
  free(g->pools);
  /* Last: no mapping of that daemon's memory is left in this process. */
  if (g->lease_fd >= 0)
    close(g->lease_fd);
  free(g);
}
