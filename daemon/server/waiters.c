/*
 * Requests that wait: allocations until memory comes back (one FIFO per pool and owner), gets
 * until a name is published (a min-heap per name on newer_than), and their timeouts and
 * limits. A pass over a queue touches only the requests that could now succeed.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "list.h"
#include "peers.h"
#include "server_internal.h"
#include "replicas.h"

/* ---- waiting requests ----------------------------------------------------------------------- */

static void waiter_closed(uv_handle_t *h) {
  gpd_waiter *w = h->data;
  gpd_bundle_plan_free(w->plan);
  free(w->name);
  free(w);
}

/* ---- the heap of a name's waiting gets ---- */

static int get_before(const gpd_waiter *a, const gpd_waiter *b) {
  return a->newer_than != b->newer_than ? a->newer_than < b->newer_than : a->order < b->order;
}

static void heap_set(wqueue *q, uint32_t i, gpd_waiter *w) {
  q->heap[i] = w;
  w->hidx = i;
}

static void heap_up(wqueue *q, uint32_t i) {
  gpd_waiter *w = q->heap[i];
  while (i > 0 && get_before(w, q->heap[(i - 1) / 2])) {
    heap_set(q, i, q->heap[(i - 1) / 2]);
    i = (i - 1) / 2;
  }
  heap_set(q, i, w);
}

static void heap_down(wqueue *q, uint32_t i) {
  gpd_waiter *w = q->heap[i];
  for (;;) {
    uint32_t m = 2 * i + 1;
    if (m >= q->n)
      break;
    if (m + 1 < q->n && get_before(q->heap[m + 1], q->heap[m]))
      m++;
    if (!get_before(q->heap[m], w))
      break;
    heap_set(q, i, q->heap[m]);
    i = m;
  }
  heap_set(q, i, w);
}

static int heap_push(wqueue *q, gpd_waiter *w) {
  if (q->n == q->cap) {
    uint32_t ncap = q->cap ? q->cap * 2 : 8;
    gpd_waiter **h = realloc(q->heap, ncap * sizeof *h);
    if (!h)
      return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
    q->heap = h;
    q->cap = ncap;
  }
  heap_set(q, q->n++, w);
  heap_up(q, q->n - 1);
  return 0;
}

static void heap_del(wqueue *q, gpd_waiter *w) {
  uint32_t i = w->hidx;
  gpd_waiter *last = q->heap[--q->n];
  w->hidx = NOT_IN_HEAP;
  if (i == q->n)
    return;
  heap_set(q, i, last);
  heap_up(q, i);
  heap_down(q, last->hidx);
}

static void get_q_free(gpd_server *s, wqueue *q) {
  gpupool__smap_del(&s->get_q, q->name);
  free(q->heap);
  free(q->name);
  free(q);
}

static void copy_q_free(gpd_server *s, wqueue *q) {
  gpupool__hmap_del(&s->copy_q, q->copy_id);
  free(q);
}

static void list_unlink(wqueue *q, gpd_waiter *w) {
  GPUPOOL__LIST_UNLINK(q->head, w, prev, next);
  if (!w->next)
    q->tail = w->prev;
  w->prev = w->next = NULL;
}

static void list_append(wqueue *q, gpd_waiter *w) {
  w->next = NULL;
  w->prev = q->tail;
  if (q->tail)
    q->tail->next = w;
  else
    q->head = w;
  q->tail = w;
}

/* Unlinks w; its memory stays valid until the timer's close callback, so a loop over a queue
 * that triggered this (through a nested disconnect) can still step past it. */
void gpd_waiter_remove(gpd_waiter *w) {
  gpd_conn *c = w->conn;
  gpd_server *s = c->srv;
  wqueue *q = w->q;
  if (w->removed)
    return;
  w->removed = 1;
  if (q->name) {
    if (w->hidx != NOT_IN_HEAP)
      heap_del(q, w);
  } else {
    list_unlink(q, w);
  }
  GPUPOOL__LIST_UNLINK(c->waiters, w, cprev, cnext);
  c->nwaiters--;
  c->u->waiters--;
  if (q->name && !q->n && !q->waking)
    get_q_free(s, q);
  else if (q->copy_id && !q->head && !q->waking)
    copy_q_free(s, q);
  uv_timer_stop(&w->timer);
  uv_close((uv_handle_t *)&w->timer, waiter_closed);
}

