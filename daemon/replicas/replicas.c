/*
 * Replicas: a version's buffers on another device. A get for a device where the version does
 * not lie gets a replica there: a buffer in a pool of that device, made once per (version,
 * device) however many getters ask at once, filled by a copy job of the backend (its own
 * engines: CUDA streams and copy engines, a thread on the host backend) that the daemon polls
 * from its loop without blocking, and handed out only once every byte is in. Getters wait for
 * the job as gets wait for a publish; a job that fails drops its replicas and fails its
 * waiters, and the next get starts again. A broadcast publish starts the replicas at once,
 * one job along the devices as a chain. A job's replica buffers are made a slice of loop time
 * per turn (copy_make), so one big job does not hold the loop for all its allocations.
 *
 * Ownership: the source buffer lists its replicas and holds one reference on each replica
 * buffer; holders of a replica hold it as any buffer. The source's last holder letting go (its
 * version replaced and every hold gone), or the source being published again, drops that
 * reference. A running job holds a reference on each source buffer, so no source range is
 * reused while an engine reads it; it ends (complete, failed, or cancelled when the daemon
 * stops) before its replicas are dropped or handed out. A replica counts against the tenant
 * of the buffer it copies (its limits and its pools).
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "errors.h"
#include "list.h"
#include "log.h"
#include "registry_internal.h"
#include "replicas.h"

/* Copy jobs the backend runs at once (host: a thread each; CUDA: streams); the others wait,
 * oldest first. However many replicas clients ask for, the daemon runs this many copies. */
#define GPD_COPIES_RUNNING_MAX 8

/* The pool of `device` where a replica of owner's memory goes: the first such pool not shared
 * with a group for a tenant's memory, the first shared with that group for a group's. */
static gpd_pool *pool_on(gpd_registry *reg, int device, uint64_t owner) {
  for (int i = 0; i < reg->npools; i++) {
    gpd_pool *p = &reg->pools[i];
    int share = reg->cfg->pool_share[i];
    if (gpd_pool_device(reg, p) != device)
      continue;
    if ((owner & GROUP_SET) ? share >= 0 && (uint64_t)share == (owner & ~GROUP_SET) : share < 0)
      return p;
  }
  return NULL;
}

/* EINVAL, not ENOENT: a get waiting for a publish takes ENOENT for "not yet". */
static int no_pool(gpd_registry *reg, int device, uint64_t owner) {
  char label[80];
  gpd_tenant_label(reg->cfg, owner, label, sizeof label);
  return gpupool__err(GPUPOOL_EINVAL,
                      "no pool of device %d can hold a replica of memory of %s: configure a [pool] with "
                      "device = %d%s (gpupoolctl status lists the pools and their devices)",
                      device, label, device, (owner & GROUP_SET) ? " shared with that group" : "");
}

static gpd_replica *replica_find(gpd_buffer *b, int device) {
  for (gpd_replica *r = b->replicas; r; r = r->next)
    if (r->device == device)
      return r;
  return NULL;
}

static void replica_unlink(gpd_replica *r) {
  gpd_replica **pp = &r->src->replicas;
  while (*pp && *pp != r)
    pp = &(*pp)->next;
  if (*pp)
    *pp = r->next;
  r->attached = 0;
  r->next = NULL;
}

static void replicas_drop(gpd_registry *reg, gpd_buffer *b) {
  gpd_replica *r = b->replicas, *next;
  b->replicas = NULL;
  for (; r; r = next) {
    next = r->next;
    r->attached = 0;
    r->next = NULL;
    if (r->copy)
      continue; /* its job drops it when it ends */
    gpd_buffer_unref(reg, r->buf);
    free(r);
  }
}

