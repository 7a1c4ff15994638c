/*
 * gpupoold's connections: accept, peer credentials, handshake, framing, dispatch, replies,
 * waiting requests and disconnects. Single-threaded on the libuv loop; never blocks on a
 * client (replies that do not fit in the socket are queued and flushed when writable).
 *
 * A connection is freed only from its handles' close callbacks, never inside its own
 * callback. A client that breaks the protocol gets an error reply and is dropped; one whose
 * request is merely wrong gets an error reply and carries on.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "errors.h"
#include "log.h"
#include "metrics.h"
#include "server.h"

#define MAX_TX_QUEUE (64u << 20)
#define WAIT_FOREVER UINT32_MAX

typedef struct tx_frame {
  struct tx_frame *next;
  uint8_t *buf;
  size_t len, off;
  int fds[GPUPOOL_WIRE_MAX_FDS];
  int nfds;
} tx_frame;

typedef struct gpupool__conn gpupool__conn;

enum { WAIT_ALLOC = 1, WAIT_GET = 2 };

typedef struct gpupool__waiter {
  gpupool__conn *conn;
  uint64_t seq;
  int kind;
  gpupool__pool *pool;
  uint64_t size, align;
  char *name;
  int read_only;
  uint64_t started_ns;
  uv_timer_t timer;
  int removed;
  struct gpupool__waiter *prev, *next;
} gpupool__waiter;

struct gpupool__conn {
  gpupool__client cl;
  gpupool__server *srv;
  int fd;
  uv_poll_t poll;
  int poll_events;
  uv_timer_t hs_timer;
  int handles_open;
  gpupool__wire_inbuf in;
  int fds_pending;   /* fds arrived (and were closed): refuse the next frame with EFD */
  tx_frame *txq, *txq_tail;
  size_t tx_bytes;
  int hello_done;
  int closing;
  int drop_after_flush;
  gpupool__conn *prev, *next;
};

struct gpupool__server {
  uv_loop_t *loop;
  const gpupool__config *cfg;
  gpupool__registry *reg;
  int listen_fd;
  int own_socket;
  uv_poll_t listen_poll;
  int listen_open;
  gpupool__conn *conns;
  uint64_t nconns;
  gpupool__waiter *waiters;
  uint64_t requests, errors;
  uint64_t started_ns;
  int stopping;
  int in_retry;
  uint64_t last_activity_ns;
};

static void conn_close(gpupool__conn *c, const char *why);
static void conn_update_poll(gpupool__conn *c);
static void retry_waiters(gpupool__registry *reg, gpupool__pool *pool);

uint64_t gpupool__server_clients(const gpupool__server *s) { return s->nconns; }
uint64_t gpupool__server_last_activity(const gpupool__server *s) { return s->last_activity_ns; }

static uint64_t count_open_fds(void) {
  DIR *d = opendir("/proc/self/fd");
  struct dirent *e;
  uint64_t n = 0;
  if (!d)
    return 0;
  while ((e = readdir(d)))
    if (e->d_name[0] != '.')
      n++;
  closedir(d);
  return n > 0 ? n - 1 : 0; /* not counting the directory's own fd */
}

/* ---- sending -------------------------------------------------------------------------------- */

static void tx_free(tx_frame *f) {
  for (int i = 0; i < f->nfds; i++)
    if (f->fds[i] >= 0)
      close(f->fds[i]);
  free(f->buf);
  free(f);
}

/* Queue or send a packed frame; takes buf. fds are duplicated (the originals stay the caller's). */
static void conn_send(gpupool__conn *c, uint8_t *buf, size_t len, const int *fds, int nfds) {
  tx_frame *f;
  size_t off = 0;

  if (c->closing) {
    free(buf);
    return;
  }
  if (!c->txq) {
    int rc = gpupool__wire_send_some(c->fd, buf, len, &off, fds, nfds);
    if (rc == 1) {
      free(buf);
      return;
    }
    if (rc < 0) {
      free(buf);
      conn_close(c, "write failed");
      return;
    }
  }
  f = calloc(1, sizeof *f);
  if (!f) {
    free(buf);
    conn_close(c, "out of memory queueing a reply");
    return;
  }
  f->buf = buf;
  f->len = len;
  f->off = off;
  if (off == 0)
    for (int i = 0; i < nfds; i++) {
      f->fds[i] = fcntl(fds[i], F_DUPFD_CLOEXEC, 3);
      if (f->fds[i] < 0) {
        f->nfds = i;
        tx_free(f);
        conn_close(c, "cannot duplicate an fd for a queued reply");
        return;
      }
      f->nfds = i + 1;
    }
  if (c->txq_tail)
    c->txq_tail->next = f;
  else
    c->txq = f;
  c->txq_tail = f;
  c->tx_bytes += len - off;
  if (c->tx_bytes > MAX_TX_QUEUE) {
    conn_close(c, "client does not read its replies (more than 64 MiB queued)");
    return;
  }
  conn_update_poll(c);
}

static void conn_flush(gpupool__conn *c) {
  while (c->txq) {
    tx_frame *f = c->txq;
    size_t before = f->off;
    int rc = gpupool__wire_send_some(c->fd, f->buf, f->len, &f->off, f->fds, f->off == 0 ? f->nfds : 0);
    c->tx_bytes -= f->off - before;
    if (rc == 0)
      break;
    if (rc < 0) {
      conn_close(c, "write failed");
      return;
    }
    c->txq = f->next;
    if (!c->txq)
      c->txq_tail = NULL;
    tx_free(f);
  }
  if (!c->txq && c->drop_after_flush) {
    conn_close(c, "protocol violation");
    return;
  }
  conn_update_poll(c);
}

static void send_reply(gpupool__conn *c, uint64_t seq, Gpupool__Wire__Reply *rep, const int *fds, int nfds) {
  uint8_t *buf;
  size_t len;
  rep->seq = seq;
  /* Piggyback slab revocations on every reply. */
  rep->n_revoke_slabs = c->cl.nrevoke;
  rep->revoke_slabs = c->cl.revoke;
  if (gpupool__wire_pack_reply(rep, &buf, &len) != 0) {
    conn_close(c, "cannot pack a reply");
    return;
  }
  c->cl.nrevoke = 0;
  conn_send(c, buf, len, fds, nfds);
}

