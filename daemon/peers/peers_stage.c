/*
 * Peers' staging of device memory (see peers.c): memory the daemon cannot hand to UCX (a
 * device pool's, or any slab it cannot map) moves through pinned host memory in slots of
 * STAGE_SLOT bytes. The serving side copies device -> slot with the backend's copy jobs (CUDA:
 * its copy engines and streams; host backend: a thread) and sends the slot; the fetching side
 * receives into a slot and copies slot -> device. A transfer holds at most STAGE_RING slots, so
 * copies and the network overlap and its memory is bounded; the fetching side tells the
 * serving side how much it can take (PeerReady.window) and acknowledges what reached device
 * memory (PeerCredit), so the serving side never sends more than the fetching side has room
 * for. Copies are polled from the loop (a 1 ms timer while staged transfers run, and after
 * each slot fills), never waited on, except that stopping a running copy waits for it to end
 * (the backend's copy_free: at most one slot's copy time on CUDA).
 *
 * The slots are slabs of the daemon's own pool of pinned host memory (CUDA: a host-NUMA pool;
 * host backend: memfds, standing for it), made on first use, at most STAGE_SLOTS_MAX, kept
 * for the daemon's life and counted apart from the tenants' pools. A slot whose transfer ended
 * while UCX still sends from it goes back only once those sends end.
 *
 * Which memory is staged: on the CUDA backend every pool's (device and host-NUMA slabs have no
 * fd the daemon maps); on the host backend the pools configured with `device = N`, which
 * stand for GPUs (as for replicas), so the staged path runs in tests without a GPU. Whether
 * the UCX build can move CUDA memory itself is logged at start-up; device memory is staged
 * either way (sending device memory directly is not built).
 *
 * Test hook (read at start-up): GPUPOOL_TEST_STAGE_SLOTS=N makes at most N slots (2 to
 * STAGE_SLOTS_MAX), so the tests run out of slots with few transfers.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "peers_internal.h"

enum { ST_IDLE, ST_COPYING, ST_READY, ST_RECV, ST_FULL, ST_DRAINED };

static const gpupool__backend_ops *ops_of(gpd_peers *P) { return P->reg->be->ops; }

int gpd_pr_stage_needed(gpd_peers *P, const gpd_buffer *b) {
  return !b->slab->bs.fd_maps || gpd_pool_device(P->reg, b->slab->pool) >= 0;
}

static void stage_run(gpd_peers *P);

static void on_stage_timer(uv_timer_t *t) { stage_run(t->data); }

static void timer_update(gpd_peers *P) {
  if (P->nstaged && !P->stage_timer_on) {
    uv_timer_start(&P->stage_timer, on_stage_timer, 1, 1);
    P->stage_timer_on = 1;
  } else if (!P->nstaged && P->stage_timer_on) {
    uv_timer_stop(&P->stage_timer);
    P->stage_timer_on = 0;
  }
}

int gpd_pr_stage_open(gpd_peers *P) {
  gpd_registry *reg = P->reg;
  const gpupool__backend_ops *ops = ops_of(P);
  int host_be = reg->be->desc == &gpupool__backend_host, any = 0, dev = -1, numa = -1, fd = -1, rc;
  gpupool__pool_config c;

  uv_timer_init(P->loop, &P->stage_timer);
  P->stage_timer.data = P;
  P->slots_max = STAGE_SLOTS_MAX;
  if (getenv("GPUPOOL_TEST_STAGE_SLOTS")) {
    long n = strtol(getenv("GPUPOOL_TEST_STAGE_SLOTS"), NULL, 10);
    P->slots_max = n < 2 ? 2 : n > STAGE_SLOTS_MAX ? STAGE_SLOTS_MAX : (uint32_t)n;
  }
  for (int i = 0; i < reg->npools; i++) {
    const gpd_pool *p = &reg->pools[i];
    if (host_be ? gpd_pool_device(reg, p) < 0 : 0)
      continue;
    any = 1;
    if (dev < 0)
      dev = p->cfg.device;
    if (numa < 0 && p->cfg.kind == GPUPOOL_MEM_HOST_NUMA)
      numa = p->cfg.numa_node;
  }
  if (!any) {
    snprintf(P->device_memory, sizeof P->device_memory, "none here (host pools move directly)");
    GPUPOOL__INFO("peers: device memory: %s", P->device_memory);
    return 0;
  }
  if (!ops->copy_start) {
    snprintf(P->device_memory, sizeof P->device_memory, "not moved: the %s backend cannot copy to host memory",
             reg->be->desc->name);
    GPUPOOL__WARN("peers: device memory: %s; fetches of and from device pools fail", P->device_memory);
    return 0;
  }
  gpupool__pool_config_init(&c);
  snprintf(c.name, sizeof c.name, "peer-staging");
  c.kind = host_be ? GPUPOOL_MEM_HOST : GPUPOOL_MEM_HOST_NUMA;
  c.device = dev < 0 ? 0 : dev;
  c.numa_node = numa < 0 ? 0 : numa;
  c.capacity = STAGE_SLOTS_MAX * STAGE_SLOT;
  c.slab_size = STAGE_SLOT;
  if ((rc = ops->pool_create(reg->be, &c, &P->stage_bp, &fd)) != 0) {
    P->stage_bp = NULL;
    snprintf(P->device_memory, sizeof P->device_memory, "not moved: no pinned host memory for staging (%s)",
             gpupool__errmsg());
    GPUPOOL__WARN("peers: device memory: %s; fetches of and from device pools fail", P->device_memory);
    return 0;
  }
  (void)fd; /* owned by the pool; the staging pool is never shared */
  snprintf(P->device_memory, sizeof P->device_memory,
           "staged through pinned host memory (%s, NUMA node %d), %" PRIu64 " MiB chunks, %d per transfer, "
           "at most %" PRIu64 " MiB; UCX %s CUDA memory (direct sends not built)",
           host_be ? "memfd standing for it on the host backend" : "a host-NUMA pool", c.numa_node,
           STAGE_SLOT >> 20, STAGE_RING, (STAGE_SLOTS_MAX * STAGE_SLOT) >> 20,
           gpd_ucx_moves_cuda(P->ucx) ? "can move" : "cannot move");
  GPUPOOL__INFO("peers: device memory: %s", P->device_memory);
  return 0;
}