/* A replica buffer of src in a pool of device: on src's owner's account, one reference. */
static int replica_buffer(gpd_registry *reg, gpd_buffer *src, int device, gpd_buffer **out) {
  uint64_t owner = src->slab->owner, align = 0, asize;
  gpd_pool *p = pool_on(reg, device, owner);
  gpd_buffer *b;
  int rc;
  if (!p)
    return no_pool(reg, device, owner);
  if ((rc = gpd_pool_alignment(p, &align)) != 0)
    return rc;
  asize = gpd_round_up(src->asked, p->cfg.alignment);
  if ((rc = gpd_quota_replica(reg, src->owner_tenant, asize, device)) != 0)
    return rc;
  if ((rc = gpd_buffer_place(reg, NULL, p, owner, src->asked, asize, align, GPD_PLACE_REPLICA, &b)) != 0) {
    if (rc == GPUPOOL_ENOSPC)
      rc = gpupool__err(GPUPOOL_ENOSPC, "no room for a replica of %" PRIu64 " bytes in pool '%s' (device %d): "
                        "%" PRIu64 " bytes free; release buffers there or raise its capacity",
                        src->asked, p->cfg.name, device, gpd_pool_free_bytes(p));
    return rc;
  }
  b->owner_uid = src->owner_uid;
  b->owner_tenant = src->owner_tenant;
  b->owner_pid = src->owner_pid;
  b->replica_of = src->id;
  b->has_meta = src->has_meta;
  b->meta = src->meta;
  b->refs = 1;
  gpd_uid_account(reg, b->owner_tenant, (int64_t)b->size, 1);
  *out = b;
  return 0;
}

static gpupool__bloc loc_of(const gpd_buffer *b) {
  return (gpupool__bloc){.pool = b->slab->inst->bp, .slab = (gpupool__bslab *)&b->slab->bs, .off = b->offset};
}

static void copy_timer_update(gpd_registry *reg);

/* 1 when every source's ready event has completed (what its producer queued before publishing
 * is in memory), 0 while one is pending: a copy starts only then, since the copy engine's
 * streams do not wait on the producer's. A query error counts as done: the copy then reads
 * what is there, as a getter would. */
static int srcs_ready(const gpd_registry *reg, gpd_buffer *const *srcs, uint32_t n, uint32_t *budget) {
  if (!reg->be->ops->has_events)
    return 1;
  for (uint32_t i = 0; i < n; i++) {
    gpd_event *e = srcs[i]->ready;
    if (!e || !e->be)
      continue;
    if (budget && !*budget)
      return 0;
    if (budget)
      (*budget)--;
    if (reg->be->ops->event_query(e->be) == 0)
      return 0;
  }
  return 1;
}

/* A job waits this long for its sources' ready events (its producer's work queued before the
 * publish), then fails: a producer whose stream never drains (a kernel that spins, a process
 * stopped with work queued) would otherwise keep the replicas' memory and its getters forever. */
#define GPD_COPY_READY_WAIT_NS (60ull * 1000000000ull)
/* Ready-event queries one tick may make over all waiting jobs (the loop's one thread makes
 * them): jobs beyond are checked on later ticks, in turn. */
#define GPD_COPY_READY_QUERIES 64

/* Loop time one turn spends making replica buffers (each is a slab allocation on the backend at
 * worst: on CUDA an allocation, a memset, a sync and an export): a broadcast of a big bundle
 * makes its buffers over many turns, and the loop serves every other client in between. */
#define GPD_COPY_MAKE_SLICE_NS 1000000ull

static void copy_make_update(gpd_registry *reg);

/* Make cp's next replica buffers until every one exists or the slice ends at `until` (at
 * least one each call): 0, or the error of the one that could not be made. */
static int copy_make(gpd_registry *reg, gpd_copy *cp, uint64_t until) {
  while (cp->nmade < cp->nreps) {
    gpd_replica *r = cp->reps[cp->nmade];
    uint32_t i = cp->nmade / (uint32_t)cp->ndst, d = cp->nmade % (uint32_t)cp->ndst;
    int rc = replica_buffer(reg, r->src, r->device, &r->buf);
    if (rc != 0)
      return rc;
    cp->segs[i].dst[d] = loc_of(r->buf);
    cp->bytes += r->src->asked;
    cp->nmade++;
    if (uv_hrtime() >= until)
      break;
  }
  return 0;
}