static int body_of(int kind) {
  switch (kind) {
  case WAIT_ALLOC: return GPUPOOL__WIRE__REQUEST__BODY_ALLOCATE;
  case WAIT_GET: return GPUPOOL__WIRE__REQUEST__BODY_GET;
  case WAIT_BGET: return GPUPOOL__WIRE__REQUEST__BODY_GET_BUNDLE;
  case WAIT_GET_FILE: return GPUPOOL__WIRE__REQUEST__BODY_GET_FILE;
  default: return GPUPOOL__WIRE__REQUEST__BODY_ALLOCATE_BUNDLE;
  }
}

/* Try a waiting allocation (single or bundle) now: 0 and the reply sent, or the error. */
static int try_alloc(gpd_waiter *w) {
  gpd_conn *c = w->conn;
  gpd_registry *reg = c->srv->reg;
  int rc;
  if (w->kind == WAIT_ABUNDLE) {
    gpd_hold **hs = NULL;
    if ((rc = gpd_bundle_allocate(reg, &c->cl, w->plan, &hs)) == 0) {
      gpd_srv_reply_bundle(c, w->seq, WAIT_ABUNDLE, hs, w->plan->nchunks, w->plan->layout, NULL, 0);
      free(hs);
    }
    return rc;
  }
  gpd_hold *h = NULL;
  if ((rc = gpd_allocate(reg, &c->cl, w->pool, w->size, w->align, &h)) == 0)
    gpd_srv_reply_hold(c, w->seq, WAIT_ALLOC, h, NULL, 0);
  return rc;
}

/* Try a waiting get now: 0 and the reply sent, or the error (ENOENT: keep waiting; EBUSY: wait
 * for copy *copy_id, the replica it needs). Each try is the request's again: its name is
 * resolved once for it, under the configuration of now. */
static int try_get(gpd_waiter *w, uint64_t *copy_id) {
  gpd_conn *c = w->conn;
  gpd_registry *reg = c->srv->reg;
  gpd_rname rn;
  int rc;
  gpd_name_key(reg, &c->cl, w->name, &rn); /* an error is told where the name is used */
  if (w->kind == WAIT_GET_FILE)
    return gpd_file_get_start(c, w->seq, &rn, 0); /* answered once the file was looked at */
  if (w->kind == WAIT_BGET) {
    gpd_hold **hs = NULL;
    const gpd_name *nm = NULL;
    if ((rc = gpd_get_bundle_on(reg, &c->cl, &rn, w->read_only, w->newer_than, w->device, &hs, &nm,
                                copy_id)) == 0) {
      gpd_srv_reply_bundle(c, w->seq, WAIT_BGET, hs, nm->nbufs, nm->layout, nm, w->known_layout);
      free(hs);
    }
    return rc;
  }
  gpd_hold *h = NULL;
  uint64_t version = 0;
  if ((rc = gpd_get_on(reg, &c->cl, &rn, w->read_only, w->newer_than, w->device, &h, &version, copy_id)) == 0)
    gpd_srv_reply_hold(c, w->seq, WAIT_GET, h, &rn, version);
  return rc;
}

static void waiter_timeout(uv_timer_t *t) {
  gpd_waiter *w = t->data;
  gpd_conn *c = w->conn;
  char msg[GPUPOOL__ERRMSG_MAX];
  if (w->kind == WAIT_ALLOC || w->kind == WAIT_ABUNDLE) {
    /* One last try, so the error says exactly how much is free now. */
    int rc = try_alloc(w);
    if (rc != 0) {
      snprintf(msg, sizeof msg, "timed out after %" PRIu64 " ms waiting for memory: %s",
               (gpd_now_ns() - w->started_ns) / 1000000, gpupool__errmsg());
      gpd_send_error(c, w->seq, rc == GPUPOOL_ENOSPC ? GPUPOOL_ETIMEDOUT : rc, msg);
    }
    gpd_metrics_request(c->srv->metrics, body_of(w->kind), rc == 0 ? 0 : GPUPOOL_ETIMEDOUT,
                             gpd_now_ns() - w->started_ns);
  } else {
    if (w->q->copy_id)
      snprintf(msg, sizeof msg, "timed out after %" PRIu64 " ms waiting for the replica of '%s' on device %d to be "
               "copied (it goes on for the other getters; a later get finds it)",
               (gpd_now_ns() - w->started_ns) / 1000000, w->name, w->device);
    else if (w->newer_than)
      snprintf(msg, sizeof msg, "timed out after %" PRIu64 " ms waiting for a version of '%s' newer than %" PRIu64,
               (gpd_now_ns() - w->started_ns) / 1000000, w->name, w->newer_than);
    else
      snprintf(msg, sizeof msg, "timed out after %" PRIu64 " ms waiting for a producer to publish '%s'",
               (gpd_now_ns() - w->started_ns) / 1000000, w->name);
    gpd_send_error(c, w->seq, GPUPOOL_ETIMEDOUT, msg);
    gpd_metrics_request(c->srv->metrics, body_of(w->kind), GPUPOOL_ETIMEDOUT, gpd_now_ns() - w->started_ns);
  }
  gpd_waiter_remove(w);
}

