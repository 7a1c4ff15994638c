/*
 * The metrics' scrapers: one HTTP/1.0 answer per connection on the Unix socket or the TCP
 * listener (GET or HEAD of /metrics or / gets the text, another path 404, another method 405),
 * and the bounds on who may hold a connection: slots per listener, a few per uid (SO_PEERCRED;
 * sock_diag for a TCP peer on this host) or per source address, a couple kept for root and the
 * daemon's uid, a deadline whether or not the peer reads. metrics_export.c starts the
 * listeners.
 */
#include <errno.h>
#include <dirent.h>
#include <fcntl.h>
#include <linux/inet_diag.h>
#include <linux/netlink.h>
#include <linux/sock_diag.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "errors.h"
#include "paths.h"
#include "log.h"
#include "metrics_internal.h"

#define CT_METRICS "text/plain; version=0.0.4; charset=utf-8"

static void conn_closed(uv_handle_t *h) {
  conn *c = h->data;
  gpd_metrics *m = c->m;
  conn **pp;

  if (--c->open_handles > 0)
    return;
  for (pp = &m->conns; *pp != NULL; pp = &(*pp)->next)
    if (*pp == c) {
      *pp = c->next;
      break;
    }
  m->nconns--;
  free(c->resp);
  free(c);
  gpd_metrics_maybe_free(m);
}

void gpd_metrics_conn_close(conn *c) {
  if (!uv_is_closing((uv_handle_t *)&c->pipe))
    uv_close((uv_handle_t *)&c->pipe, conn_closed);
  if (!uv_is_closing((uv_handle_t *)&c->timer))
    uv_close((uv_handle_t *)&c->timer, conn_closed);
}

static void on_written(uv_write_t *wr, int status) {
  (void)status;
  gpd_metrics_conn_close(wr->data);
}

static void on_write_timeout(uv_timer_t *t) {
  gpd_metrics_conn_close(t->data);
}

/* What the request line asks for: the status line, extra headers and whether the metrics
 * (or a short text) go in the body. Only GET and HEAD of /metrics (or /) are served, as
 * Prometheus and curl ask; an empty request (a peer that sends nothing) gets the metrics. */
typedef struct {
  const char *status;
  const char *extra;
  const char *body; /* NULL: the metrics text */
  int head_only;
} http_answer;

static http_answer route(const conn *c) {
  char method[16] = "", target[96] = "";
  http_answer a = {"200 OK", "", NULL, 0};
  char *q;

  if (c->linelen == 0)
    return a;
  if (sscanf(c->line, "%15s %95s", method, target) != 2 || target[0] != '/') {
    a.status = "400 Bad Request";
    a.body = "bad request: send GET /metrics\n";
    return a;
  }
  if ((q = strchr(target, '?')) != NULL)
    *q = '\0';
  if (strcmp(method, "GET") != 0 && strcmp(method, "HEAD") != 0) {
    a.status = "405 Method Not Allowed";
    a.extra = "Allow: GET, HEAD\r\n";
    a.body = "method not allowed: use GET or HEAD\n";
    return a;
  }
  a.head_only = method[0] == 'H';
  if (strcmp(target, "/metrics") != 0 && strcmp(target, "/") != 0) {
    a.status = "404 Not Found";
    a.body = "not found: the metrics are at /metrics\n";
  }
  return a;
}

static void conn_answer(conn *c) {
  http_answer a = route(c);
  char *text = NULL;
  const char *body;
  char head[256];
  size_t tl, hl;
  uv_buf_t buf;

  if (c->answered)
    return;
  c->answered = 1;
  uv_timer_stop(&c->timer);
  if (a.body == NULL) {
    text = gpd_metrics_snapshot_text(c->m);
    if (text == NULL) {
      gpd_metrics_conn_close(c);
      return;
    }
  }
  body = text != NULL ? text : a.body;
  tl = strlen(body);
  hl = (size_t)snprintf(head, sizeof head,
                        "HTTP/1.0 %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n%sConnection: close\r\n\r\n",
                        a.status, text != NULL ? CT_METRICS : "text/plain; charset=utf-8", tl, a.extra);
  if (a.head_only)
    tl = 0;
  c->resp = malloc(hl + tl);
  if (c->resp == NULL) {
    free(text);
    GPUPOOL__PEER_WARN(NULL, 0, "metrics: out of memory answering a metrics request");
    gpd_metrics_conn_close(c);
    return;
  }
  memcpy(c->resp, head, hl);
  memcpy(c->resp + hl, body, tl);
  free(text);
  buf = uv_buf_init(c->resp, (unsigned)(hl + tl));
  c->wr.data = c;
  if (uv_write(&c->wr, (uv_stream_t *)&c->pipe, &buf, 1, on_written) != 0 ||
      uv_timer_start(&c->timer, on_write_timeout, WRITE_TIMEOUT_MS, 0) != 0)
    gpd_metrics_conn_close(c);
}

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf) {
  conn *c = h->data;
  (void)suggested;
  *buf = uv_buf_init(c->rbuf, sizeof(c->rbuf));
}

