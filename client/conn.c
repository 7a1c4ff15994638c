/*
 * libgpupool-client, conn.c: The transport of one connection: framing calls, reader election
 * (whichever waiting thread finds no reader reads one frame for everyone), the pending replies,
 * and call/call_retry, through which every request goes. Also GPUPOOL_TRACE. It calls nothing
 * above it: reconnecting and revoked slabs go to the callbacks connect.c gives it (c->reconnect,
 * c->revoked). See internal.h for how the client is put together.
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
#include "test_hooks.h"

/* ---- tracing ------------------------------------------------------------------------------------ */

/* GPUPOOL_TRACE=FILE appends one line per step (request round trips, slab maps, event opens,
 * stream waits) with CLOCK_MONOTONIC microseconds, to find where a handoff spends its time. */
FILE *gpupool__trace_file;
pthread_once_t gpupool__trace_once = PTHREAD_ONCE_INIT;

void gpupool__trace_open(void) {
  const char *p = getenv("GPUPOOL_TRACE");
  if (p && *p && (gpupool__trace_file = fopen(p, "ae")))
    setvbuf(gpupool__trace_file, NULL, _IOLBF, 0);
}

void gpupool__trace(const char *what, uint64_t t0, uint64_t detail) {
  pthread_once(&gpupool__trace_once, gpupool__trace_open);
  if (gpupool__trace_file)
    fprintf(gpupool__trace_file, "%d %.1f %s %.1fus %" PRIu64 "\n", (int)getpid(), (double)t0 / 1e3, what,
            (double)(gpupool__mono_ns() - t0) / 1e3, detail);
}


void (*gpupool__hook_sent)(gpupool_client *c, const gpupool__req *req);

/* ---- transport -------------------------------------------------------------------------------- */

/* Marks the connection unusable and fails every request still waiting on it. */
void gpupool__set_broken(gpupool_client *c, int code, const char *msg) {
  if (c->broken)
    return;
  c->broken = code;
  snprintf(c->broken_msg, sizeof c->broken_msg, "%s", msg);
  for (pending **pp = &c->pend; *pp;) {
    pending *p = *pp;
    if (p->detached) { /* nobody waits for it: gone with the connection */
      *pp = p->next;
      free(p);
      continue;
    }
    if (!p->done) {
      p->done = 1;
      p->err = code;
    }
    pp = &p->next;
  }
  c->nowait_inflight = 0;
  pthread_cond_broadcast(&c->cv);
}

/* The reply of a request nobody waits for (a share that did not wait): a failure is counted
 * and logged (its tokens' Opens fail too, saying why), revocations handled, p freed. */
static void detached_reply(gpupool_client *c, pending *p, gpupool__rep *rep) {
  for (pending **pp = &c->pend; *pp; pp = &(*pp)->next)
    if (*pp == p) {
      *pp = p->next;
      break;
    }
  if (rep->n_revoke_slabs && c->revoked)
    c->revoked(c, rep->revoke_slabs, rep->n_revoke_slabs);
  if (rep->error) {
    c->nowait_failed++;
    snprintf(c->nowait_msg, sizeof c->nowait_msg, "%s", rep->error->message ? rep->error->message : "daemon error");
  }
  for (int i = 0; i < c->rx.nfds; i++)
    if (c->rx.fds[i] >= 0) {
      close(c->rx.fds[i]);
      c->rx.fds[i] = -1;
    }
  if (c->nowait_inflight)
    c->nowait_inflight--;
  gpupool__wire__reply__free_unpacked(rep, NULL);
  free(p);
}

static int broken_err(gpupool_client *c, gpupool__error *err) {
  return gpupool__error_set(err, c->broken, "connection to gpupoold is unusable: %s", c->broken_msg);
}

void gpupool__export_free(slab_export *e) {
  if (e->fd >= 0)
    close(e->fd);
  free(e);
}

void gpupool__exports_clear(gpupool_client *c) {
  for (size_t i = 0; i < c->exports.cap; i++)
    if (gpupool__hmap_slot_used(&c->exports, i))
      gpupool__export_free(c->exports.slots[i].val);
  gpupool__hmap_free(&c->exports);
  gpupool__hmap_init(&c->exports);
}

/* The buffer a reply carries, if its body is of the expected kind. body is a oneof (a
 * union): only the member its case names may be read. want 0 = any buffer-carrying kind. */
