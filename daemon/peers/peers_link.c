/*
 * Peers' control connections (see peers.c): the TCP connections to and from other daemons,
 * their length-prefixed PeerFrames, the handshake (Hello, Challenge, Auth, Welcome, with
 * HMAC-SHA256 over both nonces, Hello's addresses and both instances), the caps on
 * connections not authenticated yet and the fds kept in reserve, and the dispatch of the
 * frames once a connection is up to the fetching (peers_fetch.c) and serving (peers_serve.c)
 * sides. A connection's end ends what went on it.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <sys/random.h>
#include <sys/resource.h>

#include "peers_internal.h"
#include "sha256.h"

static int same_addr(const struct sockaddr_storage *a, const struct sockaddr_storage *b, int with_port) {
  if (a->ss_family != b->ss_family)
    return 0;
  if (a->ss_family == AF_INET) {
    const struct sockaddr_in *x = (const void *)a, *y = (const void *)b;
    return x->sin_addr.s_addr == y->sin_addr.s_addr && (!with_port || x->sin_port == y->sin_port);
  }
  if (a->ss_family == AF_INET6) {
    const struct sockaddr_in6 *x = (const void *)a, *y = (const void *)b;
    return !memcmp(&x->sin6_addr, &y->sin6_addr, sizeof x->sin6_addr) && (!with_port || x->sin6_port == y->sin6_port);
  }
  return 0;
}

static void fmt_addr(const struct sockaddr_storage *a, char *buf, size_t len) {
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (a->ss_family == AF_INET) {
    const struct sockaddr_in *x = (const void *)a;
    inet_ntop(AF_INET, &x->sin_addr, host, sizeof host);
    port = ntohs(x->sin_port);
  } else if (a->ss_family == AF_INET6) {
    const struct sockaddr_in6 *x = (const void *)a;
    inet_ntop(AF_INET6, &x->sin6_addr, host, sizeof host);
    port = ntohs(x->sin6_port);
  }
  snprintf(buf, len, "%s:%d", host, port);
}

/* HMAC-SHA256(secret, role | what the handshake carried): both nonces, the fetching side's
 * worker address and listen address from its Hello, and both instances. A Hello altered on
 * the way (another worker to send the data to, another listen to be known by) or a Challenge
 * with another instance fails authentication on both sides. */
static void mac(const plink *l, const char *role, const uint8_t *nf, const uint8_t *ns, const uint8_t *waddr,
                size_t waddr_len, const char *listen, uint8_t out[32]) {
  uint8_t wl[4], ll[4], inst[16];
  size_t listen_len = listen ? strlen(listen) : 0;
  for (int i = 0; i < 4; i++) {
    wl[i] = (uint8_t)(waddr_len >> (8 * i));
    ll[i] = (uint8_t)(listen_len >> (8 * i));
  }
  for (int i = 0; i < 8; i++) {
    inst[i] = (uint8_t)(l->instance_f >> (8 * i));
    inst[8 + i] = (uint8_t)(l->instance_s >> (8 * i));
  }
  {
    const void *parts[] = {role, nf, ns, wl, waddr, ll, listen ? listen : "", inst};
    size_t lens[] = {strlen(role), NONCE_LEN, NONCE_LEN, 4, waddr_len, 4, listen_len, sizeof inst};
    gpupool__hmac_sha256(l->peer->secret, l->peer->secret_len, parts, lens, 8, out);
  }
}

/* The fetching side's MAC: over its own Hello. */
static void mac_mine(const plink *l, const char *role, uint8_t out[32]) {
  const void *addr;
  size_t alen;
  gpd_ucx_address(l->P->ucx, &addr, &alen);
  mac(l, role, l->nonce_mine, l->nonce_theirs, addr, alen, l->P->listen_addr, out);
}

/* The serving side's MAC: over the Hello it received. */
static void mac_theirs(const plink *l, const char *role, uint8_t out[32]) {
  mac(l, role, l->nonce_theirs, l->nonce_mine, l->waddr, l->waddr_len, l->hello_listen, out);
}

uint64_t gpd_pr_fds_free(void) {
  struct rlimit rl;
  DIR *d;
  struct dirent *e;
  uint64_t n = 0;
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0)
    return 0;
  if (rl.rlim_cur == RLIM_INFINITY)
    return UINT64_MAX;
  if (!(d = opendir("/proc/self/fd")))
    return 0; /* not even one fd to count them with */
  while ((e = readdir(d)))
    if (e->d_name[0] != '.')
      n++;
  closedir(d);
  n = n ? n - 1 : 0; /* the directory's own */
  return n < rl.rlim_cur ? rl.rlim_cur - n : 0;
}