/* The request is read (so closing does not reset the peer's connection); its line decides
 * the answer, its headers are ignored. The answer goes out at the blank line that ends the
 * request head, at EOF, or after a second. */
static void on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf) {
  conn *c = s->data;

  if (nread < 0) {
    if (nread == UV_EOF)
      conn_answer(c);
    else
      gpd_metrics_conn_close(c);
    return;
  }
  for (ssize_t i = 0; i < nread && !c->answered; i++) {
    if (!c->line_done) {
      if (buf->base[i] == '\r' || buf->base[i] == '\n')
        c->line_done = c->linelen > 0;
      else if (c->linelen < sizeof c->line - 1)
        c->line[c->linelen++] = buf->base[i];
    }
    memmove(c->tail, c->tail + 1, sizeof(c->tail) - 1);
    c->tail[sizeof(c->tail) - 1] = buf->base[i];
    if (memcmp(c->tail, "\r\n\r\n", 4) == 0 || memcmp(c->tail + 2, "\n\n", 2) == 0)
      conn_answer(c);
  }
  c->seen += (size_t)nread;
  if (c->seen >= REQ_MAX)
    conn_answer(c);
}

static void on_req_timeout(uv_timer_t *t) {
  conn_answer(t->data);
}

static void drop_closed(uv_handle_t *h) {
  gpd_metrics *m = h->data;
  m->drop_busy = 0;
  gpd_metrics_handle_closed(h);
}

static void drop_conn(gpd_metrics *m, uv_stream_t *srv) {
  if (m->drop_busy || uv_pipe_init(m->loop, &m->drop_pipe, 0) != 0)
    return;
  m->drop_busy = 1;
  m->open_handles++;
  m->drop_pipe.data = m;
  (void)uv_accept(srv, (uv_stream_t *)&m->drop_pipe);
  uv_close((uv_handle_t *)&m->drop_pipe, drop_closed);
}

/* Puts c (its stream initialised, open_handles set) on m's list. */
static void conn_link(gpd_metrics *m, conn *c) {
  c->m = m;
  c->next = m->conns;
  m->conns = c;
  m->nconns++;
}

/* The uid owning the other end of a TCP connection from this host, through sock_diag (the
 * same lookup as `ss -e`): 0 and *uid, or -1 when the peer is not local or the lookup is not
 * possible (e.g. netlink denied by the service's sandbox). */