const Gpupool__Wire__BufferDesc *gpupool__reply_desc(const gpupool__rep *rep, int want) {
  if (want && (int)rep->body_case != want)
    return NULL;
  switch (rep->body_case) {
  case GPUPOOL__WIRE__REPLY__BODY_ALLOCATE:
    return rep->allocate ? rep->allocate->buffer : NULL;
  case GPUPOOL__WIRE__REPLY__BODY_GET:
    return rep->get ? rep->get->buffer : NULL;
  case GPUPOOL__WIRE__REPLY__BODY_OPEN:
    return rep->open ? rep->open->buffer : NULL;
  default:
    return NULL;
  }
}


/* Keep how to map a slab from the reply that carries it (and the slab's fd, which comes in the
 * same frame): a first mapping, or a writable one for a slab mapped read-only so far. *fdi is
 * the index of the frame's next fd: each desc with fd_attached took one, in order. */
static void stash_one(gpupool_client *c, const Gpupool__Wire__BufferDesc *d, int *fdi) {
  const cslab *s;
  slab_export *e, *old;
  int fd = -1;
  if (!d || !d->slab || !d->slab->export_data.len)
    return;
  if (d->slab->fd_attached && *fdi < c->rx.nfds)
    fd = (*fdi)++;
  s = gpupool__hmap_get(&c->slabs, d->slab->id);
  old = gpupool__hmap_get(&c->exports, d->slab->id);
  if ((s && (s->writable || s->base_rw || !d->slab->writable)) || (old && (old->writable || !d->slab->writable)))
    return;
  e = malloc(sizeof *e + d->slab->export_data.len);
  if (!e)
    return; /* materialize then fails with a clear error for the thread that needs it */
  e->pool_id = d->slab->pool_id;
  e->size = d->slab->size;
  e->dedicated = d->slab->dedicated;
  e->writable = d->slab->writable;
  e->fd = -1;
  if (fd >= 0) {
    e->fd = c->rx.fds[fd];
    c->rx.fds[fd] = -1;
  }
  e->len = d->slab->export_data.len;
  memcpy(e->data, d->slab->export_data.data, e->len);
  if (gpupool__hmap_put(&c->exports, d->slab->id, e) != 0) {
    gpupool__export_free(e);
    return;
  }
  if (old)
    gpupool__export_free(old);
}

/* The bundle a reply carries, if any. */
const Gpupool__Wire__Bundle *gpupool__reply_bundle(const gpupool__rep *rep) {
  if (rep->body_case == GPUPOOL__WIRE__REPLY__BODY_ALLOCATE_BUNDLE)
    return rep->allocate_bundle ? rep->allocate_bundle->bundle : NULL;
  if (rep->body_case == GPUPOOL__WIRE__REPLY__BODY_GET_BUNDLE)
    return rep->get_bundle ? rep->get_bundle->bundle : NULL;
  return NULL;
}

static void stash_export(gpupool_client *c, const gpupool__rep *rep) {
  const Gpupool__Wire__Bundle *b = gpupool__reply_bundle(rep);
  int fdi = 0;
  if (b) {
    for (size_t i = 0; i < b->n_buffers; i++)
      stash_one(c, b->buffers[i], &fdi);
    return;
  }
  stash_one(c, gpupool__reply_desc(rep, 0), &fdi);
  if (rep->body_case == GPUPOOL__WIRE__REPLY__BODY_OPEN && rep->open)
    for (size_t i = 0; i < rep->open->n_more; i++)
      stash_one(c, rep->open->more[i], &fdi);
}