void gpd_pr_stage_close(gpd_peers *P) {
  const gpupool__backend_ops *ops = ops_of(P);
  for (uint32_t i = 0; i < P->nslots; i++) {
    stage_slot *s = &P->slots[i];
    if (s->maplen)
      munmap(s->map, s->maplen);
    ops->slab_free(P->stage_bp, &s->bs);
  }
  P->nslots = 0;
  P->free_slots = NULL;
  if (P->stage_bp)
    ops->pool_destroy(P->stage_bp);
  P->stage_bp = NULL;
  uv_timer_stop(&P->stage_timer);
  P->stage_timer_on = 0;
}

/* A free slot, made when none is free and fewer than STAGE_SLOTS_MAX exist: 1 and *out, 0
 * when none can be had now, < 0 when none could be made (error set). Fetches and serves each
 * take at most half of the slots: a serve holds its slots until the fetching side's credit
 * comes, and that fetching side needs slots of its own to give credit, so if serves could
 * take every slot of two daemons serving each other, neither side's fetches could move. */
static int slot_get(gpd_peers *P, int fetching, stage_slot **out) {
  stage_slot *s = P->free_slots;
  int rc;
  if (P->slots_side[fetching] >= P->slots_max / 2)
    return 0;
  if (s) {
    P->free_slots = s->next_free;
  } else {
    if (!P->stage_bp || P->nslots >= P->slots_max)
      return 0;
    s = &P->slots[P->nslots];
    memset(s, 0, sizeof *s);
    if ((rc = ops_of(P)->slab_alloc(P->stage_bp, STAGE_SLOT, 0, &s->bs)) != 0)
      return rc == GPUPOOL_ENOSPC && P->slots_taken ? 0 : rc;
    if (s->bs.fd_maps) {
      void *m = mmap(NULL, (size_t)s->bs.size, PROT_READ | PROT_WRITE, MAP_SHARED, s->bs.fd, 0);
      if (m == MAP_FAILED) {
        ops_of(P)->slab_free(P->stage_bp, &s->bs);
        return gpupool__err(GPUPOOL_EBACKEND, "cannot map a staging slot of %" PRIu64 " bytes", s->bs.size);
      }
      s->map = m;
      s->maplen = (size_t)s->bs.size;
    } else {
      s->map = s->bs.priv; /* CUDA host-NUMA memory: the pointer is valid on the CPU */
    }
    P->nslots++;
  }
  s->taken = 1;
  s->orphan = 0;
  s->fetching = fetching;
  s->next_free = NULL;
  P->slots_taken++;
  P->slots_side[fetching]++;
  *out = s;
  return 1;
}