static void send_error(gpupool__conn *c, uint64_t seq, int code, const char *msg) {
  Gpupool__Wire__Reply rep = GPUPOOL__WIRE__REPLY__INIT;
  Gpupool__Wire__Error err = GPUPOOL__WIRE__ERROR__INIT;
  err.code = code;
  err.message = (char *)(msg && *msg ? msg : gpupool_strerror(code));
  rep.error = &err;
  c->srv->errors++;
  send_reply(c, seq, &rep, NULL, 0);
}

/* ---- waiting requests ----------------------------------------------------------------------- */

static void waiter_closed(uv_handle_t *h) {
  gpupool__waiter *w = h->data;
  free(w->name);
  free(w);
}

/* Unlinks w; its memory stays valid until the timer's close callback, so a loop over the
 * waiters that triggered this (through a nested disconnect) can still step past it. */
static void waiter_remove(gpupool__waiter *w) {
  gpupool__server *s = w->conn->srv;
  if (w->removed)
    return;
  w->removed = 1;
  if (w->prev)
    w->prev->next = w->next;
  else
    s->waiters = w->next;
  if (w->next)
    w->next->prev = w->prev;
  uv_timer_stop(&w->timer);
  uv_close((uv_handle_t *)&w->timer, waiter_closed);
}

static void reply_hold(gpupool__conn *c, uint64_t seq, int kind, gpupool__hold *h, const char *name);

static void waiter_timeout(uv_timer_t *t) {
  gpupool__waiter *w = t->data;
  gpupool__conn *c = w->conn;
  char msg[GPUPOOL__ERRMSG_MAX];
  if (w->kind == WAIT_ALLOC) {
    gpupool__hold *h = NULL;
    /* One last try, so the error says exactly how much is free now. */
    int rc = gpupool__allocate(c->srv->reg, &c->cl, w->pool, w->size, w->align, &h);
    if (rc == 0) {
      reply_hold(c, w->seq, WAIT_ALLOC, h, NULL);
    } else {
      snprintf(msg, sizeof msg, "timed out after %" PRIu64 " ms waiting for memory: %s",
               (gpupool__now_ns() - w->started_ns) / 1000000, gpupool__errmsg());
      send_error(c, w->seq, rc == GPUPOOL_ENOSPC ? GPUPOOL_ETIMEDOUT : rc, msg);
    }
    gpupool__metrics_request(GPUPOOL__WIRE__REQUEST__BODY_ALLOCATE, rc == 0 ? 0 : GPUPOOL_ETIMEDOUT,
                             gpupool__now_ns() - w->started_ns);
  } else {
    snprintf(msg, sizeof msg, "timed out after %" PRIu64 " ms waiting for a producer to publish '%s'",
             (gpupool__now_ns() - w->started_ns) / 1000000, w->name);
    send_error(c, w->seq, GPUPOOL_ETIMEDOUT, msg);
    gpupool__metrics_request(GPUPOOL__WIRE__REQUEST__BODY_GET, GPUPOOL_ETIMEDOUT, gpupool__now_ns() - w->started_ns);
  }
  waiter_remove(w);
}

static int waiter_add(gpupool__conn *c, uint64_t seq, int kind, uint32_t timeout_ms, gpupool__pool *pool,
                      uint64_t size, uint64_t align, const char *name, int read_only) {
  gpupool__server *s = c->srv;
  gpupool__waiter *w = calloc(1, sizeof *w), **tail;
  if (!w || (name && !(w->name = strdup(name)))) {
    free(w);
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  }
  w->conn = c;
  w->seq = seq;
  w->kind = kind;
  w->pool = pool;
  w->size = size;
  w->align = align;
  w->read_only = read_only;
  w->started_ns = gpupool__now_ns();
  uv_timer_init(s->loop, &w->timer);
  w->timer.data = w;
  if (timeout_ms != WAIT_FOREVER)
    uv_timer_start(&w->timer, waiter_timeout, timeout_ms, 0);
  /* FIFO: append. */
  for (tail = &s->waiters; *tail; tail = &(*tail)->next)
    w->prev = *tail;
  *tail = w;
  return 0;
}

static void retry_waiters(gpupool__registry *reg, gpupool__pool *pool) {
  gpupool__server *s = reg->owner;
  (void)pool;
  if (!s || s->in_retry)
    return; /* the running pass picks up what a nested free returned */
  s->in_retry = 1;
  while (reg->memory_returned) {
    gpupool__waiter *w, *next;
    reg->memory_returned = 0;
    for (w = s->waiters; w; w = next) {
      gpupool__hold *h;
      int rc;
      next = w->next;
      if (w->removed || w->kind != WAIT_ALLOC || w->conn->closing)
        continue;
      rc = gpupool__allocate(reg, &w->conn->cl, w->pool, w->size, w->align, &h);
      if (rc == GPUPOOL_ENOSPC)
        continue;
      if (rc == 0)
        reply_hold(w->conn, w->seq, WAIT_ALLOC, h, NULL);
      else
        send_error(w->conn, w->seq, rc, gpupool__errmsg());
      gpupool__metrics_request(GPUPOOL__WIRE__REQUEST__BODY_ALLOCATE, rc, gpupool__now_ns() - w->started_ns);
      next = w->next;
      waiter_remove(w);
    }
  }
  s->in_retry = 0;
}

static void wake_getters(gpupool__server *s, const char *name) {
  gpupool__waiter *w, *next;
  for (w = s->waiters; w; w = next) {
    gpupool__hold *h = NULL;
    int rc;
    next = w->next;
    if (w->removed || w->kind != WAIT_GET || w->conn->closing || strcmp(w->name, name) != 0)
      continue;
    rc = gpupool__get(s->reg, &w->conn->cl, name, w->read_only, &h);
    if (rc == GPUPOOL_ENOENT)
      continue; /* published, but not visible to this client */
    if (rc == 0)
      reply_hold(w->conn, w->seq, WAIT_GET, h, name);
    else
      send_error(w->conn, w->seq, rc, gpupool__errmsg());
    gpupool__metrics_request(GPUPOOL__WIRE__REQUEST__BODY_GET, rc, gpupool__now_ns() - w->started_ns);
    waiter_remove(w);
  }
}

