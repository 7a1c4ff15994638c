/*
 * The sending half of a connection: packing replies, sending or queueing them (a client whose
 * queue passes its limit is dropped, not buffered further), the events a connection is
 * polled for, and the drop after a protocol violation. Below the handlers, which send
 * through it; it calls nothing above it: a connection it must close is handed to the
 * connection layer (conn.c) through the server's close_conn, and its poll callback is the
 * server's conn_io.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "server_internal.h"
#include "state.h"

/* Close c now (from the connection layer: its waiters, replies held back and holds go). */
void gpd_conn_drop(gpd_conn *c, const char *why) { c->srv->close_conn(c, why); }

/* Every fd a client sent, and every copy of a file's fd, is closed off the loop: closing a file
 * on a stalled file system waits (FUSE sends FLUSH). Charged to the connection's tenant. */
void gpd_conn_close_fd(void *arg, int fd) {
  gpd_conn *c = arg;
  if (c->srv->fops)
    gpd_fileops_close(c->srv->fops, c->cl.tenant, fd);
  else if (fd >= 0)
    close(fd);
}

/* ---- sending -------------------------------------------------------------------------------- */

/* Send or queue a packed frame; takes buf. fds are duplicated when queued (the originals
 * stay the caller's). A client whose queue passes MAX_TX_QUEUE is dropped, not buffered. */
void gpd_conn_send(gpd_conn *c, uint8_t *buf, size_t len, const int *fds, int nfds) {
  int rc;
  if (c->closing) {
    free(buf);
    return;
  }
  /* A reply never tells of a name or version a crash right after it could lose. */
  gpd_state_sync(c->srv->reg);
  rc = gpupool__wire_txq_send(&c->txq, c->fd, buf, len, fds, nfds);
  if (rc < 0) {
    gpd_conn_drop(c, rc == GPUPOOL_EIO || rc == GPUPOOL_ECLOSED ? "write failed" : gpupool__errmsg());
    return;
  }
  gpd_conn_heap(c);
  gpd_conn_update_poll(c);
}

void gpd_conn_flush(gpd_conn *c) {
  int rc = gpupool__wire_txq_flush(&c->txq, c->fd);
  gpd_conn_heap(c);
  if (rc < 0) {
    gpd_conn_drop(c, "write failed");
    return;
  }
  if (rc == 1 && c->drop_after_flush) {
    gpd_conn_drop(c, "protocol violation");
    return;
  }
  gpd_conn_update_poll(c);
}

int gpd_pack_reply(gpd_conn *c, uint64_t seq, Gpupool__Wire__Reply *rep, uint8_t **buf, size_t *len) {
  rep->seq = seq;
  /* Piggyback slab revocations on every reply. */
  rep->n_revoke_slabs = c->cl.nrevoke;
  rep->revoke_slabs = c->cl.revoke;
  if (gpupool__wire_pack_reply(rep, buf, len) != 0) {
    gpd_conn_drop(c, "cannot pack a reply");
    return -1;
  }
  c->cl.nrevoke = 0;
  return 0;
}

void gpd_send_reply(gpd_conn *c, uint64_t seq, Gpupool__Wire__Reply *rep, const int *fds, int nfds) {
  uint8_t *buf;
  size_t len;
  /* Replies leave in order: one held back (see gpd_send_reply_fenced) may carry the export data
   * of a slab that later replies only name. */
  if (c->fenced_head) {
    gpd_park_reply(c, seq, rep, fds, nfds, NULL, 0);
    return;
  }
  if (gpd_pack_reply(c, seq, rep, &buf, &len) == 0)
    gpd_conn_send(c, buf, len, fds, nfds);
}

void gpd_send_error(gpd_conn *c, uint64_t seq, int code, const char *msg) {
  Gpupool__Wire__Reply rep = GPUPOOL__WIRE__REPLY__INIT;
  Gpupool__Wire__Error err = GPUPOOL__WIRE__ERROR__INIT;
  err.code = code;
  err.message = (char *)(msg && *msg ? msg : gpupool_strerror(code));
  rep.error = &err;
  c->srv->errors++;
  gpd_send_reply(c, seq, &rep, NULL, 0);
}

/* Reads stop once a connection is to be dropped: nothing it sends after a protocol violation
 * is looked at, so it cannot make the daemon buffer more. UV_DISCONNECT lets conn_io see a
 * hang-up without waiting for the connection's turn (see there). */
void gpd_conn_update_poll(gpd_conn *c) {
  int want = (c->drop_after_flush || c->fops_paused || c->ready_paused ? 0 : UV_READABLE | UV_DISCONNECT) |
             (c->txq.head ? UV_WRITABLE : 0);
  if (c->closing || want == c->poll_events)
    return;
  c->poll_events = want;
  if (want)
    uv_poll_start(&c->poll, want, c->srv->conn_io);
  else
    uv_poll_stop(&c->poll);
}

static void drop_timeout(uv_timer_t *t) {
  gpd_conn_drop(t->data, "it did not read its last reply within 1 s of a protocol violation");
}

/* After a protocol violation: send what is queued (the error saying why), read nothing more,
 * and hang up when the queue is out or after a second, whichever comes first. */
void gpd_conn_drop_after_flush(gpd_conn *c) {
  if (c->drop_after_flush || c->closing)
    return;
  c->drop_after_flush = 1;
  uv_timer_start(&c->hs_timer, drop_timeout, 1000, 0);
  gpd_conn_update_poll(c);
}

/* Recount what this connection's queue and input buffer hold on the heap, and drop it if its
 * queue passes max_queued_bytes_per_client or the daemon's total passes
 * max_queued_bytes_total (a client that never reads is dropped, not buffered for). */
void gpd_conn_heap(gpd_conn *c) {
  gpd_server *s = c->srv;
  const gpd_config *cfg = s->cfg;
  size_t h = c->txq.cost + c->in.cap + c->fenced_bytes;
  char why[320];
  s->heap = s->heap - c->heap + h;
  c->heap = h;
  if (c->closing)
    return;
  /* Replies held back until their buffers are ready (host fences) are queued output too: a
   * client that piles requests behind one that never completes is bounded like one that
   * does not read. */
  size_t queued = c->txq.cost + c->fenced_bytes;
  if (cfg->max_queued_bytes_per_client && queued > cfg->max_queued_bytes_per_client) {
    snprintf(why, sizeof why, "%s (%zu bytes queued, %zu of them held back until its buffers are ready, over "
             "max_queued_bytes_per_client %" PRIu64 ")",
             c->fenced_bytes > c->txq.cost ? "its replies pile up behind one that waits for a producer's GPU work"
                                            : "it does not read its replies",
             queued, c->fenced_bytes, cfg->max_queued_bytes_per_client);
    gpd_conn_drop(c, why);
  } else if (cfg->max_queued_bytes_total && s->heap > cfg->max_queued_bytes_total && queued > 0) {
    snprintf(why, sizeof why, "the daemon's queues hold %zu bytes, over max_queued_bytes_total %" PRIu64
             ", and this client has %zu of them unsent or unread", s->heap, cfg->max_queued_bytes_total, queued);
    gpd_conn_drop(c, why);
  }
}