static int local_tcp_uid(const struct sockaddr_storage *peer, const struct sockaddr_storage *self, uid_t *uid) {
  struct {
    struct nlmsghdr nlh;
    struct inet_diag_req_v2 r;
  } req;
  union {
    struct nlmsghdr nlh;
    char buf[1024];
  } rep;
  struct sockaddr_nl nl = {.nl_family = AF_NETLINK};
  const struct inet_diag_msg *msg;
  struct timeval tv = {0, 100000};
  ssize_t n;
  int fd, rc = -1;

  if (peer->ss_family != self->ss_family || (peer->ss_family != AF_INET && peer->ss_family != AF_INET6))
    return -1;
  memset(&req, 0, sizeof req);
  req.nlh.nlmsg_len = sizeof req;
  req.nlh.nlmsg_type = SOCK_DIAG_BY_FAMILY;
  req.nlh.nlmsg_flags = NLM_F_REQUEST;
  req.r.sdiag_family = (uint8_t)peer->ss_family;
  req.r.sdiag_protocol = IPPROTO_TCP;
  req.r.idiag_states = ~0u;
  /* The peer's socket: its own address and port first, ours as its destination. */
  if (peer->ss_family == AF_INET) {
    const struct sockaddr_in *p = (const void *)peer, *l = (const void *)self;
    req.r.id.idiag_sport = p->sin_port;
    req.r.id.idiag_dport = l->sin_port;
    memcpy(req.r.id.idiag_src, &p->sin_addr, 4);
    memcpy(req.r.id.idiag_dst, &l->sin_addr, 4);
  } else {
    const struct sockaddr_in6 *p = (const void *)peer, *l = (const void *)self;
    req.r.id.idiag_sport = p->sin6_port;
    req.r.id.idiag_dport = l->sin6_port;
    memcpy(req.r.id.idiag_src, &p->sin6_addr, 16);
    memcpy(req.r.id.idiag_dst, &l->sin6_addr, 16);
  }
  req.r.id.idiag_cookie[0] = INET_DIAG_NOCOOKIE;
  req.r.id.idiag_cookie[1] = INET_DIAG_NOCOOKIE;
  fd = socket(AF_NETLINK, SOCK_DGRAM | SOCK_CLOEXEC, NETLINK_SOCK_DIAG);
  if (fd < 0)
    return -1;
  /* The kernel answers at once; the bound only guards the loop against a surprise. */
  (void)setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  if (sendto(fd, &req, sizeof req, 0, (struct sockaddr *)&nl, sizeof nl) != (ssize_t)sizeof req)
    goto out;
  n = recv(fd, &rep, sizeof rep, 0);
  if (n < (ssize_t)NLMSG_LENGTH(sizeof *msg) || !NLMSG_OK(&rep.nlh, (size_t)n) ||
      rep.nlh.nlmsg_type != SOCK_DIAG_BY_FAMILY)
    goto out;
  msg = NLMSG_DATA(&rep.nlh);
  *uid = msg->idiag_uid;
  rc = 0;
out:
  close(fd);
  return rc;
}

/* Records who is at the other end of c, just accepted: 0, or -1 when that cannot be told. */
static int conn_identify(conn *c) {
  uv_os_fd_t fd;

  if (uv_fileno((uv_handle_t *)&c->pipe, &fd) != 0)
    return -1;
  if (!c->on_tcp) {
    struct ucred cred;
    socklen_t len = sizeof(cred);
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0)
      return -1;
    c->has_uid = 1;
    c->uid = cred.uid;
  } else {
    struct sockaddr_storage self;
    int n = sizeof c->addr, ns = sizeof self;
    if (uv_tcp_getpeername(&c->tcp, (struct sockaddr *)&c->addr, &n) != 0 ||
        uv_tcp_getsockname(&c->tcp, (struct sockaddr *)&self, &ns) != 0)
      return -1;
    c->has_uid = local_tcp_uid(&c->addr, &self, &c->uid) == 0;
  }
  return 0;
}

/* Says (within the limits of what peers may log) why c was closed unanswered. */
static void refused(gpd_metrics *m, const conn *c, const char *why) {
  char who[INET6_ADDRSTRLEN + 32] = "";
  (void)m;
  if (c->has_uid)
    snprintf(who, sizeof who, "uid %u", (unsigned)c->uid);
  else if (c->addr.ss_family == AF_INET)
    inet_ntop(AF_INET, &((const struct sockaddr_in *)&c->addr)->sin_addr, who, sizeof who);
  else if (c->addr.ss_family == AF_INET6)
    inet_ntop(AF_INET6, &((const struct sockaddr_in6 *)&c->addr)->sin6_addr, who, sizeof who);
  GPUPOOL__PEER_INFO(NULL, 0, "metrics: closed a %s connection from %s unanswered: %s", c->on_tcp ? "TCP" : "Unix-socket",
                     who[0] ? who : "an unknown peer", why);
}

/* Whether a and b count as one peer: the same uid where both are known, else the same
 * source address. */
static int same_peer(const conn *a, const conn *b) {
  if (a->has_uid || b->has_uid)
    return a->has_uid && b->has_uid && a->uid == b->uid;
  if (a->addr.ss_family != b->addr.ss_family)
    return 0;
  if (a->addr.ss_family == AF_INET)
    return !memcmp(&((const struct sockaddr_in *)&a->addr)->sin_addr,
                   &((const struct sockaddr_in *)&b->addr)->sin_addr, sizeof(struct in_addr));
  if (a->addr.ss_family == AF_INET6)
    return !memcmp(&((const struct sockaddr_in6 *)&a->addr)->sin6_addr,
                   &((const struct sockaddr_in6 *)&b->addr)->sin6_addr, sizeof(struct in6_addr));
  return 0;
}