/* ---- replies carrying a buffer -------------------------------------------------------------- */

static void reply_hold(gpupool__conn *c, uint64_t seq, int kind, gpupool__hold *h, const char *name) {
  Gpupool__Wire__Reply rep = GPUPOOL__WIRE__REPLY__INIT;
  Gpupool__Wire__AllocateReply ar = GPUPOOL__WIRE__ALLOCATE_REPLY__INIT;
  Gpupool__Wire__GetReply gr = GPUPOOL__WIRE__GET_REPLY__INIT;
  Gpupool__Wire__OpenReply orp = GPUPOOL__WIRE__OPEN_REPLY__INIT;
  gpupool__desc_storage ds;

  gpupool__fill_desc(c->srv->reg, &c->cl, h, name, &ds);
  switch (kind) {
  case WAIT_ALLOC:
    ar.buffer = &ds.desc;
    rep.body_case = GPUPOOL__WIRE__REPLY__BODY_ALLOCATE;
    rep.allocate = &ar;
    break;
  case WAIT_GET:
    gr.buffer = &ds.desc;
    rep.body_case = GPUPOOL__WIRE__REPLY__BODY_GET;
    rep.get = &gr;
    break;
  default:
    orp.buffer = &ds.desc;
    rep.body_case = GPUPOOL__WIRE__REPLY__BODY_OPEN;
    rep.open = &orp;
    break;
  }
  send_reply(c, seq, &rep, NULL, 0);
}

/* ---- stats ---------------------------------------------------------------------------------- */

void gpupool__stats_free(Gpupool__Wire__StatsReply *st) {
  for (size_t i = 0; i < st->n_pools; i++)
    free(st->pools[i]);
  free(st->pools);
  st->pools = NULL;
  st->n_pools = 0;
}

int gpupool__server_stats(void *server, Gpupool__Wire__StatsReply *st) {
  gpupool__server *s = server;
  gpupool__registry *reg = s->reg;
  gpupool__wire__stats_reply__init(st);
  st->pools = calloc((size_t)reg->npools, sizeof *st->pools);
  if (!st->pools && reg->npools)
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory");
  for (int i = 0; i < reg->npools; i++) {
    st->pools[i] = malloc(sizeof *st->pools[i]);
    if (!st->pools[i]) {
      gpupool__stats_free(st);
      return gpupool__err(GPUPOOL_ENOMEM, "out of memory");
    }
    st->n_pools++;
    gpupool__fill_pool_info(reg, &reg->pools[i], st->pools[i]);
  }
  st->clients = s->nconns;
  st->buffers = reg->buffers.len;
  st->holds = reg->holds.len;
  st->names = reg->nnames;
  st->uptime_s = (gpupool__now_ns() - s->started_ns) / 1000000000ull;
  st->daemon_version = (char *)GPUPOOL_VERSION_STRING;
  st->daemon_pid = (int32_t)getpid();
  st->daemon_uid = (uint32_t)geteuid();
  st->backend = reg->be->desc->kind;
  st->requests = s->requests;
  st->errors = s->errors;
  st->open_fds = count_open_fds();
  st->pending_frees = reg->npending;
  return 0;
}

/* ---- request handlers ----------------------------------------------------------------------- */

static int is_admin(const gpupool__conn *c) { return c->cl.uid == 0 || c->cl.uid == geteuid(); }

static int admin_denied(gpupool__conn *c) {
  return gpupool__err(GPUPOOL_EPERM,
                      "this request is for operators: it needs root or the daemon's own uid (%u); "
                      "you are uid %u",
                      (unsigned)geteuid(), (unsigned)c->cl.uid);
}

static int handle_hello(gpupool__conn *c, uint64_t seq, const Gpupool__Wire__Hello *m) {
  gpupool__server *s = c->srv;
  Gpupool__Wire__Reply rep = GPUPOOL__WIRE__REPLY__INIT;
  Gpupool__Wire__HelloReply hr = GPUPOOL__WIRE__HELLO_REPLY__INIT;
  Gpupool__Wire__PoolInfo *pis, **pptr;

  if (c->hello_done)
    return gpupool__err(GPUPOOL_EPROTO, "second Hello on one connection");
  if (m->protocol_version != GPUPOOL__WIRE__VERSION__PROTOCOL_VERSION) {
    c->drop_after_flush = 1;
    return gpupool__err(GPUPOOL_EVERSION,
                        "client speaks protocol version %u, this gpupoold (%s) speaks %d; "
                        "use a libgpupool-client of the same major version as the daemon",
                        m->protocol_version, GPUPOOL_VERSION_STRING, GPUPOOL__WIRE__VERSION__PROTOCOL_VERSION);
  }
  c->hello_done = 1;
  uv_timer_stop(&c->hs_timer);
  snprintf(c->cl.name, sizeof c->cl.name, "%s", m->client_name && *m->client_name ? m->client_name : "-");
  for (char *p = c->cl.name; *p; p++)
    if ((unsigned char)*p < 0x20)
      *p = '?';
  GPUPOOL__INFO("client %" PRIu64 " connected: pid %d uid %u gid %u name '%s'", c->cl.id, (int)c->cl.pid,
          (unsigned)c->cl.uid, (unsigned)c->cl.gid, c->cl.name);
  pis = calloc((size_t)s->reg->npools, sizeof *pis);
  pptr = calloc((size_t)s->reg->npools, sizeof *pptr);
  if (!pis || !pptr) {
    free(pis);
    free(pptr);
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory");
  }
  for (int i = 0; i < s->reg->npools; i++) {
    gpupool__fill_pool_info(s->reg, &s->reg->pools[i], &pis[i]);
    pptr[i] = &pis[i];
  }
  hr.protocol_version = GPUPOOL__WIRE__VERSION__PROTOCOL_VERSION;
  hr.daemon_version = (char *)GPUPOOL_VERSION_STRING;
  hr.daemon_pid = (int32_t)getpid();
  hr.daemon_uid = (uint32_t)geteuid();
  hr.backend = s->reg->be->desc->kind;
  hr.n_pools = (size_t)s->reg->npools;
  hr.pools = pptr;
  hr.client_id = c->cl.id;
  hr.max_frame = s->cfg->max_frame;
  rep.body_case = GPUPOOL__WIRE__REPLY__BODY_HELLO;
  rep.hello = &hr;
  send_reply(c, seq, &rep, NULL, 0);
  free(pis);
  free(pptr);
  return 0;
}