/* ---- frames --------------------------------------------------------------------------------- */

typedef struct {
  uv_write_t req;
  uint8_t *buf;
} wreq;

static void on_written(uv_write_t *req, int status) {
  wreq *w = (wreq *)req;
  (void)status;
  free(w->buf);
  free(w);
}

int gpd_pr_send_frame(plink *l, const Gpupool__Wire__PeerFrame *f) {
  size_t len = gpupool__wire__peer_frame__get_packed_size(f);
  wreq *w;
  uv_buf_t b;
  if (l->closing)
    return GPUPOOL_ECLOSED;
  if (uv_stream_get_write_queue_size((uv_stream_t *)&l->tcp) > MAX_WRITE_QUEUE) {
    gpd_pr_link_close(l, "it does not read what this daemon sends (over 64 MiB queued)");
    return GPUPOOL_ECLOSED;
  }
  if (!(w = calloc(1, sizeof *w)) || !(w->buf = malloc(len + 4))) {
    free(w);
    gpd_pr_link_close(l, "out of memory in the daemon");
    return GPUPOOL_ENOMEM;
  }
  w->buf[0] = (uint8_t)len;
  w->buf[1] = (uint8_t)(len >> 8);
  w->buf[2] = (uint8_t)(len >> 16);
  w->buf[3] = (uint8_t)(len >> 24);
  gpupool__wire__peer_frame__pack(f, w->buf + 4);
  b = uv_buf_init((char *)w->buf, (unsigned)(len + 4));
  if (uv_write(&w->req, (uv_stream_t *)&l->tcp, &b, 1, on_written) != 0) {
    free(w->buf);
    free(w);
    gpd_pr_link_close(l, "writing to it failed");
    return GPUPOOL_ECLOSED;
  }
  return 0;
}

static void send_error(plink *l, int code, const char *msg) {
  Gpupool__Wire__PeerFrame f = GPUPOOL__WIRE__PEER_FRAME__INIT;
  Gpupool__Wire__Error e = GPUPOOL__WIRE__ERROR__INIT;
  e.code = code;
  e.message = (char *)msg;
  f.body_case = GPUPOOL__WIRE__PEER_FRAME__BODY_ERROR;
  f.error = &e;
  gpd_pr_send_frame(l, &f);
}

void gpd_pr_send_get_error(plink *l, uint64_t id, int code, const char *msg) {
  Gpupool__Wire__PeerFrame f = GPUPOOL__WIRE__PEER_FRAME__INIT;
  Gpupool__Wire__PeerGetReply r = GPUPOOL__WIRE__PEER_GET_REPLY__INIT;
  Gpupool__Wire__Error e = GPUPOOL__WIRE__ERROR__INIT;
  e.code = code;
  e.message = (char *)msg;
  r.id = id;
  r.error = &e;
  f.body_case = GPUPOOL__WIRE__PEER_FRAME__BODY_GET_REPLY;
  f.get_reply = &r;
  gpd_pr_send_frame(l, &f);
}

void gpd_pr_send_done(plink *l, uint64_t id) {
  Gpupool__Wire__PeerFrame f = GPUPOOL__WIRE__PEER_FRAME__INIT;
  Gpupool__Wire__PeerDone d = GPUPOOL__WIRE__PEER_DONE__INIT;
  d.id = id;
  f.body_case = GPUPOOL__WIRE__PEER_FRAME__BODY_DONE;
  f.done = &d;
  gpd_pr_send_frame(l, &f);
}

/* ---- connections ---------------------------------------------------------------------------- */

static void link_freed(uv_handle_t *h) {
  plink *l = h->data;
  gpupool__hmap_free(&l->asked);
  free(l->waddr);
  free(l->hello_listen);
  free(l->rbuf);
  free(l);
}