/* Whether c, just accepted and identified, may take one of its listener's slots: within the
 * listener's MAX_CONNS, outside the RESERVED_CONNS unless root or the daemon's uid, and within
 * its peer's MAX_CONNS_PER_UID. Sets *why to the reason when not. */
static int slot_allows(gpd_metrics *m, const conn *c, const char **why) {
  int total = 0, same = 0;
  int operator = c->has_uid && (c->uid == 0 || c->uid == geteuid());

  /* Connections already closing are gone by the next loop turn: they do not count. */
  for (const conn *o = m->conns; o != NULL; o = o->next) {
    if (o == c || o->on_tcp != c->on_tcp || uv_is_closing((const uv_handle_t *)&o->pipe))
      continue;
    total++;
    same += same_peer(o, c);
  }
  if (total >= MAX_CONNS || (!operator && total >= MAX_CONNS - RESERVED_CONNS)) {
    *why = "every slot is taken";
    return 0;
  }
  if (same >= MAX_CONNS_PER_UID) {
    *why = c->has_uid ? "its uid holds its share of the slots" : "its address holds its share of the slots";
    return 0;
  }
  return 1;
}

void gpd_metrics_on_resume(uv_timer_t *t) {
  gpd_metrics *m = t->data;
  m->accepts = 0;
  for (int k = 0; k < 2; k++) {
    uv_stream_t *srv = m->deferred[k];
    m->deferred[k] = NULL;
    /* A listener closed meanwhile took its waiting connection with it. */
    if (srv != NULL && !uv_is_closing((uv_handle_t *)srv))
      gpd_metrics_on_conn(srv, 0);
  }
}

void gpd_metrics_on_conn(uv_stream_t *srv, int status) {
  gpd_metrics *m = srv->data;
  const char *why = NULL;
  conn *c;

  if (status < 0) {
    GPUPOOL__PEER_WARN(NULL, 0, "metrics: accept on %s failed: %s", m->sock, uv_strerror(status));
    return;
  }
  if (m->resume_on) {
    if (m->accepts >= ACCEPT_BATCH) {
      /* Not taken now: libuv keeps it and stops watching this listener until the resume. */
      m->deferred[srv == (uv_stream_t *)&m->tcp_srv] = srv;
      return;
    }
    if (m->accepts++ == 0 && uv_timer_start(&m->resume, gpd_metrics_on_resume, 0, 0) != 0)
      m->accepts = 0; /* no resume to count on: every connection taken at once, as before */
  }
  c = calloc(1, sizeof(*c));
  if (c == NULL) {
    drop_conn(m, srv);
    return;
  }
  if ((srv == (uv_stream_t *)&m->tcp_srv ? uv_tcp_init(m->loop, &c->tcp)
                                           : uv_pipe_init(m->loop, &c->pipe, 0)) != 0) {
    free(c);
    drop_conn(m, srv);
    return;
  }
  if (uv_timer_init(m->loop, &c->timer) != 0) {
    /* The pipe is a handle now: it goes through close, and conn_closed frees c. */
    c->pipe.data = c;
    c->open_handles = 1;
    conn_link(m, c);
    uv_close((uv_handle_t *)&c->pipe, conn_closed);
    drop_conn(m, srv);
    return;
  }
  c->pipe.data = c;
  c->timer.data = c;
  c->open_handles = 2;
  conn_link(m, c);
  if (uv_accept(srv, (uv_stream_t *)&c->pipe) != 0) {
    gpd_metrics_conn_close(c);
    return;
  }
  c->on_tcp = srv == (uv_stream_t *)&m->tcp_srv;
  /* Slow or idle scrapers must not pile up connections in the daemon, nor one user take
   * every slot and lock the others (the scraper) out. */
  if (conn_identify(c) != 0 || !slot_allows(m, c, &why)) {
    refused(m, c, why ? why : "its peer cannot be identified");
    gpd_metrics_conn_close(c);
    return;
  }
  if (uv_read_start((uv_stream_t *)&c->pipe, on_alloc, on_read) != 0 ||
      uv_timer_start(&c->timer, on_req_timeout, REQ_TIMEOUT_MS, 0) != 0)
    gpd_metrics_conn_close(c);
}
