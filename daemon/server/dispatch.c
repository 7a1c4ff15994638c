/*
 * The one dispatch point: a frame read from a connection is checked (fds it may carry, its
 * fields before decoding), unpacked, handed to its request's handler, and answered with an
 * error when the handler refuses it; every request is counted in the metrics here.
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

#include "server_internal.h"

static int is_admin(const gpd_conn *c) { return c->cl.uid == 0 || c->cl.uid == geteuid(); }

static int admin_denied(gpd_conn *c) {
  return gpupool__err(GPUPOOL_EPERM,
                      "this request is for operators: it needs root or the daemon's own uid (%u); "
                      "you are uid %u",
                      (unsigned)geteuid(), (unsigned)c->cl.uid);
}

/* Each row's handler, indexed like gpupool__request_kinds. */
static gpd_handler *const handlers[GPUPOOL__NREQUESTS] = {
#define HANDLER(CASE, name, Message, flags) [GPUPOOL__REQ_##CASE] = gpd_handle_##name,
    GPUPOOL__REQUEST_MAP(HANDLER)
#undef HANDLER
};

/* The one dispatch point: the row of the request's kind says what is checked before its
 * handler runs. Returns 0 when a reply was sent or deferred, else an error code for the caller
 * to send. */
static int dispatch(gpd_conn *c, const Gpupool__Wire__Request *req, int *deferred) {
  int i = gpupool__request_index((int)req->body_case);
  unsigned flags = i < 0 ? GPUPOOL__REQ_NEEDS_HELLO : gpupool__request_kinds[i].flags;
  if (!c->hello_done && (flags & GPUPOOL__REQ_NEEDS_HELLO)) {
    gpd_conn_drop_after_flush(c);
    return gpupool__err(GPUPOOL_EPROTO, "the first request on a connection must be Hello");
  }
  if (req->n_unmapped_slabs)
    gpd_unmapped(c->srv->reg, &c->cl, req->unmapped_slabs, req->n_unmapped_slabs);
  if (i < 0)
    return gpupool__err(GPUPOOL_EPROTO,
                        "unknown request type (field %d); this daemon (%s) may be older than the client",
                        (int)req->body_case, GPUPOOL_VERSION_STRING);
  if ((flags & GPUPOOL__REQ_ADMIN) && !is_admin(c))
    return admin_denied(c);
  return handlers[i](c, req, (flags & GPUPOOL__REQ_MAY_WAIT) ? deferred : NULL);
}

void gpd_handle_frame(gpd_conn *c, const uint8_t *payload, uint32_t len) {
  gpd_server *s = c->srv;
  Gpupool__Wire__Request *req;
  gpupool__wire_verdict verdict;
  uint64_t t0 = gpd_now_ns();
  int rc, deferred = 0, body = 0;

  s->requests++;
  if (c->fds_pending) {
    /* Clients never send fds: they were closed on arrival; refuse the frame they came with. */
    c->fds_pending = 0;
    gpd_send_error(c, 0, GPUPOOL_EFD, "the daemon accepts no file descriptors from clients; they were closed");
    return;
  }
  c->frame_fd = -1;
  if (gpupool__wire_inbuf_frame_nfds(&c->in) > 0) {
    /* Only PublishFile carries an fd, and only one. */
    int nfds = gpupool__wire_inbuf_frame_nfds(&c->in);
    c->frame_fd = gpupool__wire_inbuf_take_fd(&c->in);
    if (nfds > 1) {
      gpd_conn_close_fd(c, c->frame_fd);
      c->frame_fd = -1;
      gpd_send_error(c, 0, GPUPOOL_EFD, "a request carries at most one of the client's file descriptors (PublishFile's file); these were "
                 "closed");
      return;
    }
  }
  /* A linear, allocation-free pass first: protobuf-c would allocate for every unknown field
   * and cut strings at a NUL. A frame it refuses without being malformed is answered and the
   * connection kept; a malformed one goes the way of any undecodable frame below. */
  if ((rc = gpupool__wire_validate(&gpupool__wire__request__descriptor, payload, len, &verdict)) != 0 &&
      !verdict.malformed) {
    if (c->frame_fd >= 0)
      close(c->frame_fd);
    c->frame_fd = -1;
    GPUPOOL__DEBUG("client %" PRIu64 ": frame refused before decoding: %s", c->cl.id, gpupool__errmsg());
    gpd_send_error(c, verdict.seq, rc, gpupool__errmsg());
    gpd_metrics_request(s->metrics, 0, rc, gpd_now_ns() - t0);
    return;
  }
  req = rc == 0 ? gpupool__wire__request__unpack(NULL, len, payload) : NULL;
  if (req && c->frame_fd >= 0 && req->body_case != GPUPOOL__WIRE__REQUEST__BODY_PUBLISH_FILE) {
    gpd_conn_close_fd(c, c->frame_fd);
    c->frame_fd = -1;
    gpd_send_error(c, req->seq, GPUPOOL_EFD, "the daemon accepts file descriptors only with PublishFile; the one sent with this "
                 "request was closed");
    gpupool__wire__request__free_unpacked(req, NULL);
    return;
  }
  if (!req) {
    if (c->frame_fd >= 0)
      gpd_conn_close_fd(c, c->frame_fd);
    c->frame_fd = -1;
    GPUPOOL__PEER_WARN(&c->cl.log_rl, c->cl.id, "client %" PRIu64 " (pid %d) sent a malformed frame; dropping it",
                       c->cl.id, (int)c->cl.pid);
    gpd_conn_drop_after_flush(c);
    gpd_send_error(c, 0, GPUPOOL_EPROTO, "malformed request frame (not a valid gpupool Request); closing the connection");
    gpd_metrics_request(s->metrics, 0, GPUPOOL_EPROTO, gpd_now_ns() - t0);
    return;
  }
  body = (int)req->body_case;
  c->host_fences = req->host_fences;
  gpupool__err_clear();
  rc = dispatch(c, req, &deferred);
  if (rc != 0) {
    GPUPOOL__DEBUG("client %" PRIu64 ": %s request refused: %s", c->cl.id, gpupool__request_name(body),
                   gpupool__errmsg());
    if (rc != GPUPOOL_ENOSPC && rc != GPUPOOL_ENOENT && rc != GPUPOOL_ETIMEDOUT)
      GPUPOOL__PEER_INFO(&c->cl.log_rl, c->cl.id, "client %" PRIu64 " (pid %d): refused %s: %s", c->cl.id,
                         (int)c->cl.pid, gpupool_err_name(rc), gpupool__errmsg());
    gpd_send_error(c, req->seq, rc, gpupool__errmsg());
  }
  if (c->frame_fd >= 0) {
    gpd_conn_close_fd(c, c->frame_fd); /* refused before the handler took it */
    c->frame_fd = -1;
  }
  if (!deferred)
    gpd_metrics_request(s->metrics, body, rc, gpd_now_ns() - t0);
  if (s->trace)
    fprintf(s->trace, "%d %.1f daemon-req%d %.1fus %" PRIu64 "\n", (int)getpid(), (double)t0 / 1e3, body,
            (double)(gpd_now_ns() - t0) / 1e3, req->seq);
  if (gpd_now_ns() - t0 > 50000)
    GPUPOOL__DEBUG("slow %s request from client %" PRIu64 ": %" PRIu64 " us", gpupool__request_name(body), c->cl.id,
                   (gpd_now_ns() - t0) / 1000);
  gpupool__wire__request__free_unpacked(req, NULL);
  if (s->reg->memory_returned)
    gpd_retry_waiters(s->reg, NULL);
}