/* Read one reply (lock released meanwhile) and hand it to its waiter. Called with c->mu. */
static void read_one(gpupool_client *c) {
  gpupool__rep *rep;
  pending *p;
  gpupool__error why = {.code = 0}; /* a failed read's reason */
  int rc;

  uint64_t t_read = TRACE_ON() ? gpupool__mono_ns() : 0;
  c->reader_active = 1;
  pthread_mutex_unlock(&c->mu);
  if (c->spin_us > 0) {
    /* Latency mode: most replies come within tens of microseconds; waiting for them awake
     * saves being woken up (costly on virtual machines and in deep idle states). */
    struct pollfd pfd = {.fd = c->fd, .events = POLLIN};
    uint64_t end = gpupool__mono_ns() + (uint64_t)c->spin_us * 1000;
    while (poll(&pfd, 1, 0) == 0 && gpupool__mono_ns() < end)
      ;
  }
  /* Only while saying Hello does the socket have a receive timeout (SO_RCVTIMEO): a read
   * that times out returns 0 and is tried again until the deadline. */
  while ((rc = gpupool__wire_rx_read(&c->rx, c->fd)) == 0 && c->hs_deadline_ns &&
         gpupool__mono_ns() < c->hs_deadline_ns)
    ;
  if (rc < 0)
    gpupool__error_take(&why, rc); /* the read's own reason */
  if (t_read)
    gpupool__trace("read", t_read, c->rx.payload_len);
  rep = rc == 1 ? gpupool__wire_unpack_reply(&c->rx) : NULL;
  pthread_mutex_lock(&c->mu);
  c->reader_active = 0;
  if (c->hs_deadline_ns && (rc != 1 || !rep)) {
    char msg[GPUPOOL__ERRMSG_MAX];
    if (rc == 0)
      snprintf(msg, sizeof msg, "the daemon did not answer in %g s: gpupoold at %s accepted the "
               "connection but did not answer Hello (stopped or stuck? see 'systemctl status "
               "gpupoold'; the timeout is gpupool_client_connect() or GPUPOOL_CONNECT_TIMEOUT_MS)",
               c->connect_timeout_ms / 1000.0, c->socket_path);
    else if (rc == GPUPOOL_ECLOSED)
      /* What a socket-activated gpupoold that failed to start looks like from here. */
      snprintf(msg, sizeof msg, "%s closed the connection without answering Hello: gpupoold failed "
               "to start (see 'systemctl status gpupoold' and 'journalctl -u gpupoold'; check the "
               "configuration with 'gpupoold --check-config'), or this socket is not gpupoold "
               "(check the socket path, GPUPOOL_SOCKET)", c->socket_path);
    else {
      char seen[160];
      if (rc == 1)
        snprintf(seen, sizeof seen, "the frame does not decode");
      else
        gpupool__sock_foreign(&c->rx, why.msg, seen, sizeof seen);
      snprintf(msg, sizeof msg, "this socket is not gpupoold: %s answered Hello with something that "
               "is not a gpupool reply (%s); check the socket path (GPUPOOL_SOCKET)", c->socket_path,
               seen);
    }
    gpupool__set_broken(c, rc == 0 ? GPUPOOL_ETIMEDOUT : GPUPOOL_EPROTO, msg);
    c->hs_closed = rc == GPUPOOL_ECLOSED;
    if (rep)
      gpupool__wire__reply__free_unpacked(rep, NULL);
    goto out;
  }
  if (rc != 1) {
    gpupool__set_broken(c, rc == GPUPOOL_ECLOSED ? GPUPOOL_ECLOSED : rc,
               rc == GPUPOOL_ECLOSED ? "the daemon closed the connection (stopped, restarted, or dropped this client)"
               : rc == 0             ? "no reply from the daemon"
                                     : why.msg);
    goto out;
  }
  if (!rep) {
    gpupool__set_broken(c, GPUPOOL_EPROTO, "malformed reply from the daemon");
    goto out;
  }
  for (p = c->pend; p; p = p->next)
    if (!p->done && p->seq == rep->seq)
      break;
  if (!p && rep->seq == 0 && rep->error) {
    /* A connection-level error (refusal, protocol violation): the oldest request gets it. */
    for (p = c->pend; p && p->next; p = p->next)
      ;
    if (p && p->done)
      p = NULL;
    if (!p)
      gpupool__set_broken(c, rep->error->code, rep->error->message ? rep->error->message : "daemon error");
  }
  if (!p) {
    if (!c->broken)
      gpupool__set_broken(c, GPUPOOL_EPROTO, "reply for an unknown request");
    gpupool__wire__reply__free_unpacked(rep, NULL);
    goto out;
  }
  if (p->detached) {
    detached_reply(c, p, rep);
    goto out;
  }
  p->rep = rep;
  stash_export(c, rep);
  for (int i = 0; i < c->rx.nfds; i++) {
    p->fds[p->nfds++] = c->rx.fds[i];
    c->rx.fds[i] = -1;
  }
  p->done = 1;
out:
  gpupool__wire_rx_reset(&c->rx);
  pthread_cond_broadcast(&c->cv);
}

void gpupool__read_reply(gpupool_client *c) { read_one(c); }

/* After a failed send: an error frame the daemon left before closing, as (code, message in
 * *err); 0 when there is none. */