static int handle_attach(gpupool__conn *c, uint64_t seq, const Gpupool__Wire__AttachPool *m) {
  Gpupool__Wire__Reply rep = GPUPOOL__WIRE__REPLY__INIT;
  Gpupool__Wire__AttachPoolReply ar = GPUPOOL__WIRE__ATTACH_POOL_REPLY__INIT;
  Gpupool__Wire__PoolInfo pi;
  gpupool__pool *p = gpupool__pool_find(c->srv->reg, NULL, m->pool_id);
  if (!p || m->pool_id == 0)
    return gpupool__err(GPUPOOL_ENOENT, "no pool with id %u", m->pool_id);
  gpupool__fill_pool_info(c->srv->reg, p, &pi);
  ar.pool = &pi;
  rep.body_case = GPUPOOL__WIRE__REPLY__BODY_ATTACH_POOL;
  rep.attach_pool = &ar;
  send_reply(c, seq, &rep, &p->fd, 1);
  return 0;
}

static int handle_allocate(gpupool__conn *c, uint64_t seq, const Gpupool__Wire__Allocate *m, int *deferred) {
  gpupool__registry *reg = c->srv->reg;
  gpupool__pool *p = gpupool__pool_find(reg, m->pool_name, m->pool_id);
  gpupool__hold *h = NULL;
  int rc;
  if (!p) {
    if (m->pool_name && *m->pool_name)
      return gpupool__err(GPUPOOL_ENOENT, "no pool named '%s' (gpupoolctl status lists the pools)", m->pool_name);
    return gpupool__err(GPUPOOL_ENOENT, "no pool with id %u", m->pool_id);
  }
  rc = gpupool__allocate(reg, &c->cl, p, m->size, m->alignment, &h);
  if (rc == GPUPOOL_ENOSPC && m->timeout_ms > 0) {
    if ((rc = waiter_add(c, seq, WAIT_ALLOC, m->timeout_ms, p, m->size, m->alignment, NULL, 0)) != 0)
      return rc;
    *deferred = 1;
    return 0;
  }
  if (rc != 0)
    return rc;
  reply_hold(c, seq, WAIT_ALLOC, h, NULL);
  return 0;
}

static int handle_release(gpupool__conn *c, uint64_t seq, const Gpupool__Wire__Release *m) {
  Gpupool__Wire__Reply rep = GPUPOOL__WIRE__REPLY__INIT;
  Gpupool__Wire__ReleaseReply rr = GPUPOOL__WIRE__RELEASE_REPLY__INIT;
  int freed = 0, rc = gpupool__release(c->srv->reg, &c->cl, m->hold_id, m->done_recorded, &freed);
  if (rc != 0)
    return rc;
  rr.freed = freed;
  rep.body_case = GPUPOOL__WIRE__REPLY__BODY_RELEASE;
  rep.release = &rr;
  send_reply(c, seq, &rep, NULL, 0);
  return 0;
}

static int handle_share(gpupool__conn *c, uint64_t seq, const Gpupool__Wire__Share *m) {
  Gpupool__Wire__Reply rep = GPUPOOL__WIRE__REPLY__INIT;
  Gpupool__Wire__ShareReply sr = GPUPOOL__WIRE__SHARE_REPLY__INIT;
  uint8_t token[GPUPOOL_TOKEN_SIZE];
  int rc = gpupool__share(c->srv->reg, &c->cl, m->hold_id, token);
  if (rc != 0)
    return rc;
  sr.token.data = token;
  sr.token.len = sizeof token;
  rep.body_case = GPUPOOL__WIRE__REPLY__BODY_SHARE;
  rep.share = &sr;
  send_reply(c, seq, &rep, NULL, 0);
  return 0;
}

static int handle_open(gpupool__conn *c, uint64_t seq, const Gpupool__Wire__Open *m) {
  gpupool__hold *h = NULL;
  int rc = gpupool__open(c->srv->reg, &c->cl, m->token.data, m->token.len, m->read_only, &h);
  if (rc != 0)
    return rc;
  reply_hold(c, seq, 0, h, NULL);
  return 0;
}

static int handle_publish(gpupool__conn *c, uint64_t seq, const Gpupool__Wire__Publish *m) {
  Gpupool__Wire__Reply rep = GPUPOOL__WIRE__REPLY__INIT;
  Gpupool__Wire__PublishReply pr = GPUPOOL__WIRE__PUBLISH_REPLY__INIT;
  int rc = gpupool__publish(c->srv->reg, &c->cl, m->hold_id, m->name, m->tensor, m->share_gid, m->share_all);
  if (rc != 0)
    return rc;
  /* Consumers blocked on the name first: they are the handoff's critical path. */
  wake_getters(c->srv, m->name);
  rep.body_case = GPUPOOL__WIRE__REPLY__BODY_PUBLISH;
  rep.publish = &pr;
  send_reply(c, seq, &rep, NULL, 0);
  GPUPOOL__DEBUG("client %" PRIu64 " published '%s'", c->cl.id, m->name);
  return 0;
}

static int handle_get(gpupool__conn *c, uint64_t seq, const Gpupool__Wire__Get *m, int *deferred) {
  gpupool__hold *h = NULL;
  int rc = gpupool__get(c->srv->reg, &c->cl, m->name, m->read_only, &h);
  if (rc == GPUPOOL_ENOENT && m->timeout_ms > 0) {
    if ((rc = waiter_add(c, seq, WAIT_GET, m->timeout_ms, NULL, 0, 0, m->name, m->read_only)) != 0)
      return rc;
    *deferred = 1;
    return 0;
  }
  if (rc != 0)
    return rc;
  reply_hold(c, seq, WAIT_GET, h, m->name);
  return 0;
}