void gpd_pr_link_close(plink *l, const char *why) {
  gpd_peers *P = l->P;
  peer *p = l->peer;
  if (l->closing)
    return;
  l->closing = 1;
  if (l->counted) {
    l->counted = 0;
    P->unauth--;
  }
  if (l->outgoing) {
    char msg[GPUPOOL__ERRMSG_MAX];
    snprintf(msg, sizeof msg, "%s", why);
    if (p) {
      snprintf(p->last_error, sizeof p->last_error, "%s", why);
      p->out = NULL;
      /* Was it up, this daemon learns whether the peer restarted when it is back. */
      if (l->state == L_UP) {
        p->retry_ns = now_ns();
        p->retry_gap = RECONNECT_NS;
      } else if (l->background) {
        p->retry_ns = now_ns() + p->retry_gap;
        p->retry_gap = p->retry_gap * 2 < RECONNECT_MAX_NS ? p->retry_gap * 2 : RECONNECT_MAX_NS;
      }
    }
    if (l->background && l->state != L_UP)
      GPUPOOL__DEBUG("peers: connecting again to %s (%s) failed: %s", p ? p->conf->name : "?", l->addr, why);
    else
      GPUPOOL__WARN("peers: connection to %s (%s) closed: %s", p ? p->conf->name : "?", l->addr, why);
    /* Fetches in flight on it fail, and their local copies go: this side only receives, so
     * nothing of UCX's still refers to them (late data finds no fetch under its id). */
    for (sub *sb = P->subs, *next; sb; sb = next) {
      char m2[GPUPOOL__ERRMSG_MAX + 256];
      next = sb->next;
      if (sb->peer != p || sb->state == S_IDLE)
        continue;
      if (sb->state == S_TRANSFER)
        snprintf(m2, sizeof m2, "fetch of %s:%s v%" PRIu64 " failed: peer %s closed the connection mid-transfer (%s); "
                 "retry", p->conf->name, sb->rname, sb->rep->get_reply->version, p->conf->name, why);
      else if (sb->state == S_QUEUED)
        snprintf(m2, sizeof m2, "%s", msg);
      else
        snprintf(m2, sizeof m2, "fetch of %s:%s failed: peer %s closed the connection (%s); retry", p->conf->name,
                 sb->rname, p->conf->name, why);
      sb->link = NULL;
      P->ops->sub_failed(sb, GPUPOOL_EPEER, m2);
    }
  } else {
    if (p)
      GPUPOOL__PEER_INFO(&P->log_rl, 0, "peers: connection from %s (%s) closed: %s", p->conf->name, l->addr, why);
    else
      GPUPOOL__PEER_INFO(&P->log_rl, 0, "peers: connection from %s closed: %s", l->addr, why);
    while (l->serves)
      P->ops->serve_free_reading(l->serves, 1);
    if (l->ep) {
      gpd_ucx_ep_close(l->ep);
      l->ep = NULL;
    }
  }
  GPUPOOL__LIST_UNLINK(P->links, l, prev, next);
  uv_read_stop((uv_stream_t *)&l->tcp);
  l->tcp.data = l;
  if (l->flushing) {
    l->freed_later = 1; /* the wireup's callback (the endpoint was closed: it comes) frees it */
    return;
  }
  uv_close((uv_handle_t *)&l->tcp, link_freed);
}

static void on_shutdown(uv_shutdown_t *req, int status) {
  plink *l = req->data;
  (void)status;
  gpd_pr_link_close(l, l->why);
}

/* Close once what was sent is out (the Error that says why). */
static void link_close_after_send(plink *l, const char *why) {
  snprintf(l->why, sizeof l->why, "%s", why);
  l->shutdown.data = l;
  uv_read_stop((uv_stream_t *)&l->tcp);
  if (uv_shutdown(&l->shutdown, (uv_stream_t *)&l->tcp, on_shutdown) != 0)
    gpd_pr_link_close(l, l->why);
}

static void auth_failed(plink *l, const char *who) {
  char msg[256];
  snprintf(msg, sizeof msg, "peer %s: peer authentication failed: wrong secret (check secret_file on both daemons), "
           "or the handshake was altered on the way", who);
  if (l->outgoing)
    GPUPOOL__WARN("peers: %s (%s)", msg, l->addr);
  else
    GPUPOOL__PEER_WARN(&l->P->log_rl, 0, "peers: %s (%s)", msg, l->addr);
  if (l->peer)
    snprintf(l->peer->last_error, sizeof l->peer->last_error, "%s", msg);
}