/* Free a job not yet registered (copy_new failing): its replica records and buffers. */
static void copy_discard(gpd_registry *reg, gpd_copy *cp, gpupool__bcopy_seg *segs) {
  if (cp) {
    for (uint32_t k = 0; k < cp->nreps; k++) {
      if (!cp->reps[k])
        continue;
      if (cp->reps[k]->buf)
        gpd_buffer_unref(reg, cp->reps[k]->buf);
      free(cp->reps[k]);
    }
    free(cp->reps);
    free(cp->srcs);
    free(cp);
  }
  free(segs);
}

/* Start one job copying each of the n sources to each of the ndev devices (a chain along
 * them): replicas attached, sources referenced. Its replica buffers are made a slice of loop
 * time at a time: the first slice here (a small job is complete at once, and an error there,
 * such as a quota, is returned with nothing changed) unless `later` (a broadcast, whose
 * publish is answered first), the rest on the next turns (copy_make_cb); an error there ends
 * the job, its getters told. The copy starts once every buffer exists. */
static int copy_new(gpd_registry *reg, gpd_buffer *const *srcs, uint32_t n, const int *devs, int ndev, int later,
                    gpd_copy **out) {
  const gpupool__backend_ops *ops = reg->be->ops;
  gpupool__bcopy_seg *segs = NULL;
  gpd_copy *cp = NULL;
  uint32_t total = n * (uint32_t)ndev;
  int rc;

  if (!ops->copy_start)
    return gpupool__err(GPUPOOL_ENOTSUP, "the %s backend cannot copy between pools: get the buffer where it "
                        "lies (no target device)", reg->be->desc->name);
  if (reg->stopped)
    return gpupool__err(GPUPOOL_ECLOSED, "the daemon is stopping: it starts no copy");
  if (ndev < 1 || ndev > GPUPOOL_COPY_MAX_DSTS)
    return gpupool__err(GPUPOOL_EINVAL, "a copy goes to 1 to %d devices, not %d", GPUPOOL_COPY_MAX_DSTS, ndev);
  /* Every device has a pool for it, checked before anything is made. */
  for (uint32_t i = 0; i < n; i++)
    for (int d = 0; d < ndev; d++)
      if (!pool_on(reg, devs[d], srcs[i]->slab->owner))
        return no_pool(reg, devs[d], srcs[i]->slab->owner);
  if (!(cp = calloc(1, sizeof *cp)) || !(cp->reps = calloc(total, sizeof *cp->reps)) ||
      !(cp->srcs = calloc(n, sizeof *cp->srcs)) || !(segs = calloc(n, sizeof *segs))) {
    copy_discard(reg, cp, segs);
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  }
  cp->nreps = total;
  cp->ndst = ndev;
  for (uint32_t i = 0; i < n; i++) {
    segs[i].src = loc_of(srcs[i]);
    segs[i].len = srcs[i]->asked;
    for (int d = 0; d < ndev; d++) {
      gpd_replica *r = calloc(1, sizeof *r);
      if (!r) {
        copy_discard(reg, cp, segs);
        return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
      }
      r->src = srcs[i];
      r->device = devs[d];
      r->copy = cp;
      cp->reps[i * (uint32_t)ndev + (uint32_t)d] = r;
    }
  }
  cp->segs = segs;
  if (!later && (rc = copy_make(reg, cp, uv_hrtime() + GPD_COPY_MAKE_SLICE_NS)) != 0) {
    copy_discard(reg, cp, segs);
    return rc;
  }
  /* Started now only when complete, a slot is free and no older job waits for one (jobs
   * still making their buffers wait for nothing yet). */
  if (cp->nmade == cp->nreps && reg->ncopies_started < GPD_COPIES_RUNNING_MAX &&
      reg->ncopies - reg->ncopies_started == reg->ncopies_making && srcs_ready(reg, srcs, n, NULL)) {
    if ((rc = ops->copy_start(reg->be, segs, n, ndev, &cp->job)) != 0) {
      copy_discard(reg, cp, segs);
      return rc;
    }
    reg->ncopies_started++;
    free(segs);
    cp->segs = NULL;
  }
  /* Otherwise started when its buffers exist and a slot frees (copy_timer_cb). */
  cp->id = gpd_next_id(reg);
  cp->created_ns = gpd_now_ns();
  cp->nsrcs = n;
  for (uint32_t i = 0; i < n; i++) {
    cp->srcs[i] = srcs[i];
    srcs[i]->refs++;
  }
  for (uint32_t k = 0; k < total; k++) {
    gpd_replica *r = cp->reps[k];
    r->attached = 1;
    r->next = r->src->replicas;
    r->src->replicas = r;
  }
  cp->prev = reg->copies_tail;
  if (reg->copies_tail)
    reg->copies_tail->next = cp;
  else
    reg->copies = cp;
  reg->copies_tail = cp;
  reg->ncopies++;
  reg->copies_started++;
  if (cp->nmade < cp->nreps)
    reg->ncopies_making++;
  copy_timer_update(reg);
  copy_make_update(reg);
  GPUPOOL__DEBUG("copy %" PRIu64 ": %u buffer(s) to %d device(s), %u of %u replica buffer(s) made", cp->id, n,
                 ndev, cp->nmade, cp->nreps);
  *out = cp;
  return 0;
}