static int handle_unpublish(gpupool__conn *c, uint64_t seq, const Gpupool__Wire__Unpublish *m) {
  Gpupool__Wire__Reply rep = GPUPOOL__WIRE__REPLY__INIT;
  Gpupool__Wire__UnpublishReply ur = GPUPOOL__WIRE__UNPUBLISH_REPLY__INIT;
  int rc = gpupool__unpublish(c->srv->reg, &c->cl, m->name);
  if (rc != 0)
    return rc;
  rep.body_case = GPUPOOL__WIRE__REPLY__BODY_UNPUBLISH;
  rep.unpublish = &ur;
  send_reply(c, seq, &rep, NULL, 0);
  return 0;
}

static int handle_stats(gpupool__conn *c, uint64_t seq) {
  Gpupool__Wire__Reply rep = GPUPOOL__WIRE__REPLY__INIT;
  Gpupool__Wire__StatsReply st;
  int rc = gpupool__server_stats(c->srv, &st);
  if (rc != 0)
    return rc;
  rep.body_case = GPUPOOL__WIRE__REPLY__BODY_STATS;
  rep.stats = &st;
  send_reply(c, seq, &rep, NULL, 0);
  gpupool__stats_free(&st);
  return 0;
}

static int handle_admin_clients(gpupool__conn *c, uint64_t seq) {
  gpupool__server *s = c->srv;
  Gpupool__Wire__Reply rep = GPUPOOL__WIRE__REPLY__INIT;
  Gpupool__Wire__AdminClientsReply ar = GPUPOOL__WIRE__ADMIN_CLIENTS_REPLY__INIT;
  Gpupool__Wire__ClientInfo *infos, **ptrs;
  uint64_t now = gpupool__now_ns();
  size_t n = 0;
  if (!is_admin(c))
    return admin_denied(c);
  infos = calloc(s->nconns + 1, sizeof *infos);
  ptrs = calloc(s->nconns + 1, sizeof *ptrs);
  if (!infos || !ptrs) {
    free(infos);
    free(ptrs);
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory");
  }
  for (gpupool__conn *o = s->conns; o && n < s->nconns + 1; o = o->next) {
    if (o->closing)
      continue;
    gpupool__wire__client_info__init(&infos[n]);
    infos[n].id = o->cl.id;
    infos[n].pid = o->cl.pid;
    infos[n].uid = o->cl.uid;
    infos[n].gid = o->cl.gid;
    infos[n].name = o->cl.name;
    infos[n].holds = o->cl.nholds;
    for (gpupool__hold *h = o->cl.holds; h; h = h->next)
      infos[n].bytes += h->buf->size;
    infos[n].age_s = (now - o->cl.connected_ns) / 1000000000ull;
    ptrs[n] = &infos[n];
    n++;
  }
  ar.n_clients = n;
  ar.clients = ptrs;
  rep.body_case = GPUPOOL__WIRE__REPLY__BODY_ADMIN_CLIENTS;
  rep.admin_clients = &ar;
  send_reply(c, seq, &rep, NULL, 0);
  free(infos);
  free(ptrs);
  return 0;
}

static int handle_admin_buffers(gpupool__conn *c, uint64_t seq) {
  gpupool__registry *reg = c->srv->reg;
  Gpupool__Wire__Reply rep = GPUPOOL__WIRE__REPLY__INIT;
  Gpupool__Wire__AdminBuffersReply ar = GPUPOOL__WIRE__ADMIN_BUFFERS_REPLY__INIT;
  Gpupool__Wire__BufferInfo *infos, **ptrs;
  uint64_t now = gpupool__now_ns();
  size_t n = 0;
  if (!is_admin(c))
    return admin_denied(c);
  infos = calloc(reg->buffers.len + 1, sizeof *infos);
  ptrs = calloc(reg->buffers.len + 1, sizeof *ptrs);
  if (!infos || !ptrs) {
    free(infos);
    free(ptrs);
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory");
  }
  for (size_t i = 0; i < reg->buffers.cap; i++) {
    gpupool__buffer *b;
    if (!gpupool__hmap_slot_used(&reg->buffers, i))
      continue;
    b = reg->buffers.slots[i].val;
    gpupool__wire__buffer_info__init(&infos[n]);
    infos[n].id = b->id;
    infos[n].pool_id = b->slab->pool->id;
    infos[n].size = b->asked;
    infos[n].holders = b->refs;
    infos[n].age_s = (now - b->created_ns) / 1000000000ull;
    infos[n].owner_pid = b->owner_pid;
    infos[n].name = (char *)"";
    ptrs[n] = &infos[n];
    n++;
  }
  /* Names: one lookup pass over the name table. */
  for (size_t i = 0; i < reg->names.cap; i++) {
    gpupool__name *nm;
    if (!gpupool__smap_slot_used(&reg->names, i))
      continue;
    nm = reg->names.slots[i].val;
    for (size_t k = 0; k < n; k++)
      if (infos[k].id == nm->buf->id && !*infos[k].name)
        infos[k].name = nm->name;
  }
  ar.n_buffers = n;
  ar.buffers = ptrs;
  rep.body_case = GPUPOOL__WIRE__REPLY__BODY_ADMIN_BUFFERS;
  rep.admin_buffers = &ar;
  send_reply(c, seq, &rep, NULL, 0);
  free(infos);
  free(ptrs);
  return 0;
}

static int handle_admin_drop(gpupool__conn *c, uint64_t seq, const Gpupool__Wire__AdminDropClient *m) {
  Gpupool__Wire__Reply rep = GPUPOOL__WIRE__REPLY__INIT;
  Gpupool__Wire__AdminDropClientReply ar = GPUPOOL__WIRE__ADMIN_DROP_CLIENT_REPLY__INIT;
  gpupool__conn *o, *next;
  if (!is_admin(c))
    return admin_denied(c);
  if (m->pid <= 0)
    return gpupool__err(GPUPOOL_EINVAL, "pid %d is not a valid process id", m->pid);
  for (o = c->srv->conns; o; o = next) {
    next = o->next;
    if (o != c && !o->closing && o->cl.pid == m->pid) {
      GPUPOOL__INFO("operator (uid %u) dropped client %" PRIu64 " (pid %d)", (unsigned)c->cl.uid, o->cl.id, m->pid);
      conn_close(o, "dropped by an operator");
      ar.dropped++;
    }
  }
  if (ar.dropped == 0)
    return gpupool__err(GPUPOOL_ENOENT, "no connected client has pid %d", m->pid);
  rep.body_case = GPUPOOL__WIRE__REPLY__BODY_ADMIN_DROP_CLIENT;
  rep.admin_drop_client = &ar;
  send_reply(c, seq, &rep, NULL, 0);
  return 0;
}

