/*
 * gpupoold with an invalid configuration under socket activation: why it stays up, and how
 * it answers (below).
 */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>
#include <uv.h>

#include "backend.h"
#include "config.h"
#include "errors.h"
#include "paths.h"
#include "log.h"
#include "peers.h"
#include "registry.h"
#include "sd.h"
#include "server.h"
#include "wire.h"
#include "config_wait.h"

/* Close the three signal handles and the watchdog timer (NULL: none) of a loop that ends. */
void gpd_close_watch(uv_signal_t *sigint, uv_signal_t *sigterm, uv_signal_t *sighup, uv_timer_t *watchdog) {
  uv_close((uv_handle_t *)sigint, NULL);
  uv_close((uv_handle_t *)sigterm, NULL);
  uv_close((uv_handle_t *)sighup, NULL);
  if (watchdog)
    uv_close((uv_handle_t *)watchdog, NULL);
}

/* ---- a configuration error under socket activation ------------------------------------------
 *
 * Exiting on a bad configuration jams a socket-activated service: the connection that
 * started the daemon stays in the socket's queue, so systemd starts it again at once, five
 * times in a fraction of a second, hits the start limit and fails the socket; the client
 * only sees its connection closed. Instead the daemon stays up holding the socket, answers
 * every Hello with GPUPOOL_ECONFIG and the reason (so `gpupoolctl status` says what is
 * wrong), and on SIGHUP (systemctl reload) or a restart reads the configuration again.
 *
 * It serves those answers the way the daemon serves clients: every connection is read
 * without blocking from the loop, has handshake_timeout_ms (its default: the file cannot be
 * trusted) for its first frame, and counts against max_clients, max_clients_per_uid and
 * reserved_clients (their defaults), so a client that trickles its Hello or never sends one
 * holds only its own slot, and signals are handled at once. */

/* A Hello is a few hundred bytes; frames up to this size are read, larger ones get the
 * answer (with sequence number 0) without being read. It bounds what a connection costs. */
#define CE_MAX_FRAME 4096u
#define CE_ACCEPT_BATCH 32
#define CE_ACCEPT_BACKOFF_MS 250

typedef struct config_error_ctx config_error_ctx;

/* A connection waiting for its first frame. Unlinked and its fd closed at once when it is
 * done; freed in the close callback of its last handle. */
typedef struct ce_conn {
  struct ce_conn *prev, *next;
  config_error_ctx *e;
  int fd, handles_open;
  uid_t uid;
  uv_poll_t poll;
  uv_timer_t deadline;
  gpupool__wire_rx rx;
} ce_conn;

struct config_error_ctx {
  uv_loop_t *loop;
  gpd_retry_config_fn retry; /* reads the configuration again (SIGHUP) */
  void *retry_arg;
  int listen_fd;
  uv_poll_t poll;
  uv_timer_t accept_timer;
  uv_signal_t sigint, sigterm, sighup;
  uv_timer_t watchdog;
  int watchdog_on, fixed, accept_paused;
  gpd_config *cfg;
  gpupool__backend **be;
  ce_conn *conns;
  uint32_t nconns;
  /* The limits of normal mode, at their defaults. */
  uint32_t max_clients, max_per_uid, reserved, deadline_ms;
  char why[GPUPOOL__ERRMSG_MAX];
  char answer[GPUPOOL__ERRMSG_MAX + 256]; /* what every client is told */
};

/* One error frame, sent without blocking (it is small and the socket's buffer is empty: what
 * does not go out at once is dropped with the connection). */
static void ce_send_error(int fd, uint64_t seq, int code, const char *msg) {
  Gpupool__Wire__Reply rep = GPUPOOL__WIRE__REPLY__INIT;
  Gpupool__Wire__Error err = GPUPOOL__WIRE__ERROR__INIT;
  uint8_t *buf = NULL;
  size_t len, off = 0;

  err.code = code;
  err.message = (char *)msg;
  rep.seq = seq;
  rep.error = &err;
  if (gpupool__wire_pack_reply(&rep, &buf, &len) == 0)
    (void)gpupool__wire_send_some(fd, buf, len, &off, NULL, 0);
  free(buf);
}

static void ce_handle_closed(uv_handle_t *h) {
  ce_conn *c = h->data;
  if (--c->handles_open == 0)
    free(c);
}