static void on_hello(plink *l, const Gpupool__Wire__PeerHello *m) {
  gpd_peers *P = l->P;
  struct sockaddr_storage src, adv;
  int len = sizeof src, found = -1, by_ip = 0;
  Gpupool__Wire__PeerFrame f = GPUPOOL__WIRE__PEER_FRAME__INIT;
  Gpupool__Wire__PeerChallenge ch = GPUPOOL__WIRE__PEER_CHALLENGE__INIT;
  uint8_t macv[32];
  char msg[256];

  if (m->protocol != GPUPOOL__WIRE__VERSION__PROTOCOL_VERSION || m->nonce.len != NONCE_LEN) {
    if (m->protocol != GPUPOOL__WIRE__VERSION__PROTOCOL_VERSION)
      snprintf(msg, sizeof msg, "protocol %u, this daemon speaks %d: run the same gpupool version on both",
               m->protocol, GPUPOOL__WIRE__VERSION__PROTOCOL_VERSION);
    else
      snprintf(msg, sizeof msg, "its Hello has a nonce of %zu bytes, not %d: not a gpupoold of this version",
               m->nonce.len, NONCE_LEN);
    send_error(l, GPUPOOL_EVERSION, msg);
    GPUPOOL__PEER_WARN(&P->log_rl, 0, "peers: %s refused: %s", l->addr, msg);
    link_close_after_send(l, msg);
    return;
  }
  if ((m->peer_revision ? m->peer_revision : 1) != P->revision) {
    snprintf(msg, sizeof msg, "peer revision %u, this daemon speaks %u (the daemons' frames differ): run the same "
             "gpupool version on both", m->peer_revision ? m->peer_revision : 1, P->revision);
    send_error(l, GPUPOOL_EVERSION, msg);
    GPUPOOL__PEER_WARN(&P->log_rl, 0, "peers: %s refused: %s", l->addr, msg);
    link_close_after_send(l, msg);
    return;
  }
  memcpy(l->nonce_theirs, m->nonce.data, NONCE_LEN);
  if (!m->worker_address.len || m->worker_address.len > 4096 || !(l->waddr = malloc(m->worker_address.len))) {
    gpd_pr_link_close(l, "its Hello has no usable UCX worker address");
    return;
  }
  memcpy(l->waddr, m->worker_address.data, m->worker_address.len);
  l->waddr_len = m->worker_address.len;
  if (!m->instance || (m->listen && strlen(m->listen) > 255) || !(l->hello_listen = strdup(m->listen ? m->listen : ""))) {
    gpd_pr_link_close(l, "its Hello has no instance or an overlong listen address");
    return;
  }
  l->instance_f = m->instance;
  l->instance_s = P->instance;
  memset(&src, 0, sizeof src);
  uv_tcp_getpeername(&l->tcp, (struct sockaddr *)&src, &len);
  if (m->listen && *m->listen && gpd_parse_hostport(m->listen, "listen", &adv) == 0)
    for (int i = 0; i < P->npeers; i++)
      if (same_addr(&P->peers[i].conf->addr, &adv, 1))
        found = i;
  if (found < 0)
    for (int i = 0; i < P->npeers; i++)
      if (same_addr(&P->peers[i].conf->addr, &src, 0)) {
        by_ip++;
        found = i;
      }
  if (found < 0 || by_ip > 1) {
    if (by_ip > 1)
      snprintf(msg, sizeof msg, "%d [peer] sections match %s's address and its Hello names no peer_listen to tell "
               "them apart; set peer_listen on that daemon", by_ip, l->addr);
    else
      snprintf(msg, sizeof msg, "this daemon has no [peer] section for %s (listening at '%s'); add one with its "
               "address and secret", l->addr, m->listen ? m->listen : "");
    GPUPOOL__PEER_WARN(&P->log_rl, 0, "peers: connection from %s refused: %s", l->addr, msg);
    send_error(l, GPUPOOL_EPERM, msg);
    link_close_after_send(l, msg);
    return;
  }
  l->peer = &P->peers[found];
  if (getrandom(l->nonce_mine, NONCE_LEN, 0) != NONCE_LEN) {
    gpd_pr_link_close(l, "no random bytes for a nonce");
    return;
  }
  mac_theirs(l, "gpupool peer server", macv);
  ch.instance = P->instance;
  ch.nonce.data = l->nonce_mine;
  ch.nonce.len = NONCE_LEN;
  ch.mac.data = macv;
  ch.mac.len = sizeof macv;
  ch.peer_revision = P->revision;
  f.body_case = GPUPOOL__WIRE__PEER_FRAME__BODY_CHALLENGE;
  f.challenge = &ch;
  l->state = L_AWAIT_AUTH;
  gpd_pr_send_frame(l, &f);
}