int gpd_waiter_limits(gpd_conn *c) {
  const gpd_config *cfg = c->srv->cfg;
  if (cfg->max_waiters_per_client && c->nwaiters >= cfg->max_waiters_per_client)
    return gpupool__err(GPUPOOL_ELIMIT,
                        "this client already has %u requests waiting, the limit (max_waiters_per_client) "
                        "is %u; wait for them to finish or time out", c->nwaiters, cfg->max_waiters_per_client);
  if (cfg->max_waiters_per_uid && c->u->waiters >= cfg->max_waiters_per_uid) {
    char who[80];
    gpd_tenant_label(cfg, c->cl.tenant, who, sizeof who);
    return gpupool__err(GPUPOOL_ELIMIT, "%s already has %u requests waiting, the limit (max_waiters_per_uid) is %u",
                        who, c->u->waiters, cfg->max_waiters_per_uid);
  }
  return 0;
}

/* Queue a request to be retried. For WAIT_ABUNDLE it takes over plan (also on error). */
int gpd_waiter_add(gpd_conn *c, uint64_t seq, int kind, uint32_t timeout_ms, gpd_pool *pool,
                        uint64_t size, uint64_t align, const gpd_rname *rn, int read_only, uint64_t newer_than,
                        gpd_bundle_plan *plan) {
  gpd_server *s = c->srv;
  gpd_waiter *w;
  wqueue *q;
  const char *name = rn ? rn->name : NULL, *key = rn ? rn->key : NULL;
  uint64_t owner;
  int rc;

  if ((rc = gpd_waiter_limits(c)) != 0) {
    gpd_bundle_plan_free(plan);
    return rc;
  }
  /* Gets wait filed under the name's key in the caller's namespace: what a publish there wakes. */
  if (kind != WAIT_ALLOC && kind != WAIT_ABUNDLE && (rc = gpd_rname_ok(rn)) != 0)
    return rc;
  if (kind == WAIT_ALLOC || kind == WAIT_ABUNDLE) {
    int idx = (int)(pool - s->reg->pools);
    uint64_t akey;
    if ((rc = gpd_pool_owner(s->reg, &c->cl, pool, &owner)) != 0) {
      gpd_bundle_plan_free(plan);
      return rc;
    }
    akey = owner * 64 + (uint64_t)idx;
    if (!(q = gpupool__hmap_get(&s->alloc_q, akey))) {
      if (!(q = calloc(1, sizeof *q)) || gpupool__hmap_put(&s->alloc_q, akey, q) != 0) {
        free(q);
        gpd_bundle_plan_free(plan);
        return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
      }
      q->akey = akey;
      q->anext = s->alloc_lists[idx];
      s->alloc_lists[idx] = q;
    }
  } else if (!(q = gpupool__smap_get(&s->get_q, key))) {
    if (!(q = calloc(1, sizeof *q)) || !(q->name = strdup(key)) || gpupool__smap_put(&s->get_q, key, q) != 0) {
      if (q)
        free(q->name);
      free(q);
      return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
    }
  }
  w = calloc(1, sizeof *w);
  if (w) {
    w->newer_than = newer_than;
    w->order = s->waiter_order++;
  }
  if (w)
    w->device = -1;
  if (!w || (name && !(w->name = strdup(name))) || (q->name && heap_push(q, w) != 0)) {
    if (w)
      free(w->name);
    free(w);
    gpd_bundle_plan_free(plan);
    if (q->name && !q->n && !q->waking)
      get_q_free(s, q);
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  }
  w->conn = c;
  w->seq = seq;
  w->kind = kind;
  w->pool = pool;
  w->size = size;
  w->align = align;
  w->read_only = read_only;
  w->plan = plan;
  w->started_ns = gpd_now_ns();
  w->q = q;
  uv_timer_init(s->loop, &w->timer);
  w->timer.data = w;
  if (timeout_ms != WAIT_FOREVER)
    uv_timer_start(&w->timer, waiter_timeout, timeout_ms, 0);
  if (!q->name) {
    w->hidx = NOT_IN_HEAP;
    w->prev = q->tail;
    if (q->tail)
      q->tail->next = w;
    else
      q->head = w;
    q->tail = w;
  }
  w->cnext = c->waiters;
  if (c->waiters)
    c->waiters->cprev = w;
  c->waiters = w;
  c->nwaiters++;
  c->u->waiters++;
  return 0;
}