static int handle_trim(gpupool__conn *c, uint64_t seq) {
  Gpupool__Wire__Reply rep = GPUPOOL__WIRE__REPLY__INIT;
  Gpupool__Wire__TrimReply tr = GPUPOOL__WIRE__TRIM_REPLY__INIT;
  gpupool__trim(c->srv->reg, &tr.slabs_freed, &tr.slabs_revoked);
  rep.body_case = GPUPOOL__WIRE__REPLY__BODY_TRIM;
  rep.trim = &tr;
  send_reply(c, seq, &rep, NULL, 0);
  return 0;
}

/* The one dispatch point. Returns 0 when a reply was sent or deferred, else an error code
 * for the caller to send. */
static int dispatch(gpupool__conn *c, const Gpupool__Wire__Request *req, int *deferred) {
  if (!c->hello_done && req->body_case != GPUPOOL__WIRE__REQUEST__BODY_HELLO) {
    c->drop_after_flush = 1;
    return gpupool__err(GPUPOOL_EPROTO, "the first request on a connection must be Hello");
  }
  if (req->n_unmapped_slabs)
    gpupool__unmapped(c->srv->reg, &c->cl, req->unmapped_slabs, req->n_unmapped_slabs);
  switch (req->body_case) {
  case GPUPOOL__WIRE__REQUEST__BODY_HELLO:
    return handle_hello(c, req->seq, req->hello);
  case GPUPOOL__WIRE__REQUEST__BODY_ATTACH_POOL:
    return handle_attach(c, req->seq, req->attach_pool);
  case GPUPOOL__WIRE__REQUEST__BODY_ALLOCATE:
    return handle_allocate(c, req->seq, req->allocate, deferred);
  case GPUPOOL__WIRE__REQUEST__BODY_RELEASE:
    return handle_release(c, req->seq, req->release);
  case GPUPOOL__WIRE__REQUEST__BODY_SHARE:
    return handle_share(c, req->seq, req->share);
  case GPUPOOL__WIRE__REQUEST__BODY_OPEN:
    return handle_open(c, req->seq, req->open);
  case GPUPOOL__WIRE__REQUEST__BODY_PUBLISH:
    return handle_publish(c, req->seq, req->publish);
  case GPUPOOL__WIRE__REQUEST__BODY_GET:
    return handle_get(c, req->seq, req->get, deferred);
  case GPUPOOL__WIRE__REQUEST__BODY_UNPUBLISH:
    return handle_unpublish(c, req->seq, req->unpublish);
  case GPUPOOL__WIRE__REQUEST__BODY_STATS:
    return handle_stats(c, req->seq);
  case GPUPOOL__WIRE__REQUEST__BODY_ADMIN_CLIENTS:
    return handle_admin_clients(c, req->seq);
  case GPUPOOL__WIRE__REQUEST__BODY_ADMIN_BUFFERS:
    return handle_admin_buffers(c, req->seq);
  case GPUPOOL__WIRE__REQUEST__BODY_ADMIN_DROP_CLIENT:
    return handle_admin_drop(c, req->seq, req->admin_drop_client);
  case GPUPOOL__WIRE__REQUEST__BODY_TRIM:
    return handle_trim(c, req->seq);
  default:
    return gpupool__err(GPUPOOL_EPROTO,
                        "unknown request type (field %d); this daemon (%s) may be older than the client",
                        (int)req->body_case, GPUPOOL_VERSION_STRING);
  }
}

static void handle_frame(gpupool__conn *c, const uint8_t *payload, uint32_t len) {
  gpupool__server *s = c->srv;
  Gpupool__Wire__Request *req;
  uint64_t t0 = gpupool__now_ns();
  int rc, deferred = 0, body = 0;

  s->requests++;
  if (c->fds_pending) {
    /* Clients never send fds: they were closed on arrival; refuse the frame they came with. */
    c->fds_pending = 0;
    send_error(c, 0, GPUPOOL_EFD, "the daemon accepts no file descriptors from clients; they were closed");
    return;
  }
  req = gpupool__wire__request__unpack(NULL, len, payload);
  if (!req) {
    GPUPOOL__WARN("client %" PRIu64 " (pid %d) sent a malformed frame; dropping it", c->cl.id, (int)c->cl.pid);
    c->drop_after_flush = 1;
    send_error(c, 0, GPUPOOL_EPROTO, "malformed request frame (not a valid gpupool Request); closing the connection");
    gpupool__metrics_request(0, GPUPOOL_EPROTO, gpupool__now_ns() - t0);
    return;
  }
  body = (int)req->body_case;
  gpupool__err_clear();
  rc = dispatch(c, req, &deferred);
  if (rc != 0) {
    GPUPOOL__DEBUG("client %" PRIu64 ": request %d refused: %s", c->cl.id, body, gpupool__errmsg());
    if (rc != GPUPOOL_ENOSPC && rc != GPUPOOL_ENOENT && rc != GPUPOOL_ETIMEDOUT)
      GPUPOOL__INFO("client %" PRIu64 " (pid %d): refused %s: %s", c->cl.id, (int)c->cl.pid, gpupool_err_name(rc),
              gpupool__errmsg());
    send_error(c, req->seq, rc, gpupool__errmsg());
  }
  if (!deferred)
    gpupool__metrics_request(body, rc, gpupool__now_ns() - t0);
  if (gpupool__now_ns() - t0 > 50000)
    GPUPOOL__DEBUG("slow request %d from client %" PRIu64 ": %" PRIu64 " us", body, c->cl.id, (gpupool__now_ns() - t0) / 1000);
  gpupool__wire__request__free_unpacked(req, NULL);
  if (s->reg->memory_returned)
    retry_waiters(s->reg, NULL);
}

/* ---- connection lifetime -------------------------------------------------------------------- */

static void conn_handle_closed(uv_handle_t *h) {
  gpupool__conn *c = h->data;
  if (--c->handles_open > 0)
    return;
  while (c->txq) {
    tx_frame *f = c->txq;
    c->txq = f->next;
    tx_free(f);
  }
  gpupool__wire_inbuf_free(&c->in);
  close(c->fd);
  free(c);
}