/* Answer (seq: the request's, or 0 when it was not read) and close: the slot is free at once. */
static void ce_conn_done(ce_conn *c, int answer, uint64_t seq) {
  config_error_ctx *e = c->e;
  if (answer)
    ce_send_error(c->fd, seq, GPUPOOL_ECONFIG, e->answer);
  if (c->prev)
    c->prev->next = c->next;
  else
    e->conns = c->next;
  if (c->next)
    c->next->prev = c->prev;
  e->nconns--;
  uv_close((uv_handle_t *)&c->poll, ce_handle_closed);
  uv_close((uv_handle_t *)&c->deadline, ce_handle_closed);
  close(c->fd);
  gpupool__wire_rx_reset(&c->rx);
}

static void ce_on_readable(uv_poll_t *h, int status, int events) {
  ce_conn *c = h->data;
  gpupool__req *req;
  int rc;
  (void)events;
  if (status < 0) {
    ce_conn_done(c, 0, 0);
    return;
  }
  rc = gpupool__wire_rx_read(&c->rx, c->fd);
  if (rc == 0)
    return; /* more to come, within the deadline */
  if (rc < 0) {
    /* Gone, or a frame this mode does not read (too large, fds): tell it anyway. */
    ce_conn_done(c, rc != GPUPOOL_ECLOSED, 0);
    return;
  }
  req = gpupool__wire_unpack_request(&c->rx);
  ce_conn_done(c, 1, req ? req->seq : 0);
  if (req)
    gpupool__wire__request__free_unpacked(req, NULL);
}

static void ce_on_deadline(uv_timer_t *t) {
  /* Too slow for its first frame: the reason anyway, then the slot goes to the next one. */
  ce_conn_done(t->data, 1, 0);
}

/* The connection limits of normal mode; 0, or -1 when the connection must be turned away. */
static int ce_over_limits(const config_error_ctx *e, uid_t uid) {
  int admin = uid == 0 || uid == geteuid();
  uint32_t cap = e->max_clients, same = 0;
  if (cap && !admin)
    cap = e->reserved < cap ? cap - e->reserved : 0;
  if (e->max_clients && e->nconns >= cap)
    return -1;
  if (admin || !e->max_per_uid)
    return 0;
  for (const ce_conn *c = e->conns; c; c = c->next)
    if (c->uid == uid && ++same >= e->max_per_uid)
      return -1;
  return 0;
}

static void ce_on_accept(uv_poll_t *h, int status, int events);

static void ce_accept_resume(uv_timer_t *t) {
  config_error_ctx *e = t->data;
  if (!e->accept_paused)
    return;
  e->accept_paused = 0;
  uv_poll_start(&e->poll, UV_READABLE, ce_on_accept);
}

static void ce_on_accept(uv_poll_t *h, int status, int events) {
  config_error_ctx *e = h->data;
  (void)events;
  if (status < 0)
    return;
  /* A bounded batch per wake-up, as in normal mode: the poll comes back for the rest. */
  for (int batch = 0; batch < CE_ACCEPT_BATCH; batch++) {
    struct ucred cred;
    socklen_t cl = sizeof cred;
    ce_conn *c;
    int fd = accept4(e->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED)
        continue;
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        /* Rest the listener rather than spin on it; those connected are still answered. */
        e->accept_paused = 1;
        uv_poll_stop(&e->poll);
        uv_timer_start(&e->accept_timer, ce_accept_resume, CE_ACCEPT_BACKOFF_MS, 0);
      }
      return;
    }
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &cl) != 0 || ce_over_limits(e, cred.uid) != 0 ||
        !(c = calloc(1, sizeof *c))) {
      /* Over the limits: the reason at once, without waiting for its Hello. */
      ce_send_error(fd, 0, GPUPOOL_ECONFIG, e->answer);
      close(fd);
      continue;
    }
    c->e = e;
    c->fd = fd;
    c->uid = cred.uid;
    gpupool__wire_rx_init(&c->rx, CE_MAX_FRAME);
    uv_poll_init(e->loop, &c->poll, fd);
    uv_timer_init(e->loop, &c->deadline);
    c->poll.data = c->deadline.data = c;
    c->handles_open = 2;
    c->next = e->conns;
    if (e->conns)
      e->conns->prev = c;
    e->conns = c;
    e->nconns++;
    uv_poll_start(&c->poll, UV_READABLE, ce_on_readable);
    if (e->deadline_ms)
      uv_timer_start(&c->deadline, ce_on_deadline, e->deadline_ms, 0);
  }
}