static void slot_put(gpd_peers *P, stage_slot *s) {
  if (s->sends) {
    s->orphan = 1;
    return;
  }
  s->taken = 0;
  s->orphan = 0;
  s->next_free = P->free_slots;
  P->free_slots = s;
  P->slots_taken--;
  P->slots_side[s->fetching]--;
  gpd_pr_stage_kick(P); /* transfers may wait for a slot */
}

void gpd_pr_stage_sent(gpd_peers *P, stage_slot *s) {
  s->sends--;
  if (!s->sends && s->orphan)
    slot_put(P, s);
}

/* ---- transfers ---------------------------------------------------------------------------- */

stager *gpd_pr_stager_new(gpd_peers *P, int fetching, gpd_buffer *const *bufs, const uint64_t *lens, uint32_t n) {
  stager *st = calloc(1, sizeof *st);
  if (!st || !(st->locs = calloc(n, sizeof *st->locs)) || !(st->starts = calloc(n, sizeof *st->starts)) ||
      !(st->lens = calloc(n, sizeof *st->lens)) || !(st->events = calloc(n, sizeof *st->events))) {
    if (st) {
      free(st->locs);
      free(st->starts);
      free(st->lens);
    }
    free(st);
    gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
    return NULL;
  }
  st->P = P;
  st->fetching = fetching;
  st->n = n;
  for (uint32_t i = 0; i < n; i++) {
    const gpd_buffer *b = bufs[i];
    st->locs[i] = (gpupool__bloc){.pool = b->slab->inst->bp, .slab = (gpupool__bslab *)&b->slab->bs, .off = b->offset};
    st->starts[i] = st->total;
    st->lens[i] = lens[i];
    st->total += lens[i];
    st->events[i] = b->ready;
  }
  st->ready = fetching;
  P->nstaged++;
  timer_update(P);
  return st;
}

void gpd_pr_stager_free(stager *st) {
  gpd_peers *P;
  if (!st)
    return;
  P = st->P;
  for (uint32_t i = 0; i < st->nring; i++) {
    stage_ent *e = &st->ring[i];
    if (e->job)
      ops_of(P)->copy_free(e->job); /* returns once no engine touches the slot or the buffer */
    if (e->slot)
      slot_put(P, e->slot);
  }
  free(st->locs);
  free(st->starts);
  free(st->lens);
  free(st->events);
  free(st);
  P->nstaged--;
  timer_update(P);
}

static void st_fail(stager *st, const char *what) {
  if (st->failed)
    return;
  st->failed = 1;
  snprintf(st->why, sizeof st->why, "%s: %s", what, gpupool__errmsg());
}