/* Serve waiting allocations in FIFO order per pool and owner: each owner's head is tried
 * only when the pool has room for it, and a head that still does not fit keeps that owner's
 * later requests waiting behind it (but no other owner's). Empty queues are freed here, at
 * the start of a pass, never while one runs (a nested disconnect may empty any of them). */
static void retry_pool(gpd_server *s, int idx) {
  wqueue **pq = &s->alloc_lists[idx], *q;
  while ((q = *pq)) {
    if (q->head) {
      pq = &q->anext;
      continue;
    }
    *pq = q->anext;
    gpupool__hmap_del(&s->alloc_q, q->akey);
    free(q);
  }
  for (q = s->alloc_lists[idx]; q; q = q->anext) {
    while (q->head) {
      gpd_waiter *w = q->head;
      int rc;
      if (w->conn->closing || gpd_pool_free_bytes(w->pool) < w->size)
        break;
      rc = try_alloc(w);
      if (rc == GPUPOOL_ENOSPC)
        break;
      if (rc != 0)
        gpd_send_error(w->conn, w->seq, rc, gpupool__errmsg());
      gpd_metrics_request(s->metrics, body_of(w->kind), rc, gpd_now_ns() - w->started_ns);
      gpd_waiter_remove(w);
    }
  }
}

void gpd_retry_waiters(gpd_registry *reg, gpd_pool *pool) {
  gpd_server *s = reg->owner;
  (void)pool;
  if (!s || s->in_retry)
    return; /* the running pass picks up what a nested free returned */
  s->in_retry = 1;
  while (reg->memory_returned) {
    reg->memory_returned = 0;
    for (int i = 0; i < reg->npools; i++)
      retry_pool(s, i);
  }
  s->in_retry = 0;
}

static int by_arrival(const void *a, const void *b) {
  uint64_t x = (*(gpd_waiter *const *)a)->order, y = (*(gpd_waiter *const *)b)->order;
  return x < y ? -1 : x > y;
}

/* Answer one waiting get that a publish reached (already out of q's heap): 1 when it must
 * wait on after all (the name went away meanwhile), and it is back in the heap. */
static int serve_get(gpd_server *s, wqueue *q, gpd_waiter *w) {
  uint64_t copy_id = 0;
  int rc;
  if (w->removed || w->conn->closing)
    return 0; /* a nested disconnect took it after it was popped */
  s->gets_tried++;
  rc = try_get(w, &copy_id);
  if (rc == GPUPOOL_ENOENT) {
    if ((rc = heap_push(q, w)) == 0)
      return 1;
  }
  if (rc == GPUPOOL_EBUSY && (rc = gpd_waiter_on_copy(w, copy_id)) == 0) {
    s->gets_answered++; /* this publish is done with it: the copy's end answers it */
    return 0;
  }
  s->gets_answered++;
  if (rc != 0)
    gpd_send_error(w->conn, w->seq, rc, gpupool__errmsg());
  gpd_metrics_request(s->metrics, body_of(w->kind), rc, gpd_now_ns() - w->started_ns);
  gpd_waiter_remove(w);
  return 0;
}

/* Serve the gets waiting for key (a name in one namespace) now that it is at version: those
 * waiting for an older one, and no other (they stay in the heap untouched), in the order they
 * came. */
void gpd_wake_getters(gpd_server *s, const char *key, uint64_t version) {
  wqueue *q = gpupool__smap_get(&s->get_q, key);
  gpd_waiter **batch;
  uint32_t m = 0;
  if (!q || !q->n || q->heap[0]->newer_than >= version)
    return;
  /* The queue stays (even empty) while this pass holds waiters popped from it. */
  q->waking++;
  if ((batch = malloc(q->n * sizeof *batch))) {
    while (q->n && q->heap[0]->newer_than < version) {
      batch[m++] = q->heap[0];
      heap_del(q, q->heap[0]);
    }
    /* The heap pops by version first: put them back in arrival order. */
    if (m > 1)
      qsort(batch, m, sizeof *batch, by_arrival);
    for (uint32_t i = 0; i < m; i++)
      serve_get(s, q, batch[i]);
    free(batch);
  } else {
    /* Out of memory for the batch: one at a time, FIFO within each version waited for. */
    while (q->n && q->heap[0]->newer_than < version) {
      gpd_waiter *w = q->heap[0];
      heap_del(q, w);
      if (serve_get(s, q, w))
        break;
    }
  }
  if (--q->waking == 0 && !q->n)
    get_q_free(s, q);
}