/* Leave the mode: every waiting connection is closed (a client retries against the daemon
 * that serves now, or gets a fresh answer), and every handle of the mode is closed. */
static void config_error_stop(config_error_ctx *e) {
  while (e->conns)
    ce_conn_done(e->conns, 0, 0);
  uv_close((uv_handle_t *)&e->poll, NULL);
  uv_close((uv_handle_t *)&e->accept_timer, NULL);
  gpd_close_watch(&e->sigint, &e->sigterm, &e->sighup, e->watchdog_on ? &e->watchdog : NULL);
}

static void note_config_error(config_error_ctx *e) {
  snprintf(e->why, sizeof e->why, "%s", gpupool__errmsg());
  snprintf(e->answer, sizeof e->answer,
           "gpupoold is not serving: its configuration is invalid: %s; fix it (check with "
           "'gpupoold --check-config'), then 'systemctl reload gpupoold'",
           e->why);
  GPUPOOL__ERROR("configuration error, not serving: %s (clients are told so; fix it and run "
                 "'systemctl reload gpupoold')", e->why);
  gpd_sd_notifyf("STATUS=Configuration error, not serving: %s", e->why);
}

static void on_config_error_signal(uv_signal_t *h, int signum) {
  config_error_ctx *e = h->data;
  struct timespec ts;
  if (signum != SIGHUP) {
    GPUPOOL__INFO("shutting down (%s) with the configuration still invalid", signum == SIGINT ? "SIGINT" : "SIGTERM");
    gpd_sd_notify("STOPPING=1");
    config_error_stop(e);
    return;
  }
  clock_gettime(CLOCK_MONOTONIC, &ts);
  gpd_sd_notifyf("RELOADING=1\nMONOTONIC_USEC=%llu",
                 (unsigned long long)ts.tv_sec * 1000000ull + (unsigned long long)ts.tv_nsec / 1000);
  if (e->retry(e->retry_arg, e->cfg, e->be) != 0) {
    note_config_error(e);
    gpd_sd_notify("READY=1");
    return;
  }
  GPUPOOL__INFO("reload: the configuration is valid now; starting to serve");
  e->fixed = 1;
  config_error_stop(e);
}

static void on_config_error_watchdog(uv_timer_t *t) {
  (void)t;
  gpd_sd_notify("WATCHDOG=1");
}

int gpd_wait_for_config(uv_loop_t *loop, int listen_fd, gpd_config *cfg, gpupool__backend **be,
                        gpd_retry_config_fn retry, void *retry_arg) {
  config_error_ctx e = {.loop = loop, .retry = retry, .retry_arg = retry_arg, .listen_fd = listen_fd, .cfg = cfg,
                        .be = be};
  uint64_t wd = gpd_sd_watchdog_usec();
  static gpd_config def; /* large; this runs once */

  note_config_error(&e); /* first: it reads the reason from the error message */
  /* The limits at their defaults: what was read of the file cannot be trusted. */
  gpd_config_defaults(&def);
  e.max_clients = def.max_clients;
  e.max_per_uid = def.max_clients_per_uid;
  e.reserved = def.reserved_clients;
  e.deadline_ms = def.handshake_timeout_ms;
  uv_poll_init(loop, &e.poll, listen_fd);
  uv_timer_init(loop, &e.accept_timer);
  uv_signal_init(loop, &e.sigint);
  uv_signal_init(loop, &e.sigterm);
  uv_signal_init(loop, &e.sighup);
  e.poll.data = e.accept_timer.data = e.sigint.data = e.sigterm.data = e.sighup.data = &e;
  uv_poll_start(&e.poll, UV_READABLE, ce_on_accept);
  uv_signal_start(&e.sigint, on_config_error_signal, SIGINT);
  uv_signal_start(&e.sigterm, on_config_error_signal, SIGTERM);
  uv_signal_start(&e.sighup, on_config_error_signal, SIGHUP);
  if (wd) {
    uv_timer_init(loop, &e.watchdog);
    uv_timer_start(&e.watchdog, on_config_error_watchdog, wd / 2000 ? wd / 2000 : 1, wd / 2000 ? wd / 2000 : 1);
    e.watchdog_on = 1;
  }
  /* Ready: the socket is answered (systemd would otherwise time the start out and retry). */
  gpd_sd_notify("READY=1");
  uv_run(loop, UV_RUN_DEFAULT);
  return e.fixed;
}