static int refusal(gpupool_client *c, gpupool__error *err) {
  struct pollfd pfd = {.fd = c->fd, .events = POLLIN};
  gpupool__wire_rx rx;
  gpupool__rep *rep = NULL;
  int code = 0;
  if (c->reader_active || poll(&pfd, 1, 0) != 1 || !(pfd.revents & POLLIN))
    return 0;
  gpupool__wire_rx_init(&rx, GPUPOOL_WIRE_DEFAULT_MAX_FRAME);
  (void)gpupool__sock_read_reply(&rx, c->fd, &rep);
  gpupool__wire_rx_reset(&rx);
  if (rep && rep->error && rep->error->code < 0 && rep->error->code > GPUPOOL_ERRNO_MIN) {
    code = rep->error->code;
    gpupool__set_broken(c, code, rep->error->message ? rep->error->message : gpupool_strerror(code));
    gpupool__error_set(err, code, "%s", c->broken_msg);
  }
  if (rep)
    gpupool__wire__reply__free_unpacked(rep, NULL);
  return code;
}

/* Send req (with send_fd, when >= 0; the caller keeps it) and register its pending reply
 * (*out, freed by call_wait). With c->mu held. */
int gpupool__call_send(gpupool_client *c, gpupool__req *req, pending **out, int send_fd, gpupool__error *err) {
  pending *p;
  uint8_t *buf;
  size_t len;
  int rc;

  if (c->broken)
    return broken_err(c, err);
  req->seq = ++c->next_seq;
  req->n_unmapped_slabs = c->nunmapped;
  req->unmapped_slabs = c->unmapped;
  req->host_fences = c->host_fences;
  if ((rc = gpupool__sock_pack_request(req, c->max_frame, &buf, &len)) != 0)
    return gpupool__error_take(err, rc);
  if (!(p = calloc(1, sizeof *p))) {
    free(buf);
    return gpupool__error_set(err, GPUPOOL_ENOMEM, "out of memory");
  }
  rc = gpupool__wire_send(c->fd, buf, len, send_fd >= 0 ? &send_fd : NULL, send_fd >= 0 ? 1 : 0);
  free(buf);
  if (rc != 0) {
    gpupool__error sent;
    int code;
    /* The send's own reason, taken before refusal() may read (and fail to read) a reply. */
    gpupool__error_take(&sent, rc);
    free(p);
    /* The daemon may have refused this connection (too many clients, uid not allowed) and
     * closed it before our request went out: its reason is still readable. */
    if ((code = refusal(c, err)) != 0)
      return code;
    if (c->hs_deadline_ns) {
      gpupool__set_broken(c, rc == GPUPOOL_ETIMEDOUT ? GPUPOOL_ETIMEDOUT : GPUPOOL_EPROTO, "");
      if (c->broken == GPUPOOL_ETIMEDOUT)
        snprintf(c->broken_msg, sizeof c->broken_msg,
                 "the daemon did not answer in %g s: gpupoold at %s does not read (%.159s)",
                 c->connect_timeout_ms / 1000.0, c->socket_path, sent.msg);
      else
        snprintf(c->broken_msg, sizeof c->broken_msg,
                 "this socket is not gpupoold, or it is shutting down: %s closed the connection "
                 "before reading Hello (%.159s)",
                 c->socket_path, sent.msg);
      c->hs_closed = c->broken == GPUPOOL_EPROTO;
      return gpupool__error_set(err, c->broken, "%s", c->broken_msg);
    }
    gpupool__set_broken(c, rc, "cannot send to the daemon (it stopped or dropped this client)");
    return broken_err(c, err);
  }
  c->nunmapped = 0;
  p->seq = req->seq;
  p->gen = c->reconnects;
  p->next = c->pend;
  c->pend = p;
  *out = p;
  return 0;
}

/* Wait for p's reply, unlink and free p. On success *out is the reply (caller frees) and it
 * carried no error; fds it carried go to fds_out (first *nfds_out, at most GPUPOOL_WIRE_MAX_FDS)
 * or are closed when fds_out is NULL. Handles the slab revocations it carries. With c->mu. */