static void on_challenge(plink *l, const Gpupool__Wire__PeerChallenge *m) {
  Gpupool__Wire__PeerFrame f = GPUPOOL__WIRE__PEER_FRAME__INIT;
  Gpupool__Wire__PeerAuth a = GPUPOOL__WIRE__PEER_AUTH__INIT;
  uint8_t want[32], macv[32];
  int ok;
  if (m->nonce.len != NONCE_LEN || m->mac.len != 32) {
    gpd_pr_link_close(l, "malformed challenge");
    return;
  }
  if ((m->peer_revision ? m->peer_revision : 1) != l->P->revision) {
    char why[256];
    snprintf(why, sizeof why, "peer %s speaks peer revision %u, this daemon %u (the daemons' frames differ): run the "
             "same gpupool version on both", l->peer->conf->name, m->peer_revision ? m->peer_revision : 1,
             l->P->revision);
    GPUPOOL__WARN("peers: %s", why);
    gpd_pr_link_close(l, why);
    return;
  }
  memcpy(l->nonce_theirs, m->nonce.data, NONCE_LEN);
  l->instance_s = m->instance;
  mac_mine(l, "gpupool peer server", want);
  ok = m->instance && gpupool__ct_equal(want, m->mac.data, 32);
  /* Answer even when the peer's proof is wrong, so that it logs the failure too. */
  mac_mine(l, "gpupool peer client", macv);
  a.mac.data = macv;
  a.mac.len = sizeof macv;
  f.body_case = GPUPOOL__WIRE__PEER_FRAME__BODY_AUTH;
  f.auth = &a;
  gpd_pr_send_frame(l, &f);
  if (!ok) {
    char why[256];
    auth_failed(l, l->peer->conf->name);
    snprintf(why, sizeof why, "%s", l->peer->last_error);
    link_close_after_send(l, why);
    return;
  }
  l->state = L_AWAIT_WELCOME;
}

/* The serving side's UCX endpoint to the fetching daemon is connected both ways: say Welcome.
 * (A peer that went away while UCX was still setting up trips an assertion in UCX 1.13's error
 * path; no data moves before that is over.) */
static void on_ep_ready(void *arg, int status) {
  plink *l = arg;
  Gpupool__Wire__PeerFrame f = GPUPOOL__WIRE__PEER_FRAME__INIT;
  Gpupool__Wire__PeerWelcome w = GPUPOOL__WIRE__PEER_WELCOME__INIT;
  l->flushing = 0;
  if (l->closing) {
    if (l->freed_later)
      uv_close((uv_handle_t *)&l->tcp, link_freed);
    return;
  }
  if (status != 0) {
    char why[GPUPOOL__ERRMSG_MAX];
    snprintf(why, sizeof why, "its UCX worker cannot be reached: %s", gpupool__errmsg());
    gpd_pr_link_close(l, why);
    return;
  }
  gpd_ucx_ep_describe(l->ep, l->peer->serve_transport, sizeof l->peer->serve_transport);
  w.you_are = (char *)l->peer->conf->name;
  w.transport = l->peer->serve_transport;
  f.body_case = GPUPOOL__WIRE__PEER_FRAME__BODY_WELCOME;
  f.welcome = &w;
  l->state = L_UP;
  GPUPOOL__INFO("peers: %s authenticated from %s", l->peer->conf->name, l->addr);
  gpd_pr_send_frame(l, &f);
}

static void on_auth(plink *l, const Gpupool__Wire__PeerAuth *m) {
  gpd_peers *P = l->P;
  uint8_t want[32];
  uint64_t fds;
  int rc;
  mac_theirs(l, "gpupool peer client", want);
  if (m->mac.len != 32 || !gpupool__ct_equal(want, m->mac.data, 32)) {
    auth_failed(l, l->peer->conf->name);
    send_error(l, GPUPOOL_EPERM, "peer authentication failed: wrong secret (check secret_file on both daemons), or "
               "the handshake was altered on the way");
    link_close_after_send(l, "peer authentication failed: wrong secret");
    return;
  }
  if (l->counted) {
    l->counted = 0;
    P->unauth--;
  }
  /* UCX aborts the whole process when it cannot open the sockets an endpoint needs: refuse
   * the peer while the fds kept in reserve are short instead. */
  if ((fds = gpd_pr_fds_free()) < P->cfg->peer_fd_reserve / 2) {
    char why[256];
    snprintf(why, sizeof why, "gpupoold has %" PRIu64 " file descriptors left (peer_fd_reserve %u): no UCX endpoint "
             "for this peer now; try later. Operators: raise LimitNOFILE= (ulimit -n)", fds, P->cfg->peer_fd_reserve);
    GPUPOOL__PEER_WARN(&P->log_rl, 0, "peers: %s (%s) refused: %s", l->peer->conf->name, l->addr, why);
    send_error(l, GPUPOOL_ELIMIT, why);
    link_close_after_send(l, why);
    return;
  }
  if ((rc = gpd_ucx_ep_new(P->ucx, l->waddr, l->waddr_len, &l->ep)) != 0 ||
      (rc = gpd_ucx_ep_connect(l->ep, on_ep_ready, l)) != 0) {
    char why[GPUPOOL__ERRMSG_MAX];
    snprintf(why, sizeof why, "its UCX worker cannot be reached: %s", gpupool__errmsg());
    gpd_pr_link_close(l, why);
    return;
  }
  l->flushing = 1;
  l->state = L_AWAIT_EP;
}