/* A job ended (rc 0: every byte is in): its replicas become ready (those still attached) or
 * go, its sources are let go, and the gets waiting on it are told. */
static void copy_end(gpd_registry *reg, gpd_copy *cp, int rc, const char *msg) {
  uint64_t id = cp->id;
  if (cp->job) {
    reg->be->ops->copy_free(cp->job);
    reg->ncopies_started--;
  }
  if (cp->nmade < cp->nreps)
    reg->ncopies_making--;
  free(cp->segs);
  if (reg->copies_tail == cp)
    reg->copies_tail = cp->prev;
  GPUPOOL__LIST_UNLINK(reg->copies, cp, prev, next);
  reg->ncopies--;
  if (rc == 0)
    reg->copy_bytes += cp->bytes;
  else
    reg->copies_failed++;
  for (uint32_t k = 0; k < cp->nreps; k++) {
    gpd_replica *r = cp->reps[k];
    r->copy = NULL;
    if (rc == 0 && r->attached)
      continue; /* ready: handed out from now on */
    if (r->attached)
      replica_unlink(r);
    if (r->buf) /* NULL: not made yet */
      gpd_buffer_unref(reg, r->buf);
    free(r);
  }
  for (uint32_t i = 0; i < cp->nsrcs; i++)
    gpd_buffer_unref(reg, cp->srcs[i]);
  free(cp->reps);
  free(cp->srcs);
  free(cp);
  if (rc != 0)
    GPUPOOL__WARN("copy %" PRIu64 " of replicas failed: %s; the next get starts a new one", id, msg);
  copy_timer_update(reg);
  copy_make_update(reg);
  if (reg->on_copy)
    reg->on_copy(reg, id, rc, msg);
  if (reg->memory_returned && reg->on_memory)
    reg->on_memory(reg, NULL);
}

/* Each tick polls every started job once (at most GPD_COPIES_RUNNING_MAX): a load of its
 * state (host) or an event query (CUDA), never a wait; then starts waiting jobs in the slots
 * that freed, oldest first. */