int gpupool__call_wait(gpupool_client *c, pending *p, gpupool__rep **out, int *fds_out, int *nfds_out,
                       gpupool__error *err) {
  pending **pp;
  int rc;
  uint64_t t_wait = TRACE_ON() ? gpupool__mono_ns() : 0;

  if (nfds_out)
    *nfds_out = 0;
  while (!p->done) {
    if (!c->reader_active)
      read_one(c);
    else
      pthread_cond_wait(&c->cv, &c->mu);
  }
  for (pp = &c->pend; *pp && *pp != p; pp = &(*pp)->next)
    ;
  if (*pp)
    *pp = p->next;
  if (t_wait)
    gpupool__trace("rpc", t_wait, p->seq);
  if (!p->rep || p->gen != c->reconnects) {
    rc = gpupool__error_set(err, p->err ? p->err : p->rep ? GPUPOOL_ECLOSED : GPUPOOL_EIO,
                            "connection to gpupoold lost while waiting for the reply: %s (the next request "
                            "reconnects; holds of the old connection are reported by gpupool_client_lost_names "
                            "and gpupool_buffer_lost)",
                            c->broken_msg[0] ? c->broken_msg : "the client reconnected since");
    goto fail;
  }
  if (p->rep->n_revoke_slabs && c->revoked)
    c->revoked(c, p->rep->revoke_slabs, p->rep->n_revoke_slabs);
  if (p->rep->error) {
    rc = p->rep->error->code < 0 && p->rep->error->code > GPUPOOL_ERRNO_MIN ? p->rep->error->code : GPUPOOL_EPROTO;
    gpupool__error_set(err, rc, "%s", p->rep->error->message ? p->rep->error->message : gpupool_strerror(rc));
    goto fail;
  }
  for (int i = 0; i < p->nfds; i++)
    if (p->fds[i] >= 0) {
      if (fds_out && nfds_out)
        fds_out[(*nfds_out)++] = p->fds[i];
      else
        close(p->fds[i]);
    }
  *out = p->rep;
  free(p);
  return 0;
fail:
  if (p->rep)
    gpupool__wire__reply__free_unpacked(p->rep, NULL);
  for (int i = 0; i < p->nfds; i++)
    if (p->fds[i] >= 0)
      close(p->fds[i]);
  free(p);
  return rc;
}

/* Send req (with send_fd when >= 0; the caller keeps it) and wait for its reply. Called and
 * returns with c->mu held. On success *rep is the reply (caller frees) and it carried no
 * error; *fd_out (may be NULL) gets the first fd it carried. Handles slab revocations. */
static int call_fds(gpupool_client *c, gpupool__req *req, gpupool__rep **out, int *fd_out, int send_fd,
                    gpupool__error *err) {
  pending *p = NULL;
  int fds[GPUPOOL_WIRE_MAX_FDS], nfds = 0, rc;
  if (fd_out)
    *fd_out = -1;
  if ((rc = gpupool__call_send(c, req, &p, send_fd, err)) != 0)
    return rc;
  if (gpupool__hook_sent) {
    pthread_mutex_unlock(&c->mu);
    gpupool__hook_sent(c, req);
    pthread_mutex_lock(&c->mu);
  }
  if ((rc = gpupool__call_wait(c, p, out, fds, &nfds, err)) != 0)
    return rc;
  for (int i = 0; i < nfds; i++) {
    if (i == 0 && fd_out)
      *fd_out = fds[0];
    else
      close(fds[i]);
  }
  return 0;
}

int gpupool__call(gpupool_client *c, gpupool__req *req, gpupool__rep **out, int *fd_out, gpupool__error *err) {
  return call_fds(c, req, out, fd_out, -1, err);
}

/* Called first by every public entry point (with c->mu held): a connection that the daemon
 * closed is replaced before the request, so holds never cross from one daemon to the next. */
int gpupool__ensure_connected(gpupool_client *c, gpupool__error *err) {
  if (!c->broken)
    return 0;
  if ((c->broken != GPUPOOL_ECLOSED && c->broken != GPUPOOL_EIO) || c->reconnect_ms <= 0 || !c->reconnect)
    return broken_err(c, err);
  return c->reconnect(c, err);
}

/* For requests that do not name a hold of the old connection (allocate, get, open,
 * unpublish, stats, trim, publish_file): when the daemon turns out to be gone, reconnect and
 * send once more. Safe: whatever the lost connection held was dropped with it. send_fd: an
 * fd that goes with the request (the caller keeps it), or -1. */
int gpupool__call_retry(gpupool_client *c, gpupool__req *req, gpupool__rep **out, int send_fd,
                        gpupool__error *err) {
  int rc = gpupool__ensure_connected(c, err);
  if (rc != 0)
    return rc;
  rc = call_fds(c, req, out, NULL, send_fd, err);
  if ((rc == GPUPOOL_ECLOSED || rc == GPUPOOL_EIO) && c->broken && c->reconnect_ms > 0) {
    err->code = 0; /* the lost connection's failure is not this call's: it goes again */
    if ((rc = gpupool__ensure_connected(c, err)) != 0)
      return rc;
    rc = call_fds(c, req, out, NULL, send_fd, err);
  }
  return rc;
}