/* ---- gets waiting for a replica ---- */

int gpd_waiter_on_copy(gpd_waiter *w, uint64_t copy_id) {
  gpd_server *s = w->conn->srv;
  wqueue *old = w->q, *q = gpupool__hmap_get(&s->copy_q, copy_id);
  if (!q) {
    if (!(q = calloc(1, sizeof *q)) || gpupool__hmap_put(&s->copy_q, copy_id, q) != 0) {
      free(q);
      return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
    }
    q->copy_id = copy_id;
  }
  if (old->name) {
    if (w->hidx != NOT_IN_HEAP)
      heap_del(old, w);
    if (!old->n && !old->waking)
      get_q_free(s, old);
  } else {
    list_unlink(old, w);
    if (old->copy_id && !old->head && !old->waking)
      copy_q_free(s, old);
  }
  w->hidx = NOT_IN_HEAP;
  w->q = q;
  list_append(q, w);
  return 0;
}

void gpd_copy_ended(gpd_registry *reg, uint64_t copy_id, int rc, const char *msg) {
  gpd_server *s = reg->owner;
  wqueue *q = s ? gpupool__hmap_get(&s->copy_q, copy_id) : NULL;
  gpd_waiter *w;
  char why[GPUPOOL__ERRMSG_MAX];
  if (!q)
    return;
  q->waking++;
  /* Each waiter leaves q below (answered, or on to another copy): the loop ends. */
  while ((w = q->head)) {
    uint64_t next = 0;
    int r = rc;
    if (w->removed || w->conn->closing) {
      gpd_waiter_remove(w);
      continue;
    }
    if (r == 0) {
      r = try_get(w, &next);
      if (r == GPUPOOL_EBUSY && next != copy_id && (r = gpd_waiter_on_copy(w, next)) == 0)
        continue;
      if (r == GPUPOOL_EBUSY)
        r = gpupool__err(GPUPOOL_EBACKEND, "the replica of '%s' is not ready after its copy ended", w->name);
      snprintf(why, sizeof why, "%s", r ? gpupool__errmsg() : "");
    } else {
      snprintf(why, sizeof why, "copying the replica of '%s' to device %d failed: %s; the next get starts a new "
               "copy", w->name, w->device, msg);
    }
    if (r != 0)
      gpd_send_error(w->conn, w->seq, r, why);
    gpd_metrics_request(s->metrics, body_of(w->kind), r, gpd_now_ns() - w->started_ns);
    gpd_waiter_remove(w);
  }
  if (--q->waking == 0 && !q->head)
    copy_q_free(s, q);
}

void gpd_fail_getters(gpd_server *s, const char *key, int code, const char *msg, int only_nowait) {
  wqueue *q = gpupool__smap_get(&s->get_q, key);
  gpd_waiter **batch;
  uint32_t m = 0;
  if (!q || !q->n)
    return;
  q->waking++;
  if ((batch = malloc(q->n * sizeof *batch))) {
    for (uint32_t i = 0; i < q->n; i++)
      if (!only_nowait || q->heap[i]->peer_nowait)
        batch[m++] = q->heap[i];
    if (m > 1)
      qsort(batch, m, sizeof *batch, by_arrival);
    for (uint32_t i = 0; i < m; i++) {
      gpd_waiter *w = batch[i];
      if (w->removed || w->conn->closing)
        continue;
      gpd_send_error(w->conn, w->seq, code, msg);
      gpd_metrics_request(s->metrics, body_of(w->kind), code, gpd_now_ns() - w->started_ns);
      gpd_waiter_remove(w);
    }
    free(batch);
  }
  if (--q->waking == 0 && !q->n)
    get_q_free(s, q);
}

/* A name got a new version: serve the gets waiting for it first (they are the handoff's
 * critical path), before the publisher's own reply. */
void gpd_published(gpd_conn *c, const gpd_rname *rn, uint64_t version) {
  if (rn->rc == 0) {
    gpd_wake_getters(c->srv, rn->key, version);
    gpd_peers_published(c->srv, rn->key, version);
  }
}