static void copy_timer_cb(uv_timer_t *t) {
  gpd_registry *reg = t->data;
  gpd_copy *done[GPD_COPIES_RUNNING_MAX * 2];
  int rcs[GPD_COPIES_RUNNING_MAX * 2], nd = 0;
  char msgs[GPD_COPIES_RUNNING_MAX * 2][256];
  for (gpd_copy *cp = reg->copies; cp && nd < GPD_COPIES_RUNNING_MAX; cp = cp->next) {
    int q;
    if (!cp->job)
      continue;
    q = reg->be->ops->copy_poll(cp->job);
    if (q == 0)
      continue;
    rcs[nd] = q > 0 ? 0 : q;
    snprintf(msgs[nd], sizeof msgs[nd], "%s", q > 0 ? "" : gpupool__errmsg());
    done[nd++] = cp;
  }
  /* Waiting jobs whose slot freed, in turn from after the last one checked (so that jobs whose
   * sources stay busy cannot keep later ones from being checked): a start that fails ends the
   * job with its error; a job whose sources were not ready in GPD_COPY_READY_WAIT_NS ends. */
  uint32_t budget = GPD_COPY_READY_QUERIES;
  uint64_t now = gpd_now_ns(), last = reg->copy_ready_scan;
  for (int pass = 0; pass < 2; pass++)
  for (gpd_copy *cp = reg->copies; cp && reg->ncopies_started < GPD_COPIES_RUNNING_MAX &&
                                   nd < GPD_COPIES_RUNNING_MAX * 2 && budget; cp = cp->next) {
    if (pass == 0 ? cp->id <= last : cp->id > last)
      continue;
    if (cp->job || cp->nmade < cp->nreps)
      continue;
    reg->copy_ready_scan = cp->id;
    if (!srcs_ready(reg, cp->srcs, cp->nsrcs, &budget)) {
      if (now - cp->created_ns > GPD_COPY_READY_WAIT_NS) {
        rcs[nd] = GPUPOOL_ETIMEDOUT;
        snprintf(msgs[nd], sizeof msgs[nd], "its source's producer has work queued before the publish that "
                 "has not completed in %llu s (a stream that never drains, or a producer stopped with work "
                 "queued)", (unsigned long long)(GPD_COPY_READY_WAIT_NS / 1000000000ull));
        done[nd++] = cp;
      }
      continue;
    }
    if (reg->be->ops->copy_start(reg->be, cp->segs, cp->nsrcs, cp->ndst, &cp->job) != 0) {
      rcs[nd] = GPUPOOL_EBACKEND;
      snprintf(msgs[nd], sizeof msgs[nd], "%s", gpupool__errmsg());
      done[nd++] = cp;
      continue;
    }
    reg->ncopies_started++;
    free(cp->segs);
    cp->segs = NULL;
  }
  for (int i = 0; i < nd; i++)
    copy_end(reg, done[i], rcs[i], msgs[i]);
}

static void copy_timer_update(gpd_registry *reg) {
  if (reg->copies && !reg->copy_timer_on && !reg->stopped) {
    uv_timer_start(&reg->copy_timer, copy_timer_cb, 1, 1);
    reg->copy_timer_on = 1;
  } else if (!reg->copies && reg->copy_timer_on) {
    uv_timer_stop(&reg->copy_timer);
    reg->copy_timer_on = 0;
  }
}

/* One slice of loop time a turn making the buffers of the jobs that still lack some, oldest
 * first; a buffer that cannot be made (quota, room) ends its job with that error. */
static void copy_make_cb(uv_idle_t *h) {
  gpd_registry *reg = h->data;
  uint64_t until = uv_hrtime() + GPD_COPY_MAKE_SLICE_NS;
  int complete = 0;
  char msg[256];
  for (gpd_copy *cp = reg->copies; cp; cp = cp->next) {
    int rc;
    if (cp->nmade == cp->nreps)
      continue;
    if ((rc = copy_make(reg, cp, until)) != 0) {
      snprintf(msg, sizeof msg, "%s", gpupool__errmsg());
      copy_end(reg, cp, rc, msg); /* may change the list: the next turn goes on */
      return;
    }
    if (cp->nmade == cp->nreps) {
      reg->ncopies_making--;
      complete = 1;
      GPUPOOL__DEBUG("copy %" PRIu64 ": its %u replica buffer(s) made", cp->id, cp->nreps);
    }
    if (uv_hrtime() >= until)
      break;
  }
  copy_make_update(reg);
  /* Start what is complete now, not on the timer's next tick. */
  if (complete)
    copy_timer_cb(&reg->copy_timer);
}