static void on_welcome(plink *l, const Gpupool__Wire__PeerWelcome *m) {
  gpd_peers *P = l->P;
  peer *p = l->peer;
  l->state = L_UP;
  p->last_error[0] = '\0';
  /* What the peer's endpoint sends this daemon's fetches with (printable, bounded). */
  snprintf(p->fetch_transport, sizeof p->fetch_transport, "%s", m->transport ? m->transport : "");
  for (char *c = p->fetch_transport; *c; c++)
    if ((unsigned char)*c < 0x20 || (unsigned char)*c > 0x7e)
      *c = '?';
  GPUPOOL__INFO("peers: connected to %s at %s%s%s", p->conf->name, l->addr, p->fetch_transport[0] ? "; it sends over "
                : "", p->fetch_transport);
  P->ops->peer_instance(p, l->instance_s);
  /* Asking may close the connection (and fail the others): look for the next one afresh. */
  for (;;) {
    sub *sb = P->subs;
    while (sb && !(sb->peer == p && sb->state == S_QUEUED))
      sb = sb->next;
    if (!sb || p->out != l || l->closing)
      break;
    sb->state = S_IDLE;
    P->ops->sub_ask(sb);
  }
}

static void on_frame(plink *l, const uint8_t *buf, size_t len) {
  Gpupool__Wire__PeerFrame *f = gpupool__wire__peer_frame__unpack(NULL, len, buf);
  int keep = 0;
  if (!f) {
    gpd_pr_link_close(l, "it sent a frame that does not decode");
    return;
  }
  switch (l->state) {
  case L_AWAIT_HELLO:
    if (f->body_case == GPUPOOL__WIRE__PEER_FRAME__BODY_HELLO)
      on_hello(l, f->hello);
    else
      gpd_pr_link_close(l, "it did not start with Hello");
    break;
  case L_AWAIT_AUTH:
    if (f->body_case == GPUPOOL__WIRE__PEER_FRAME__BODY_AUTH)
      on_auth(l, f->auth);
    else
      gpd_pr_link_close(l, "it did not authenticate");
    break;
  case L_AWAIT_CHALLENGE:
  case L_AWAIT_WELCOME:
    if (f->body_case == GPUPOOL__WIRE__PEER_FRAME__BODY_CHALLENGE && l->state == L_AWAIT_CHALLENGE) {
      on_challenge(l, f->challenge);
    } else if (f->body_case == GPUPOOL__WIRE__PEER_FRAME__BODY_WELCOME && l->state == L_AWAIT_WELCOME) {
      on_welcome(l, f->welcome);
    } else if (f->body_case == GPUPOOL__WIRE__PEER_FRAME__BODY_ERROR) {
      char why[GPUPOOL__ERRMSG_MAX];
      snprintf(why, sizeof why, "peer %s refused this daemon: %s", l->peer->conf->name,
               f->error->message ? f->error->message : "");
      GPUPOOL__WARN("peers: %s", why);
      gpd_pr_link_close(l, why);
    } else {
      gpd_pr_link_close(l, "it broke the authentication exchange");
    }
    break;
  case L_UP:
    switch (f->body_case) {
    case GPUPOOL__WIRE__PEER_FRAME__BODY_GET:
      if (!l->outgoing)
        l->P->ops->on_peer_get(l, f->get);
      break;
    case GPUPOOL__WIRE__PEER_FRAME__BODY_DONE:
      if (!l->outgoing)
        l->P->ops->on_peer_done(l, f->done->id);
      break;
    case GPUPOOL__WIRE__PEER_FRAME__BODY_READY:
      if (!l->outgoing)
        l->P->ops->on_peer_ready(l, f->ready->id, f->ready->window);
      break;
    case GPUPOOL__WIRE__PEER_FRAME__BODY_CREDIT:
      if (!l->outgoing)
        l->P->ops->on_peer_credit(l, f->credit->id, f->credit->bytes);
      break;
    case GPUPOOL__WIRE__PEER_FRAME__BODY_FAILED:
      if (l->outgoing)
        l->P->ops->on_peer_failed(l, f->failed);
      break;
    case GPUPOOL__WIRE__PEER_FRAME__BODY_GET_REPLY:
      if (l->outgoing) {
        l->P->ops->on_get_reply(l, f);
        keep = 1;
      }
      break;
    default:
      break;
    }
    break;
  default:
    gpd_pr_link_close(l, "it spoke before the connection was set up");
  }
  if (!keep)
    gpupool__wire__peer_frame__free_unpacked(f, NULL);
}

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf) {
  plink *l = h->data;
  (void)suggested;
  if (l->rcap - l->rlen < READ_CHUNK) {
    size_t ncap = l->rlen + READ_CHUNK;
    uint8_t *n = realloc(l->rbuf, ncap);
    if (!n) {
      *buf = uv_buf_init(NULL, 0);
      return;
    }
    l->rbuf = n;
    l->rcap = ncap;
  }
  *buf = uv_buf_init((char *)l->rbuf + l->rlen, (unsigned)(l->rcap - l->rlen));
}