/* The buffer holding stream byte pos. */
static uint32_t buf_at(const stager *st, uint64_t pos) {
  uint32_t lo = 0, hi = st->n;
  while (hi - lo > 1) {
    uint32_t mid = lo + (hi - lo) / 2;
    if (st->starts[mid] <= pos)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

/* Copy stream bytes [a, b) between device memory and slot (to the slot when serving):
 * segments of one place each (a serving range was cut where the buffers' pool changes). */
static int copy_range(stager *st, stage_slot *slot, uint64_t a, uint64_t b, gpupool__bcopy **job) {
  gpd_peers *P = st->P;
  uint32_t first = buf_at(st, a), i;
  gpupool__bcopy_seg *segs;
  size_t n = 0;
  int rc;
  for (i = first; i < st->n && st->starts[i] < b; i++)
    n++;
  if (!(segs = calloc(n, sizeof *segs)))
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  n = 0;
  for (i = first; i < st->n && st->starts[i] < b; i++) {
    uint64_t from = a > st->starts[i] ? a : st->starts[i];
    uint64_t to = b < st->starts[i] + st->lens[i] ? b : st->starts[i] + st->lens[i];
    gpupool__bloc dev = st->locs[i], host = {.pool = P->stage_bp, .slab = &slot->bs, .off = from - a};
    if (to <= from)
      continue;
    dev.off += from - st->starts[i];
    segs[n].src = st->fetching ? host : dev;
    segs[n].dst[0] = st->fetching ? dev : host;
    segs[n].len = to - from;
    n++;
  }
  rc = n ? ops_of(P)->copy_start(P->reg->be, segs, n, 1, job) : gpupool__err(GPUPOOL_EINVAL, "an empty staging copy");
  free(segs);
  return rc;
}

/* Serving: 1 when every source's ready event completed (what its producer queued before the
 * publish is in memory: the copy engines' streams do not wait for the producer's). A query
 * error counts as done: the copy then reads what is there, as a getter would. */
static int srcs_ready(stager *st) {
  const gpupool__backend_ops *ops = ops_of(st->P);
  if (st->ready || !ops->has_events)
    return 1;
  for (uint32_t i = 0; i < st->n; i++)
    if (st->events[i] && st->events[i]->be && ops->event_query(st->events[i]->be) == 0)
      return 0;
  st->ready = 1;
  return 1;
}

/* Serving: poll the copies, give back the slots whose bytes were all sent (sent: the stream
 * bytes handed to UCX), and copy the next ranges into free slots. */
void gpd_pr_stager_serve_poll(stager *st, uint64_t sent) {
  gpd_peers *P = st->P;
  if (st->failed || !srcs_ready(st))
    return;
  for (uint32_t i = 0; i < st->nring; i++) {
    stage_ent *e = &st->ring[i];
    if (e->state == ST_COPYING) {
      int q = ops_of(P)->copy_poll(e->job);
      if (q < 0) {
        st_fail(st, "copying device memory to pinned host memory");
        return;
      }
      if (q > 0) {
        ops_of(P)->copy_free(e->job);
        e->job = NULL;
        e->state = ST_READY;
      }
    }
  }
  /* A slot goes back once every byte of it was sent and those sends ended (so a transfer
   * holds at most its ring); the last send's callback brings the transfer back here. */
  while (st->nring && st->ring[0].state == ST_READY && st->ring[0].end <= sent && !st->ring[0].slot->sends) {
    slot_put(P, st->ring[0].slot);
    memmove(&st->ring[0], &st->ring[1], (st->nring - 1) * sizeof st->ring[0]);
    st->nring--;
  }
  while (st->nring < STAGE_RING && st->copy_pos < st->total) {
    stage_slot *s = NULL;
    uint64_t a = st->copy_pos, b = a + STAGE_SLOT < st->total ? a + STAGE_SLOT : st->total;
    uint32_t i = buf_at(st, a);
    stage_ent *e;
    int rc = slot_get(P, 0, &s);
    if (rc < 0 && !st->nring) {
      st_fail(st, "making a staging slot");
      return;
    }
    if (rc <= 0)
      break;
    /* One copy reads one pool: the range stops where the buffers' pool changes. */
    for (uint32_t j = i + 1; j < st->n && st->starts[j] < b; j++)
      if (st->locs[j].pool != st->locs[i].pool) {
        b = st->starts[j];
        break;
      }
    e = &st->ring[st->nring];
    memset(e, 0, sizeof *e);
    if (copy_range(st, s, a, b, &e->job) != 0) {
      slot_put(P, s);
      st_fail(st, "starting a copy of device memory to pinned host memory");
      return;
    }
    e->slot = s;
    e->start = a;
    e->end = b;
    e->state = ST_COPYING;
    st->nring++;
    st->copy_pos = b;
  }
}

int gpd_pr_stager_next(stager *st, uint64_t pos, uint64_t max, const uint8_t **data, stage_slot **slot,
                       uint64_t *len) {
  for (uint32_t i = 0; i < st->nring; i++) {
    stage_ent *e = &st->ring[i];
    if (pos < e->start || pos >= e->end)
      continue;
    if (e->state != ST_READY)
      return 0;
    *len = e->end - pos < max ? e->end - pos : max;
    *data = e->slot->map + (pos - e->start);
    *slot = e->slot;
    e->slot->sends++;
    return 1;
  }
  return 0;
}

uint32_t gpd_pr_stager_take(stager *st) {
  uint64_t want = (st->total + STAGE_SLOT - 1) / STAGE_SLOT;
  if (want > STAGE_RING)
    want = STAGE_RING;
  while (st->nring < want) {
    stage_slot *s = NULL;
    stage_ent *e = &st->ring[st->nring];
    int rc = slot_get(st->P, 1, &s);
    if (rc < 0 && !st->nring) {
      st_fail(st, "making a staging slot");
      return 0;
    }
    if (rc <= 0)
      break;
    memset(e, 0, sizeof *e);
    e->slot = s;
    e->start = st->nring * STAGE_SLOT;
    e->end = e->start + STAGE_SLOT < st->total ? e->start + STAGE_SLOT : st->total;
    e->state = ST_RECV;
    st->nring++;
  }
  return st->nring;
}

int gpd_pr_stager_recv(stager *st, uint64_t pos, const void *data, size_t len) {
  const uint8_t *d = data;
  int full = 0;
  if (!st->nring || pos < st->drained || pos > st->total || len > st->total - pos)
    return -1;
  while (len) {
    uint64_t k = pos / STAGE_SLOT, part;
    stage_ent *e = &st->ring[k % st->nring];
    if (e->start != k * STAGE_SLOT || e->state != ST_RECV)
      return -1; /* beyond the window the fetching side gave */
    part = e->end - pos < len ? e->end - pos : len;
    if (part > (e->end - e->start) - e->got)
      return -1; /* more bytes than the range holds: sent twice */
    memcpy(e->slot->map + (pos - e->start), d, part);
    e->got += part;
    if (e->got == e->end - e->start) {
      e->state = ST_FULL;
      full = 1;
    }
    pos += part;
    d += part;
    len -= part;
  }
  if (full)
    gpd_pr_stage_kick(st->P);
  return 0;
}

/* Fetching: copy the full slots to device memory, poll those copies, and move the drained
 * prefix on (each drained slot takes the range nring slots further, or goes back). */
void gpd_pr_stager_fetch_poll(stager *st) {
  gpd_peers *P = st->P;
  if (st->failed)
    return;
  for (uint32_t i = 0; i < st->nring; i++) {
    stage_ent *e = &st->ring[i];
    if (e->state == ST_FULL) {
      if (copy_range(st, e->slot, e->start, e->end, &e->job) != 0) {
        st_fail(st, "starting a copy of pinned host memory to device memory");
        return;
      }
      e->state = ST_COPYING;
    }
    if (e->state == ST_COPYING) {
      int q = ops_of(P)->copy_poll(e->job);
      if (q < 0) {
        st_fail(st, "copying pinned host memory to device memory");
        return;
      }
      if (q > 0) {
        ops_of(P)->copy_free(e->job);
        e->job = NULL;
        e->state = ST_DRAINED;
      }
    }
  }
  while (st->drained < st->total) {
    stage_ent *e = &st->ring[(st->drained / STAGE_SLOT) % st->nring];
    if (e->state != ST_DRAINED || e->start != st->drained)
      break;
    st->drained = e->end;
    e->start += st->nring * STAGE_SLOT;
    if (e->start < st->total) {
      e->end = e->start + STAGE_SLOT < st->total ? e->start + STAGE_SLOT : st->total;
      e->got = 0;
      e->state = ST_RECV;
    } else {
      e->state = ST_IDLE;
      slot_put(P, e->slot);
      e->slot = NULL;
    }
  }
}

/* ---- running them ------------------------------------------------------------------------- */

/* Every staged transfer, once: one that fails or finishes may end others (a closed link frees
 * its serves, a failed fetch answers peers' gets), so a pass stops at the first that changed
 * the lists; the timer comes back within a millisecond. */
static void stage_run(gpd_peers *P) {
  for (sub *sb = P->subs, *next; sb; sb = next) {
    next = sb->next;
    if ((sb->st || sb->stage_wait) && P->ops->sub_stage_step(sb))
      return;
  }
  for (plink *l = P->links; l; l = l->next) {
    if (l->closing)
      continue;
    for (serve *sv = l->serves; sv; sv = sv->next)
      if (sv->st && P->ops->serve_stage_step(sv))
        return;
  }
}

static void on_kick(void *arg, int status) {
  gpd_peers *P = arg;
  (void)status;
  P->stage_posted = 0;
  stage_run(P);
}

void gpd_pr_stage_kick(gpd_peers *P) {
  if (!P->stage_posted && P->ucx && gpd_ucx_defer(P->ucx, on_kick, P) == 0)
    P->stage_posted = 1;
}