static void copy_make_update(gpd_registry *reg) {
  if (reg->ncopies_making && !reg->copy_make_on && !reg->stopped) {
    uv_idle_start(&reg->copy_make_idle, copy_make_cb);
    reg->copy_make_on = 1;
  } else if (!reg->ncopies_making && reg->copy_make_on) {
    uv_idle_stop(&reg->copy_make_idle);
    reg->copy_make_on = 0;
  }
}

void gpd_copies_stop(gpd_registry *reg) {
  while (reg->copies)
    copy_end(reg, reg->copies, GPUPOOL_ECLOSED, "the daemon is stopping");
  if (reg->copy_timer_on) {
    uv_timer_stop(&reg->copy_timer);
    reg->copy_timer_on = 0;
  }
  if (reg->copy_make_on) {
    uv_idle_stop(&reg->copy_make_idle);
    reg->copy_make_on = 0;
  }
  if (reg->copy_notify_fd >= 0)
    uv_poll_stop(&reg->copy_notify); /* a stopping loop ends once nothing it watches is active */
}

/* ---- gets on a device ------------------------------------------------------------------- */

/* What a getter on `device` gets of buffer b: *use (b itself, or its ready replica), or
 * GPUPOOL_EBUSY with *copy the job filling the replica, or 1 when a replica is needed and none
 * exists yet. */
static int on_device(gpd_registry *reg, gpd_buffer *b, int device, gpd_buffer **use, gpd_copy **copy) {
  gpd_replica *r;
  if (gpd_pool_device(reg, b->slab->pool) == device) {
    *use = b;
    return 0;
  }
  if (!(r = replica_find(b, device)))
    return 1;
  if (r->copy) {
    *copy = r->copy;
    return GPUPOOL_EBUSY;
  }
  *use = r->buf;
  return 0;
}

int gpd_get_on(gpd_registry *reg, gpd_client *c, const gpd_rname *rn, int read_only, uint64_t newer_than,
               int device, gpd_hold **out, uint64_t *version, uint64_t *copy_id) {
  gpd_name *n;
  gpd_buffer *use = NULL;
  gpd_copy *cp = NULL;
  int rc;
  if (device < 0)
    return gpd_get(reg, c, rn, read_only, newer_than, out, version);
  if ((rc = gpd_find_single(reg, c, rn, newer_than, &n)) != 0)
    return rc;
  rc = on_device(reg, n->bufs[0], device, &use, &cp);
  if (rc == 1 && (rc = copy_new(reg, n->bufs, 1, &device, 1, 0, &cp)) == 0)
    rc = GPUPOOL_EBUSY;
  if (rc == GPUPOOL_EBUSY) {
    *copy_id = cp->id;
    return rc;
  }
  if (rc != 0)
    return rc;
  if (version)
    *version = n->version;
  /* A replica is the version's for every getter on its device: nobody writes it. */
  return gpd_hold_new(reg, c, use, read_only || n->read_only || use != n->bufs[0], 0, out);
}