static void on_read(uv_stream_t *st, ssize_t nread, const uv_buf_t *buf) {
  plink *l = st->data;
  size_t off = 0;
  (void)buf;
  if (nread < 0) {
    gpd_pr_link_close(l, nread == UV_EOF ? "the peer closed it" : uv_strerror((int)nread));
    return;
  }
  l->rlen += (size_t)nread;
  while (!l->closing && l->rlen - off >= 4) {
    const uint8_t *p = l->rbuf + off;
    uint32_t len = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
    uint32_t cap = l->state == L_UP ? l->P->cfg->peer_max_frame : 4096;
    if (len > cap) {
      char why[128];
      snprintf(why, sizeof why, "it sent a frame of %u bytes, over the %u allowed (peer_max_frame)", len, cap);
      gpd_pr_link_close(l, why);
      return;
    }
    if (l->rlen - off < 4 + (size_t)len)
      break;
    on_frame(l, p + 4, len);
    off += 4 + (size_t)len;
  }
  if (l->closing)
    return;
  if (off) {
    memmove(l->rbuf, l->rbuf + off, l->rlen - off);
    l->rlen -= off;
  }
}

static plink *link_new(gpd_peers *P) {
  plink *l = calloc(1, sizeof *l);
  if (!l)
    return NULL;
  l->P = P;
  l->since_ns = now_ns();
  gpupool__hmap_init(&l->asked);
  uv_tcp_init(P->loop, &l->tcp);
  l->tcp.data = l;
  uv_tcp_nodelay(&l->tcp, 1);
  l->next = P->links;
  if (P->links)
    P->links->prev = l;
  P->links = l;
  return l;
}

static void on_connected(uv_connect_t *req, int status) {
  plink *l = req->data;
  gpd_peers *P = l->P;
  Gpupool__Wire__PeerFrame f = GPUPOOL__WIRE__PEER_FRAME__INIT;
  Gpupool__Wire__PeerHello h = GPUPOOL__WIRE__PEER_HELLO__INIT;
  if (l->closing)
    return;
  if (status < 0) {
    char why[256];
    snprintf(why, sizeof why, "peer %s unreachable at %s: %s (is gpupoold running there with peer_listen?)",
             l->peer->conf->name, l->peer->conf->address, uv_strerror(status));
    gpd_pr_link_close(l, why);
    return;
  }
  if (getrandom(l->nonce_mine, NONCE_LEN, 0) != NONCE_LEN) {
    gpd_pr_link_close(l, "no random bytes for a nonce");
    return;
  }
  uv_read_start((uv_stream_t *)&l->tcp, on_alloc, on_read);
  h.protocol = GPUPOOL__WIRE__VERSION__PROTOCOL_VERSION;
  h.peer_revision = P->revision;
  h.nonce.data = l->nonce_mine;
  h.nonce.len = NONCE_LEN;
  h.instance = P->instance;
  l->instance_f = P->instance;
  h.listen = P->listen_addr;
  {
    const void *addr;
    size_t alen;
    gpd_ucx_address(P->ucx, &addr, &alen);
    h.worker_address.data = (uint8_t *)addr;
    h.worker_address.len = alen;
  }
  f.body_case = GPUPOOL__WIRE__PEER_FRAME__BODY_HELLO;
  f.hello = &h;
  l->state = L_AWAIT_CHALLENGE;
  gpd_pr_send_frame(l, &f);
}

