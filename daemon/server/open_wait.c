/*
 * Opens that wait for a share on its way. A sender that does not wait for its Share's reply
 * (Share.from_reserve: it made the tokens itself, from ids reserved for its connection) hands
 * a token on at once, so a receiver's Open may be read before that Share is, although the
 * Share was written first. Such an Open waits here, filed under the id it needs, until:
 * the share of that id is read (it is tried again: answered, or filed under the next id it
 * needs), its sharer disconnects or gives its reserve up (it fails at once, saying so), or
 * open_wait_ms passes (it fails with ETIMEDOUT). A waiting Open counts as a waiting request
 * of its connection and uid (max_waiters_per_client, max_waiters_per_uid), and a share wakes
 * only the Opens of the ids it made: what others park on a connection's ids costs that
 * connection's shares nothing beyond a lookup per id.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "list.h"
#include "server_internal.h"

struct opwait {
  gpd_conn *conn;
  uint64_t seq;
  uint64_t id;            /* the reserved id it waits for */
  uint64_t sharer;        /* the connection (client id) that reserved it */
  int sharer_pid;
  int read_only;
  size_t n;
  uint8_t **toks;         /* the request's n tokens (copies), and their lengths */
  size_t *lens;
  uint64_t started_ns;
  uv_timer_t timer;
  int removed;
  int filed;              /* in s->open_q under id */
  opwait *next, *prev;    /* the others waiting for id (s->open_q), in no order (one opens it) */
  opwait *cnext, *cprev;  /* the others of conn */
};

/* w and its copies of the tokens (those not made yet are NULL). */
static void opwait_free(opwait *w) {
  for (size_t i = 0; w->toks && i < w->n; i++)
    free(w->toks[i]);
  free(w->toks);
  free(w->lens);
  free(w);
}

static void opwait_closed(uv_handle_t *h) { opwait_free(h->data); }

/* Out of its id's list and its connection's; freed once its timer is closed. */
static void opwait_remove(opwait *w) {
  gpd_conn *c = w->conn;
  gpd_server *s = c->srv;
  if (w->removed)
    return;
  w->removed = 1;
  if (w->filed) {
    if (w->prev)
      w->prev->next = w->next;
    else if (w->next)
      gpupool__hmap_put(&s->open_q, w->id, w->next); /* replaces the entry: allocates nothing */
    else
      gpupool__hmap_del(&s->open_q, w->id);
    if (w->next)
      w->next->prev = w->prev;
    w->filed = 0;
  }
  w->next = w->prev = NULL;
  GPUPOOL__LIST_UNLINK(c->opwaits, w, cprev, cnext);
  c->nwaiters--;
  c->u->waiters--;
  s->opens_waiting--;
  uv_timer_stop(&w->timer);
  uv_close((uv_handle_t *)&w->timer, opwait_closed);
}

static void answered(opwait *w, int rc) {
  gpd_metrics_request(w->conn->srv->metrics, GPUPOOL__WIRE__REQUEST__BODY_OPEN, rc, gpd_now_ns() - w->started_ns);
}

/* Files w (not in any list) under id, whose sharer is x. */
static int opwait_file(gpd_server *s, opwait *w, uint64_t id, const gpd_client *x) {
  opwait *head = gpupool__hmap_get(&s->open_q, id);
  w->id = id;
  w->sharer = x->id;
  w->sharer_pid = (int)x->pid;
  w->next = w->prev = NULL;
  if (!head) {
    if (gpupool__hmap_put(&s->open_q, id, w) != 0)
      return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  } else {
    /* Second in the list (the head stays the table's entry): only one of them can open the
     * share, so their order does not matter. */
    w->next = head->next;
    w->prev = head;
    if (head->next)
      head->next->prev = w;
    head->next = w;
  }
  w->filed = 1;
  return 0;
}

static void opwait_timeout(uv_timer_t *t) {
  opwait *w = t->data;
  char msg[GPUPOOL__ERRMSG_MAX];
  snprintf(msg, sizeof msg,
           "timed out after %" PRIu64 " ms (open_wait_ms) waiting for the share of a token its sender (client %" PRIu64
           ", pid %d) handed on before gpupoold had read the share; the sender is stuck, or the token was "
           "made up",
           (gpd_now_ns() - w->started_ns) / 1000000, w->sharer, w->sharer_pid);
  gpd_send_error(w->conn, w->seq, GPUPOOL_ETIMEDOUT, msg);
  answered(w, GPUPOOL_ETIMEDOUT);
  opwait_remove(w);
}