int gpd_get_bundle_on(gpd_registry *reg, gpd_client *c, const gpd_rname *rn, int read_only,
                      uint64_t newer_than, int device, gpd_hold ***holds, const gpd_name **out,
                      uint64_t *copy_id) {
  gpd_name *n;
  gpd_hold **hs;
  gpd_buffer **use, **need;
  gpd_copy *wait = NULL;
  uint32_t nneed = 0, i;
  int rc;
  if (device < 0)
    return gpd_get_bundle(reg, c, rn, read_only, newer_than, holds, out);
  if ((rc = gpd_find_newer(reg, c, rn, newer_than, &n)) != 0)
    return rc;
  use = calloc(n->nbufs, sizeof *use);
  need = calloc(n->nbufs, sizeof *need);
  if (!use || !need) {
    free(use);
    free(need);
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  }
  for (i = 0; i < n->nbufs; i++) {
    gpd_copy *cp = NULL;
    rc = on_device(reg, n->bufs[i], device, &use[i], &cp);
    if (rc == 1)
      need[nneed++] = n->bufs[i];
    else if (rc == GPUPOOL_EBUSY && !wait)
      wait = cp;
  }
  /* Every missing replica of the version in one job. */
  if (nneed && (rc = copy_new(reg, need, nneed, &device, 1, 0, &wait)) != 0)
    goto out;
  if (wait) {
    *copy_id = wait->id;
    rc = GPUPOOL_EBUSY;
    goto out;
  }
  if (!(hs = calloc(n->nbufs, sizeof *hs))) {
    rc = gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
    goto out;
  }
  if ((rc = gpd_batch_begin(reg, c)) != 0) {
    free(hs);
    goto out;
  }
  /* One done event for the bundle's holds. */
  for (i = 0; i < n->nbufs; i++)
    if ((rc = gpd_hold_new(reg, c, use[i], read_only || n->read_only || use[i] != n->bufs[i], 0, &hs[i])) != 0) {
      while (i-- > 0)
        gpd_hold_drop(reg, hs[i], 0, NULL);
      gpd_batch_end(reg, c);
      free(hs);
      goto out;
    }
  gpd_batch_end(reg, c);
  *holds = hs;
  *out = n;
  rc = 0;
out:
  free(use);
  free(need);
  return rc;
}

/* ---- broadcast -------------------------------------------------------------------------- */

int gpd_replicate_limits(gpd_registry *reg, size_t n) {
  if (n == 0)
    return 0;
  if (!reg->be->ops->copy_start)
    return gpupool__err(GPUPOOL_ENOTSUP, "the %s backend cannot copy between pools: publish without "
                        "replicate_to", reg->be->desc->name);
  if (n > GPUPOOL_COPY_MAX_DSTS)
    return gpupool__err(GPUPOOL_EINVAL, "a publish replicates to at most %d devices, not %zu",
                        GPUPOOL_COPY_MAX_DSTS, n);
  return 0;
}

int gpd_replicate_check(gpd_registry *reg, const gpd_hold *h, const uint32_t *devices, size_t n) {
  for (size_t i = 0; i < n; i++) {
    if (devices[i] > 1023)
      return gpupool__err(GPUPOOL_EINVAL, "device %u is no device ordinal", devices[i]);
    for (size_t j = 0; j < i; j++)
      if (devices[j] == devices[i])
        return gpupool__err(GPUPOOL_EINVAL, "device %u is listed twice in replicate_to", devices[i]);
    if (!pool_on(reg, (int)devices[i], h->buf->slab->owner))
      return no_pool(reg, (int)devices[i], h->buf->slab->owner);
  }
  return 0;
}