void gpd_pr_link_connect(gpd_peers *P, peer *p) {
  plink *l = link_new(P);
  uint64_t fds;
  int rc;
  if (!l) {
    GPUPOOL__WARN("peers: out of memory connecting to %s", p->conf->name);
    return;
  }
  l->outgoing = 1;
  l->peer = p;
  l->state = L_CONNECTING;
  snprintf(l->addr, sizeof l->addr, "%s", p->conf->address);
  p->out = l;
  l->connect.data = l;
  /* A connect that fails at once is closed by the next tick: its caller may be walking lists
   * that closing it would change. The peer's UCX endpoint will connect to this daemon's
   * worker, whose sockets UCX must be able to open (it aborts the process when it cannot). */
  if ((fds = gpd_pr_fds_free()) < P->cfg->peer_fd_reserve / 2)
    snprintf(l->why, sizeof l->why, "gpupoold has %" PRIu64 " file descriptors left (peer_fd_reserve %u): no "
             "connection to peer %s now; try later. Operators: raise LimitNOFILE= (ulimit -n)", fds,
             P->cfg->peer_fd_reserve, p->conf->name);
  else if ((rc = uv_tcp_connect(&l->connect, &l->tcp, (const struct sockaddr *)&p->conf->addr, on_connected)) != 0)
    snprintf(l->why, sizeof l->why, "peer %s unreachable at %s: %s (is gpupoold running there with peer_listen?)",
             p->conf->name, p->conf->address, uv_strerror(rc));
}

/* Unauthenticated connections from where l comes from, and the oldest of them. */
static uint32_t from_same(gpd_peers *P, const plink *l, plink **oldest) {
  uint32_t n = 0;
  *oldest = NULL;
  for (plink *o = P->links; o; o = o->next)
    if (o != l && o->counted && same_addr(&o->src, &l->src, 0)) {
      n++;
      if (!*oldest || o->since_ns <= (*oldest)->since_ns)
        *oldest = o;
    }
  return n;
}

/* An incoming connection within the caps on unauthenticated ones (peer_max_unauthenticated,
 * peer_max_unauthenticated_per_addr) and with fds to spare (peer_fd_reserve): 1 to keep it,
 * 0 when it must go (why set). At the total cap, the oldest connection of the address that
 * holds the most goes instead when that address holds more than l's: a flood from a few hosts
 * takes its own connections' places, not a peer's. */
static int admit(gpd_peers *P, plink *l, char *why, size_t len) {
  const gpd_config *cfg = P->cfg;
  plink *oldest, *victim = NULL;
  uint32_t mine = from_same(P, l, &oldest), most = 0;
  uint64_t fds;
  /* The cheap check first: a flood from one address ends here. */
  if (mine >= cfg->peer_max_unauthenticated_per_addr) {
    snprintf(why, len, "%u connections from that address are not authenticated yet "
             "(peer_max_unauthenticated_per_addr)", mine);
    return 0;
  }
  if ((fds = gpd_pr_fds_free()) < cfg->peer_fd_reserve) {
    snprintf(why, len, "only %" PRIu64 " file descriptors left, fewer than peer_fd_reserve %u", fds,
             cfg->peer_fd_reserve);
    return 0;
  }
  if (P->unauth < cfg->peer_max_unauthenticated)
    return 1;
  for (plink *o = P->links; o; o = o->next) {
    plink *old;
    uint32_t n;
    if (!o->counted)
      continue;
    if ((n = from_same(P, o, &old) + 1) > most) {
      most = n;
      victim = old ? (old->since_ns <= o->since_ns ? old : o) : o;
    }
  }
  if (!victim || most <= mine + 1) {
    snprintf(why, len, "%u connections are not authenticated yet (peer_max_unauthenticated)", P->unauth);
    return 0;
  }
  gpd_pr_link_close(victim, "made way for a connection from an address with fewer unauthenticated connections "
                    "(peer_max_unauthenticated)");
  return 1;
}

void gpd_pr_on_accept(uv_stream_t *server, int status) {
  gpd_peers *P = server->data;
  int len = sizeof(struct sockaddr_storage);
  char why[256];
  plink *l;
  if (status < 0) {
    /* libuv accepted and closed what waited (its reserved fd): nothing is held. */
    GPUPOOL__PEER_WARN(&P->log_rl, 0, "peers: a connection to peer_listen was refused: %s (fd limit: raise "
                       "LimitNOFILE=, ulimit -n)", uv_strerror(status));
    return;
  }
  if (!(l = link_new(P)))
    return;
  if (uv_accept(server, (uv_stream_t *)&l->tcp) != 0) {
    gpd_pr_link_close(l, "accept failed");
    return;
  }
  uv_tcp_getpeername(&l->tcp, (struct sockaddr *)&l->src, &len);
  fmt_addr(&l->src, l->addr, sizeof l->addr);
  l->state = L_AWAIT_HELLO;
  if (!admit(P, l, why, sizeof why)) {
    gpd_pr_link_close(l, why);
    return;
  }
  l->counted = 1;
  P->unauth++;
  uv_read_start((uv_stream_t *)&l->tcp, on_alloc, on_read);
}