int gpd_open_park(gpd_conn *c, uint64_t seq, const uint8_t *const *toks, const size_t *lens, size_t n,
                  int read_only, uint64_t id) {
  gpd_server *s = c->srv;
  gpd_client *x = gpd_reserve_owner(s->reg, id);
  opwait *w;
  int rc;
  if (!x) /* cannot happen: the registry just said it is reserved */
    return gpupool__err(GPUPOOL_ENOENT, "share token names no live share");
  if ((rc = gpd_waiter_limits(c)) != 0)
    return rc;
  if (!(w = calloc(1, sizeof *w)))
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  w->n = n;
  if (!(w->toks = calloc(n, sizeof *w->toks)) || !(w->lens = calloc(n, sizeof *w->lens))) {
    opwait_free(w);
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  }
  for (size_t i = 0; i < n; i++) {
    if (!(w->toks[i] = malloc(lens[i] ? lens[i] : 1))) {
      opwait_free(w);
      return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
    }
    memcpy(w->toks[i], toks[i], lens[i]);
    w->lens[i] = lens[i];
  }
  w->conn = c;
  w->seq = seq;
  w->read_only = read_only;
  w->started_ns = gpd_now_ns();
  if ((rc = opwait_file(s, w, id, x)) != 0) {
    opwait_free(w);
    return rc;
  }
  uv_timer_init(s->loop, &w->timer);
  w->timer.data = w;
  uv_timer_start(&w->timer, opwait_timeout, s->cfg->open_wait_ms, 0);
  w->cnext = c->opwaits;
  if (c->opwaits)
    c->opwaits->cprev = w;
  c->opwaits = w;
  c->nwaiters++;
  c->u->waiters++;
  s->opens_waited++;
  s->opens_waiting++;
  return 0;
}

/* Try w again (out of its list): answered, or filed under the next id it waits for. */
static void opwait_retry(opwait *w) {
  gpd_server *s = w->conn->srv;
  uint64_t id = 0;
  int rc;
  if (w->conn->closing) {
    opwait_remove(w);
    return;
  }
  gpupool__err_clear();
  rc = gpd_open_now(w->conn, w->seq, (const uint8_t *const *)w->toks, w->lens, w->n, w->read_only, &id);
  if (rc == GPD_OPEN_PENDING) {
    gpd_client *x = gpd_reserve_owner(s->reg, id);
    if (x && opwait_file(s, w, id, x) == 0)
      return; /* waits on, with its timer and place as they were */
    rc = gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  }
  if (rc != 0)
    gpd_send_error(w->conn, w->seq, rc, gpupool__errmsg());
  answered(w, rc);
  opwait_remove(w);
}

/* The Opens waiting for id, taken out of s->open_q (linked by next, in arrival order). */
static opwait *take(gpd_server *s, uint64_t id) {
  opwait *head = gpupool__hmap_del(&s->open_q, id);
  /* Out of the table: opwait_remove must not touch the entry (a new one may be filed). */
  for (opwait *w = head; w; w = w->next)
    w->filed = 0;
  return head;
}

void gpd_opens_shared(gpd_server *s, uint64_t first, size_t n) {
  if (!s->open_q.len)
    return;
  for (size_t i = 0; i < n; i++) {
    opwait *w = take(s, first + i), *next;
    for (; w; w = next) {
      next = w->next;
      w->next = w->prev = NULL;
      if (!w->removed) /* (a reply before it may have closed its connection) */
        opwait_retry(w);
    }
  }
}

void gpd_opens_unreserved(gpd_server *s, const gpd_client *x, uint64_t from, uint64_t end, const char *why) {
  char msg[GPUPOOL__ERRMSG_MAX];
  if (!s->open_q.len)
    return;
  for (uint64_t id = from; id < end; id++) {
    opwait *w = take(s, id), *next;
    for (; w; w = next) {
      next = w->next;
      w->next = w->prev = NULL;
      if (w->removed)
        continue;
      snprintf(msg, sizeof msg,
               "share token names no share: its sender (client %" PRIu64 ", pid %d) handed it on before "
               "gpupoold had read the share, then %s without sharing it",
               x->id, (int)x->pid, why);
      gpd_send_error(w->conn, w->seq, GPUPOOL_ENOENT, msg);
      answered(w, GPUPOOL_ENOENT);
      opwait_remove(w);
    }
  }
}

void gpd_opens_drop(gpd_conn *c) {
  while (c->opwaits)
    opwait_remove(c->opwaits);
}