void gpd_replicate(gpd_registry *reg, gpd_client *c, const gpd_rname *rn, const uint32_t *devices, size_t n) {
  gpd_name *nm;
  int devs[GPUPOOL_COPY_MAX_DSTS], ndev = 0, chain = 1;
  gpd_buffer **need;
  if (n == 0 || gpd_find_name(reg, c, rn, &nm) != 0 || !nm->nbufs)
    return;
  if (!(need = calloc(nm->nbufs, sizeof *need)))
    return;
  /* The devices where some buffer needs a replica; one chain when every buffer needs one on
   * each of them (the usual case: a version in one pool), else a job per device. */
  for (size_t i = 0; i < n && ndev < GPUPOOL_COPY_MAX_DSTS; i++) {
    uint32_t k = 0;
    for (uint32_t j = 0; j < nm->nbufs; j++) {
      gpd_buffer *use = NULL;
      gpd_copy *cp = NULL;
      if (on_device(reg, nm->bufs[j], (int)devices[i], &use, &cp) == 1)
        k++;
    }
    if (k)
      devs[ndev++] = (int)devices[i];
    if (k && k != nm->nbufs)
      chain = 0;
  }
  if (ndev && chain) {
    gpd_copy *cp;
    if (copy_new(reg, nm->bufs, nm->nbufs, devs, ndev, 1, &cp) != 0)
      GPUPOOL__PEER_WARN(&c->log_rl, c->id, "client %" PRIu64 ": replicas of '%s' on %d device(s) not started: "
                         "%s; gets on those devices make them", c->id, rn->name, ndev, gpupool__errmsg());
  } else {
    for (int d = 0; d < ndev; d++) {
      uint32_t k = 0;
      gpd_copy *cp;
      for (uint32_t j = 0; j < nm->nbufs; j++) {
        gpd_buffer *use = NULL;
        gpd_copy *busy = NULL;
        if (on_device(reg, nm->bufs[j], devs[d], &use, &busy) == 1)
          need[k++] = nm->bufs[j];
      }
      if (k && copy_new(reg, need, k, &devs[d], 1, 1, &cp) != 0)
        GPUPOOL__PEER_WARN(&c->log_rl, c->id, "client %" PRIu64 ": replica of '%s' on device %d not started: %s; "
                           "gets on that device make it", c->id, rn->name, devs[d], gpupool__errmsg());
    }
  }
  free(need);
}

/* A copy engine said a job may have ended: poll the jobs now (what the timer would do on its
 * next tick, a millisecond or more later: that wait was most of a small replica's cost). */
static void copy_notify_cb(uv_poll_t *h, int status, int events) {
  gpd_registry *reg = h->data;
  uint64_t n;
  (void)status;
  (void)events;
  if (read(reg->copy_notify_fd, &n, sizeof n) < 0 && errno != EAGAIN)
    GPUPOOL__DEBUG("reading the copy notifier: %s", strerror(errno));
  if (reg->copies && !reg->stopped)
    copy_timer_cb(&reg->copy_timer);
}

static void replicas_close(gpd_registry *reg);

static const gpd_registry_ext replicas_ext = {
    .buffer_replaced = replicas_drop,
    .stop = gpd_copies_stop,
    .close = replicas_close,
};

void gpd_replicas_attach(gpd_registry *reg) {
  const gpupool__backend_ops *ops = reg->be->ops;
  uv_timer_init(reg->loop, &reg->copy_timer);
  reg->copy_timer.data = reg;
  uv_idle_init(reg->loop, &reg->copy_make_idle);
  reg->copy_make_idle.data = reg;
  reg->copy_notify_fd = ops->copy_start && ops->copy_notify_fd ? ops->copy_notify_fd(reg->be) : -1;
  if (reg->copy_notify_fd >= 0) {
    if (uv_poll_init(reg->loop, &reg->copy_notify, reg->copy_notify_fd) == 0) {
      reg->copy_notify.data = reg;
      uv_poll_start(&reg->copy_notify, UV_READABLE, copy_notify_cb);
    } else {
      reg->copy_notify_fd = -1;
    }
  }
  reg->ext = &replicas_ext;
}

static void replicas_close(gpd_registry *reg) {
  gpd_copies_stop(reg);
  uv_close((uv_handle_t *)&reg->copy_timer, NULL);
  uv_close((uv_handle_t *)&reg->copy_make_idle, NULL);
  if (reg->copy_notify_fd >= 0) {
    uv_poll_stop(&reg->copy_notify);
    uv_close((uv_handle_t *)&reg->copy_notify, NULL);
    reg->copy_notify_fd = -1;
  }
}