static void conn_close(gpupool__conn *c, const char *why) {
  gpupool__server *s = c->srv;
  gpupool__waiter *w, *next;
  if (c->closing)
    return;
  c->closing = 1;
  GPUPOOL__INFO("client %" PRIu64 " disconnected (pid %d uid %u '%s'): %s; had %" PRIu64 " hold(s)", c->cl.id,
          (int)c->cl.pid, (unsigned)c->cl.uid, c->cl.name, why, c->cl.nholds);
  for (w = s->waiters; w; w = next) {
    next = w->next;
    if (w->conn == c)
      waiter_remove(w);
  }
  gpupool__client_drop(s->reg, &c->cl);
  if (c->prev)
    c->prev->next = c->next;
  else
    s->conns = c->next;
  if (c->next)
    c->next->prev = c->prev;
  s->nconns--;
  uv_poll_stop(&c->poll);
  uv_close((uv_handle_t *)&c->poll, conn_handle_closed);
  uv_close((uv_handle_t *)&c->hs_timer, conn_handle_closed);
  if (s->reg->memory_returned)
    retry_waiters(s->reg, NULL);
}

static void conn_io(uv_poll_t *p, int status, int events);

static void conn_update_poll(gpupool__conn *c) {
  int want = UV_READABLE | (c->txq ? UV_WRITABLE : 0);
  if (c->closing || want == c->poll_events)
    return;
  c->poll_events = want;
  uv_poll_start(&c->poll, want, conn_io);
}

static void conn_io(uv_poll_t *p, int status, int events) {
  gpupool__conn *c = p->data;
  if (status < 0) {
    conn_close(c, uv_strerror(status));
    return;
  }
  if (events & UV_WRITABLE) {
    conn_flush(c);
    if (c->closing)
      return;
  }
  if (!(events & UV_READABLE))
    return;
  c->srv->last_activity_ns = gpupool__now_ns();
  {
    const uint8_t *payload;
    uint32_t len;
    int fds = 0, rc = gpupool__wire_inbuf_fill(&c->in, c->fd, &fds);
    if (fds > 0) {
      GPUPOOL__WARN("client %" PRIu64 " (pid %d) sent %d unexpected fd(s); closed them", c->cl.id, (int)c->cl.pid, fds);
      c->fds_pending = 1;
    }
    /* One read takes every waiting frame; level-triggered polling brings us back for more. */
    while (rc >= 0 && !c->closing && !c->drop_after_flush &&
           (rc = gpupool__wire_inbuf_next(&c->in, &payload, &len)) == 1) {
      handle_frame(c, payload, len);
      if (c->drop_after_flush && !c->txq && !c->closing)
        conn_close(c, "protocol violation");
    }
    if (rc >= 0 || c->closing)
      return;
    if (rc == GPUPOOL_ECLOSED) {
      conn_close(c, "end of connection");
    } else {
      char why[GPUPOOL__ERRMSG_MAX + 32];
      snprintf(why, sizeof why, "protocol error: %s", gpupool__errmsg());
      GPUPOOL__WARN("client %" PRIu64 " (pid %d): %s", c->cl.id, (int)c->cl.pid, gpupool__errmsg());
      if (rc == GPUPOOL_EPROTO && !c->drop_after_flush) {
        /* Tell it why before hanging up (the stream cannot be resynchronised). */
        c->drop_after_flush = 1;
        send_error(c, 0, GPUPOOL_EPROTO, gpupool__errmsg());
        if (!c->txq && !c->closing)
          conn_close(c, why);
      } else {
        conn_close(c, why);
      }
    }
  }
}

static void hs_timeout(uv_timer_t *t) {
  gpupool__conn *c = t->data;
  char why[96];
  snprintf(why, sizeof why, "no Hello within %u ms", c->srv->cfg->handshake_timeout_ms);
  conn_close(c, why);
}

/* Refuse a connection with one error frame (best effort, nonblocking) and close it. */
static void refuse(int fd, int code, const char *msg) {
  Gpupool__Wire__Reply rep = GPUPOOL__WIRE__REPLY__INIT;
  Gpupool__Wire__Error err = GPUPOOL__WIRE__ERROR__INIT;
  uint8_t *buf;
  size_t len, off = 0;
  err.code = code;
  err.message = (char *)msg;
  rep.error = &err;
  if (gpupool__wire_pack_reply(&rep, &buf, &len) == 0) {
    gpupool__wire_send_some(fd, buf, len, &off, NULL, 0);
    free(buf);
  }
  close(fd);
}

static int id_allowed(const uint32_t *ids, int n, uint32_t id) {
  for (int i = 0; i < n; i++)
    if (ids[i] == id)
      return 1;
  return 0;
}

static void on_accept(uv_poll_t *p, int status, int events) {
  gpupool__server *s = p->data;
  (void)events;
  if (status < 0) {
    GPUPOOL__ERROR("listening socket error: %s", uv_strerror(status));
    return;
  }
  for (;;) {
    struct ucred cred;
    socklen_t cl = sizeof cred;
    gpupool__conn *c;
    char msg[256];
    int fd = accept4(s->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR)
        continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK)
        GPUPOOL__WARN("accept failed: %s", strerror(errno));
      return;
    }
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &cl) != 0) {
      GPUPOOL__WARN("cannot read peer credentials: %s", strerror(errno));
      close(fd);
      continue;
    }
    if ((s->cfg->n_allow_uids || s->cfg->n_allow_gids) && cred.uid != 0 && cred.uid != geteuid() &&
        !id_allowed((const uint32_t *)s->cfg->allow_uids, s->cfg->n_allow_uids, cred.uid) &&
        !id_allowed((const uint32_t *)s->cfg->allow_gids, s->cfg->n_allow_gids, cred.gid)) {
      GPUPOOL__INFO("refused connection from pid %d uid %u gid %u: not in allow_uids/allow_gids", (int)cred.pid,
              (unsigned)cred.uid, (unsigned)cred.gid);
      snprintf(msg, sizeof msg,
               "uid %u / gid %u is not allowed by this gpupoold (allow_uids/allow_gids in its config)",
               (unsigned)cred.uid, (unsigned)cred.gid);
      refuse(fd, GPUPOOL_EPERM, msg);
      continue;
    }
    if (s->cfg->max_clients && s->nconns >= s->cfg->max_clients) {
      GPUPOOL__WARN("refused connection from pid %d uid %u: %" PRIu64 " clients connected (max_clients)",
              (int)cred.pid, (unsigned)cred.uid, s->nconns);
      snprintf(msg, sizeof msg, "gpupoold already serves %" PRIu64 " clients, its limit (max_clients); try later",
               s->nconns);
      refuse(fd, GPUPOOL_ELIMIT, msg);
      continue;
    }
    c = calloc(1, sizeof *c);
    if (!c) {
      close(fd);
      continue;
    }
    c->srv = s;
    c->fd = fd;
    c->cl.pid = cred.pid;
    c->cl.uid = cred.uid;
    c->cl.gid = cred.gid;
    c->cl.pidfd = cred.pid > 0 ? (int)syscall(SYS_pidfd_open, cred.pid, 0) : -1;
    snprintf(c->cl.name, sizeof c->cl.name, "-");
    gpupool__wire_inbuf_init(&c->in, s->cfg->max_frame);
    gpupool__client_init(s->reg, &c->cl);
    uv_poll_init(s->loop, &c->poll, fd);
    c->poll.data = c;
    uv_timer_init(s->loop, &c->hs_timer);
    c->hs_timer.data = c;
    c->handles_open = 2;
    if (s->cfg->handshake_timeout_ms)
      uv_timer_start(&c->hs_timer, hs_timeout, s->cfg->handshake_timeout_ms, 0);
    c->next = s->conns;
    if (s->conns)
      s->conns->prev = c;
    s->conns = c;
    s->nconns++;
    GPUPOOL__DEBUG("accepted pid %d uid %u gid %u as client %" PRIu64, (int)cred.pid, (unsigned)cred.uid,
             (unsigned)cred.gid, c->cl.id);
    conn_update_poll(c);
  }
}

/* ---- listener ------------------------------------------------------------------------------- */

static int mkdir_parents(const char *path) {
  char dir[sizeof(((struct sockaddr_un *)0)->sun_path)];
  char *slash;
  snprintf(dir, sizeof dir, "%s", path);
  slash = strrchr(dir, '/');
  if (!slash || slash == dir)
    return 0;
  *slash = '\0';
  for (char *p = dir + 1; *p; p++) {
    if (*p != '/')
      continue;
    *p = '\0';
    if (mkdir(dir, 0755) != 0 && errno != EEXIST)
      return gpupool__err(GPUPOOL_EIO, "cannot create directory %s: %s", dir, strerror(errno));
    *p = '/';
  }
  if (mkdir(dir, 0755) != 0 && errno != EEXIST)
    return gpupool__err(GPUPOOL_EIO, "cannot create directory %s: %s", dir, strerror(errno));
  return 0;
}

static int bind_socket(const gpupool__config *cfg, int *out) {
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  int fd, rc;
  if (strlen(cfg->socket_path) >= sizeof addr.sun_path || !cfg->socket_path[0])
    return gpupool__err(GPUPOOL_ECONFIG, "socket path '%s' is empty or longer than %zu bytes", cfg->socket_path,
                        sizeof addr.sun_path - 1);
  strcpy(addr.sun_path, cfg->socket_path);
  if ((rc = mkdir_parents(cfg->socket_path)) != 0)
    return rc;
  if ((rc = gpupool__clear_stale_socket(cfg->socket_path, "socket")) < 0)
    return rc;
  if (rc == 1)
    GPUPOOL__INFO("removed the stale socket %s (nothing answered on it)", cfg->socket_path);
  fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0)
    return gpupool__err(GPUPOOL_EIO, "socket: %s", strerror(errno));
  if (bind(fd, (struct sockaddr *)&addr, sizeof addr) != 0)
    goto bind_fail;
  if (chmod(cfg->socket_path, cfg->socket_mode) != 0)
    GPUPOOL__WARN("cannot chmod %s to %o: %s", cfg->socket_path, (unsigned)cfg->socket_mode, strerror(errno));
  if (listen(fd, 128) != 0) {
    rc = gpupool__err(GPUPOOL_EIO, "listen on %s: %s", cfg->socket_path, strerror(errno));
    close(fd);
    gpupool__unlink_socket(cfg->socket_path);
    return rc;
  }
  *out = fd;
  return 0;
bind_fail:
  rc = gpupool__err(GPUPOOL_EIO, "cannot bind %s: %s", cfg->socket_path, strerror(errno));
  close(fd);
  return rc;
}

int gpupool__server_start(gpupool__server **out, uv_loop_t *loop, const gpupool__config *cfg, gpupool__registry *reg,
                    int listen_fd) {
  gpupool__server *s = calloc(1, sizeof *s);
  int rc;
  if (!s)
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory");
  s->loop = loop;
  s->cfg = cfg;
  s->reg = reg;
  s->started_ns = gpupool__now_ns();
  reg->owner = s;
  reg->on_memory = retry_waiters;
  if (listen_fd >= 0) {
    s->listen_fd = listen_fd;
  } else {
    if ((rc = bind_socket(cfg, &s->listen_fd)) != 0) {
      free(s);
      return rc;
    }
    s->own_socket = 1;
  }
  uv_poll_init(loop, &s->listen_poll, s->listen_fd);
  s->listen_poll.data = s;
  s->listen_open = 1;
  uv_poll_start(&s->listen_poll, UV_READABLE, on_accept);
  *out = s;
  return 0;
}

static void listen_closed(uv_handle_t *h) {
  gpupool__server *s = h->data;
  close(s->listen_fd);
  free(s);
}

void gpupool__server_stop(gpupool__server *s) {
  if (s->stopping)
    return;
  s->stopping = 1;
  while (s->conns)
    conn_close(s->conns, "daemon shutting down");
  if (s->own_socket)
    gpupool__unlink_socket(s->cfg->socket_path);
  s->reg->on_memory = NULL;
  uv_poll_stop(&s->listen_poll);
  uv_close((uv_handle_t *)&s->listen_poll, listen_closed);
}
