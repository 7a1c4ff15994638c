/*
 * gpupoolctl: the operator's view of a running gpupoold.
 *
 * It speaks the daemon's own protocol through the wire library (Hello, then one Stats or
 * admin request), so it needs no other interface in the daemon and sees exactly what the
 * daemon knows. Human output is a set of aligned tables with binary sizes; --json prints one
 * JSON document per command for scripts. Errors say what went wrong and what to do: which
 * socket was tried and how to start the daemon, or which users may make admin requests.
 *
 * Exit status: 0 success, 1 the daemon refused or failed the request (or drop-client found
 * no such client), 2 usage error, 3 the daemon could not be reached or spoke nonsense, 4 the
 * daemon is up but not serving because its configuration is invalid.
 *
 * Every command is a row of one table (name, the request it makes, the renderer of its reply;
 * whether it is for operators comes from the request's own row in common/requests.h), and all
 * go through one path: build the request, call, render (gpupoolctl_render.c).
 */
#include <errno.h>
#include <getopt.h>
#include <grp.h>
#include <pwd.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include "gpupoolctl.h"
#include "gpupool/version.h"
#include "requests.h"
#include "sock.h"
#include "words.h"

int json_errors;

void die_msg(const char *fmt, ...) {
  char msg[2048];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  fprintf(stderr, "gpupoolctl: %s\n", msg);
  if (json_errors) {
    fputs("{\"error\":", stdout);
    jstr(msg);
    puts("}");
    json_errors = 0; /* one document */
  }
}

static int connect_daemon(ctl *c) {
  struct ucred cr;
  socklen_t crl = sizeof(cr);
  int fd, e, tries;

  fd = gpupool__sock_connect(c->path, c->hello_timeout_ms, 0, &tries);
  if (fd < 0) {
    char what[GPUPOOL__SOCK_DESCRIBE_MAX];
    e = -fd;
    if (tries == 0)
      die_msg("cannot create a socket: %s", strerror(e));
    else if (e == ECONNREFUSED && gpupool__sock_describe(c->path, what, sizeof what) == 1)
      die_msg("cannot connect to gpupoold: %s.", what);
    else if (e == ENOENT || e == ECONNREFUSED)
      die_msg("gpupoold is not running: %s %s.\n"
              "  Start it with 'systemctl start gpupoold.socket' (or run 'gpupoold --socket %s'),\n"
              "  or point gpupoolctl at the daemon's socket with --socket PATH or GPUPOOL_SOCKET.",
              e == ENOENT ? "there is no socket at" : "nothing accepts connections on",
              c->path, c->path);
    else if (e == EACCES || e == EPERM) {
      char group[64];
      struct stat st;
      gpupool__sock_describe(c->path, what, sizeof what);
      if (stat(c->path, &st) == 0 && st.st_gid == 0)
        /* Joining root's group would give far more than this socket: never advise it. */
        die_msg("permission denied connecting to %s (%s).\n"
                "  Connecting needs write access to the socket, whose group is root's: run gpupoolctl "
                "with sudo, or have the operator give the socket a group of its own (SocketGroup= in "
                "gpupoold.socket) and join that group.",
                c->path, what);
      else {
        if (gpupool__sock_group(c->path, group, sizeof group) != 0)
          snprintf(group, sizeof group, "<the socket's group>");
        die_msg("permission denied connecting to %s (%s).\n"
                "  Connecting needs write access to the socket: join its group ('sudo usermod -aG %s "
                "$USER', then log in again), or run gpupoolctl with sudo.",
                c->path, what, group);
      }
    } else if (e == EAGAIN || e == EINPROGRESS || e == ETIMEDOUT)
      die_msg("the daemon did not answer in %s: gpupoold at %s accepts no connections (stopped "
              "or stuck? see 'systemctl status gpupoold' and 'journalctl -u gpupoold')",
              fmt_secs(c->hello_timeout_ms, what, sizeof what), c->path);
    else
      die_msg("cannot connect to gpupoold at %s: %s", c->path, strerror(e));
    return -1;
  }
  /* Peer credentials of the socket: the daemon's own, unless a service manager created the
   * socket (socket activation: then they are the manager's). Hello says who the daemon is. */
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &crl) == 0) {
    c->daemon_pid = cr.pid;
    c->daemon_uid = cr.uid;
  } else {
    c->daemon_pid = -1;
    c->daemon_uid = (uid_t)-1;
  }
  c->fd = fd;
  return 0;
}

/* After Hello: every later request waits up to --timeout (0 = forever). */
static void set_request_timeout(ctl *c) {
  struct timeval tv = {.tv_sec = c->timeout_s, .tv_usec = 0};
  (void)setsockopt(c->fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  (void)setsockopt(c->fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

/* What the messages call a request: its proto message's name ("Hello", "AdminClients"). */
static const char *body_name(int body_case) {
  int i = gpupool__request_index(body_case);
  return i < 0 ? "request" : gpupool__request_kinds[i].message;
}

static int is_admin(int body_case) {
  int i = gpupool__request_index(body_case);
  return i >= 0 && (gpupool__request_kinds[i].flags & GPUPOOL__REQ_ADMIN);
}

/* The daemon answered req with an error: say it, in the words its command needs, and return
 * the exit status (EXIT_NOT_FOUND: the caller words it). */
static int refused(ctl *c, const gpupool__req *req, const gpupool__rep *rep) {
  int bc = (int)req->body_case, code = rep->error->code;
  const char *msg = rep->error->message && rep->error->message[0] ? rep->error->message : gpupool_strerror(code);
  if (code == GPUPOOL_EPERM && is_admin(bc)) {
    struct passwd *pw = c->daemon_uid != (uid_t)-1 ? getpwuid(c->daemon_uid) : NULL;
    die_msg("%s: permission denied: %s\n"
            "  Admin requests need root or the daemon's own user (uid %d%s%s); try "
            "'sudo gpupoolctl %s'.",
            c->cmd, msg, (int)c->daemon_uid, pw ? ", " : "", pw ? pw->pw_name : "", c->cmd);
  } else if (code == GPUPOOL_ENOENT && bc == GPUPOOL__WIRE__REQUEST__BODY_ADMIN_UNPUBLISH) {
    return EXIT_NOT_FOUND; /* run() says it, with the keys meant */
  } else if (code == GPUPOOL_ENOENT && bc == GPUPOOL__WIRE__REQUEST__BODY_ADMIN_DROP_CLIENT) {
    die_msg("no client with pid %d is connected (see 'gpupoolctl clients')", (int)req->admin_drop_client->pid);
  } else {
    die_msg("%s: %s (%s)", c->cmd, msg, gpupool_err_name(code));
  }
  return bc != GPUPOOL__WIRE__REQUEST__BODY_HELLO ? EXIT_REFUSED
         : code == GPUPOOL_ECONFIG              ? EXIT_CONFIG
                                                : EXIT_UNREACHABLE;
}

/* Send req and read its reply. Returns 0 with *out (the caller frees it), EXIT_REFUSED when
 * the daemon answered with an error, EXIT_UNREACHABLE on transport or protocol failure; the
 * message is printed either way. The reply body case equals the request's (same numbers). */
static int call(ctl *c, gpupool__req *req, gpupool__rep **out) {
  gpupool__wire_rx rx;
  gpupool__rep *rep = NULL;
  uint8_t *buf = NULL;
  size_t len = 0;
  int rc, ret = EXIT_UNREACHABLE;
  int bc = (int)req->body_case;

  *out = NULL;
  gpupool__wire_rx_init(&rx, GPUPOOL_WIRE_HARD_MAX_FRAME);
  req->seq = ++c->seq;
  rc = gpupool__sock_pack_request(req, 0, &buf, &len);
  if (rc < 0) {
    die_msg("cannot encode a %s request: %s", body_name(bc), gpupool__errmsg());
    goto out;
  }
  rc = gpupool__wire_send(c->fd, buf, len, NULL, 0);
  if (rc < 0) {
    die_msg("cannot send a %s request to %s: %s", body_name(bc), c->path, gpupool__errmsg());
    goto out;
  }
  rc = gpupool__sock_read_reply(&rx, c->fd, &rep);
  if (rc == 0) {
    char secs[32];
    die_msg("the daemon did not answer in %s: gpupoold at %s left a %s request unanswered "
            "(stopped or stuck? see 'systemctl status gpupoold' and 'journalctl -u gpupoold')",
            fmt_secs(bc == GPUPOOL__WIRE__REQUEST__BODY_HELLO ? c->hello_timeout_ms
                                                                : c->timeout_s * 1000,
                     secs, sizeof secs),
            c->path, body_name(bc));
    goto out;
  }
  if (bc == GPUPOOL__WIRE__REQUEST__BODY_HELLO && rc < 0) {
    /* Whatever answers here does not speak gpupool's framing. */
    if (rc == GPUPOOL_ECLOSED)
      die_msg("%s closed the connection without answering Hello: gpupoold failed to start (see "
              "'systemctl status gpupoold' and 'journalctl -u gpupoold'; check the configuration "
              "with 'gpupoold --check-config'), or this socket is not gpupoold (check --socket or "
              "GPUPOOL_SOCKET)", c->path);
    else {
      char seen[96];
      gpupool__sock_foreign(&rx, gpupool__errmsg(), seen, sizeof seen);
      die_msg("this socket is not gpupoold: %s answered Hello with something that is not a "
              "gpupool frame (%s); check --socket or GPUPOOL_SOCKET", c->path, seen);
    }
    goto out;
  }
  if (rc == GPUPOOL_ECLOSED) {
    die_msg("gpupoold at %s closed the connection without answering a %s request; its log "
            "says why ('journalctl -u gpupoold'): often allow_uids/allow_gids or max_clients "
            "in its configuration",
            c->path, body_name(bc));
    goto out;
  }
  if (rc < 0) {
    die_msg("reading the reply from %s: %s", c->path, gpupool__errmsg());
    goto out;
  }
  if (rep == NULL) {
    if (bc == GPUPOOL__WIRE__REQUEST__BODY_HELLO)
      die_msg("this socket is not gpupoold: %s answered Hello with a frame that does not decode; "
              "check --socket or GPUPOOL_SOCKET",
              c->path);
    else
      die_msg("gpupoold at %s sent a reply that does not decode (a different protocol "
              "version?)",
              c->path);
    goto out;
  }
  if (rep->seq != req->seq && !(rep->seq == 0 && rep->error != NULL)) {
    die_msg("gpupoold at %s answered request %llu while %llu was expected", c->path,
            (unsigned long long)rep->seq, (unsigned long long)req->seq);
    goto out;
  }
  if (rep->error != NULL) {
    ret = refused(c, req, rep);
    goto out;
  }
  if ((int)rep->body_case != bc) {
    die_msg("gpupoold at %s answered a %s request with a reply of another kind (%d)", c->path,
            body_name(bc), (int)rep->body_case);
    goto out;
  }
  *out = rep;
  rep = NULL;
  ret = 0;

out:
  if (rep != NULL)
    gpupool__wire__reply__free_unpacked(rep, NULL);
  gpupool__wire_rx_reset(&rx);
  free(buf);
  return ret;
}

static int hello(ctl *c) {
  Gpupool__Wire__Hello h = GPUPOOL__WIRE__HELLO__INIT;
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  int rc;

  h.protocol_version = GPUPOOL__WIRE__VERSION__PROTOCOL_VERSION;
  h.client_name = "gpupoolctl";
  h.pid = (int32_t)getpid();
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_HELLO;
  req.hello = &h;
  rc = call(c, &req, &c->hello);
  if (rc != 0)
    return rc;
  /* The daemon's own pid and uid (a daemon before 0.2 does not send them). */
  if (c->hello->hello->daemon_pid > 0) {
    c->daemon_pid = c->hello->hello->daemon_pid;
    c->daemon_uid = c->hello->hello->daemon_uid;
  }
  set_request_timeout(c);
  return 0;
}

/* ---- the commands -------------------------------------------------------------------------- */

/* The body of any command's request, filled by its row's request function. */
typedef union {
  Gpupool__Wire__Stats stats;
  Gpupool__Wire__AdminClients clients;
  Gpupool__Wire__AdminBuffers buffers;
  Gpupool__Wire__AdminNames names;
  Gpupool__Wire__AdminUnpublish unpublish;
  Gpupool__Wire__AdminPeers peers;
  Gpupool__Wire__AdminDropClient drop;
  Gpupool__Wire__Trim trim;
} body;

int ctl_admin_buffers(ctl *c, gpupool__rep **rep) {
  Gpupool__Wire__AdminBuffers ab = GPUPOOL__WIRE__ADMIN_BUFFERS__INIT;
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_ADMIN_BUFFERS;
  req.admin_buffers = &ab;
  return call(c, &req, rep);
}

/* Request functions: fill req's body from the command's argument, or say what is wrong with
 * it and return EXIT_USAGE. */
static int ask_stats(const char *arg, gpupool__req *req, body *b) {
  (void)arg;
  b->stats = (Gpupool__Wire__Stats)GPUPOOL__WIRE__STATS__INIT;
  req->stats = &b->stats;
  return 0;
}

static int ask_clients(const char *arg, gpupool__req *req, body *b) {
  (void)arg;
  b->clients = (Gpupool__Wire__AdminClients)GPUPOOL__WIRE__ADMIN_CLIENTS__INIT;
  req->admin_clients = &b->clients;
  return 0;
}

static int ask_buffers(const char *arg, gpupool__req *req, body *b) {
  (void)arg;
  b->buffers = (Gpupool__Wire__AdminBuffers)GPUPOOL__WIRE__ADMIN_BUFFERS__INIT;
  req->admin_buffers = &b->buffers;
  return 0;
}

static int ask_names(const char *arg, gpupool__req *req, body *b) {
  (void)arg;
  b->names = (Gpupool__Wire__AdminNames)GPUPOOL__WIRE__ADMIN_NAMES__INIT;
  req->admin_names = &b->names;
  return 0;
}

static int ask_peers(const char *arg, gpupool__req *req, body *b) {
  (void)arg;
  b->peers = (Gpupool__Wire__AdminPeers)GPUPOOL__WIRE__ADMIN_PEERS__INIT;
  req->admin_peers = &b->peers;
  return 0;
}

static int ask_trim(const char *arg, gpupool__req *req, body *b) {
  (void)arg;
  b->trim = (Gpupool__Wire__Trim)GPUPOOL__WIRE__TRIM__INIT;
  req->trim = &b->trim;
  return 0;
}

/* Remove a name of any tenant, by the key `names` shows ("uid:1000/weights"). */
static int ask_unpublish(const char *key, gpupool__req *req, body *b) {
  if (key == NULL || !*key) {
    die_msg("unpublish wants the name's key as 'gpupoolctl names' shows it, e.g. uid:1000/weights");
    return EXIT_USAGE;
  }
  b->unpublish = (Gpupool__Wire__AdminUnpublish)GPUPOOL__WIRE__ADMIN_UNPUBLISH__INIT;
  b->unpublish.key = (char *)key;
  req->admin_unpublish = &b->unpublish;
  return 0;
}

static int ask_drop(const char *arg, gpupool__req *req, body *b) {
  char *end = NULL;
  long pid;

  errno = 0;
  pid = arg ? strtol(arg, &end, 10) : 0;
  if (arg == NULL || errno != 0 || end == arg || *end != '\0' || pid <= 0 || pid > INT32_MAX) {
    die_msg("drop-client needs the pid of a connected client (see 'gpupoolctl clients'), got "
            "'%s'",
            arg ? arg : "");
    return EXIT_USAGE;
  }
  b->drop = (Gpupool__Wire__AdminDropClient)GPUPOOL__WIRE__ADMIN_DROP_CLIENT__INIT;
  b->drop.pid = (int32_t)pid;
  req->admin_drop_client = &b->drop;
  return 0;
}

/* No name is filed under key: say so, with the keys meant when there are. Keys start with
 * their tenant ("uid:1000/" or "group:NAME/"); a key given without it (what the publisher
 * called the name) is matched against the part after it, a near key by its spelling. */
static void not_filed(ctl *c, const char *key) {
  Gpupool__Wire__AdminNames an = GPUPOOL__WIRE__ADMIN_NAMES__INIT;
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  gpupool__rep *rep = NULL;
  char hint[512] = "";
  size_t at = 0, found = 0;
  int saved = json_errors;

  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_ADMIN_NAMES;
  req.admin_names = &an;
  json_errors = 0;
  if (call(c, &req, &rep) == 0) {
    const Gpupool__Wire__AdminNamesReply *r = rep->admin_names;
    for (size_t i = 0; i < r->n_names && found < 4; i++) {
      const char *k = r->names[i]->key, *slash = strchr(k, '/');
      int match = slash && !strcmp(slash + 1, key);
      if (!match && strlen(key) > 3 && gpupool__edit_distance(key, k) <= 1 + strlen(k) / 8)
        match = 1;
      if (!match)
        continue;
      if (found++ == 3) {
        at += (size_t)snprintf(hint + at, sizeof hint - at, ", ...");
        break;
      }
      if (at < sizeof hint)
        at += (size_t)snprintf(hint + at, sizeof hint - at, "%s'%s'", at ? ", " : "", k);
      if (at >= sizeof hint)
        at = sizeof hint - 1;
    }
  }
  json_errors = saved;
  if (rep)
    gpupool__wire__reply__free_unpacked(rep, NULL);
  if (found)
    die_msg("no name is filed under '%s'; did you mean %s? (keys start with their tenant, as "
            "'gpupoolctl names' shows them)", key, hint);
  else if (!strchr(key, ':'))
    die_msg("no name is filed under '%s': keys start with their tenant, as 'gpupoolctl names' "
            "shows them (uid:1000/%s, group:NAME/%s)", key, key, key);
  else
    die_msg("no name is filed under '%s' (see 'gpupoolctl names' for the keys)", key);
}

/* ---- main ---------------------------------------------------------------------------------- */

/* The commands, one row each: dispatch, --help and the did-you-mean read the rows; whether a
 * command is for operators comes from the request table's row of the request it makes
 * (common/requests.h), so --help says what the daemon enforces. */
typedef struct {
  const char *name;
  const char *arg;   /* its argument as --help writes it, or NULL */
  int body_case;     /* the request it makes (names also reads AdminBuffers, admin as well) */
  int (*request)(const char *arg, gpupool__req *req, body *b); /* fills the request's body */
  ctl_render_fn *render; /* prints the reply */
  const char *help;  /* lines of --help after the name, '\n' between them */
} command;

static const command commands[] = {
    {"status", NULL, GPUPOOL__WIRE__REQUEST__BODY_STATS, ask_stats, render_status,
     "daemon version, backend, uptime, clients and pool usage; exporters\n"
     "and a restart a reload left pending"},
    {"clients", NULL, GPUPOOL__WIRE__REQUEST__BODY_ADMIN_CLIENTS, ask_clients, render_clients,
     "connected clients: id, pid, user, name, holds, bytes, age"},
    {"buffers", NULL, GPUPOOL__WIRE__REQUEST__BODY_ADMIN_BUFFERS, ask_buffers, render_buffers,
     "live buffers sorted by id: pool, size, holders, age, owner pid, the\n"
     "buffer a replica copies and its device, and every name"},
    {"names", NULL, GPUPOOL__WIRE__REQUEST__BODY_ADMIN_NAMES, ask_names, render_names,
     "every tenant's published names sorted by key, one row each: buffers,\n"
     "bundles (version, members) and files (path)"},
    {"unpublish", "KEY", GPUPOOL__WIRE__REQUEST__BODY_ADMIN_UNPUBLISH, ask_unpublish, render_unpublish,
     "remove the name filed under KEY, as names shows it (uid:1000/x),\n"
     "whichever tenant published it"},
    {"peers", NULL, GPUPOOL__WIRE__REQUEST__BODY_ADMIN_PEERS, ask_peers, render_peers,
     "the peer daemons: address, state, fetches in flight, fetched,\n"
     "failed, versions served and the last error"},
    {"stats", NULL, GPUPOOL__WIRE__REQUEST__BODY_STATS, ask_stats, render_stats,
     "every daemon and pool counter, one per line"},
    {"drop-client", "PID", GPUPOOL__WIRE__REQUEST__BODY_ADMIN_DROP_CLIENT, ask_drop, render_drop,
     "disconnect every connection of process PID, releasing its holds"},
    {"trim", NULL, GPUPOOL__WIRE__REQUEST__BODY_TRIM, ask_trim, render_trim,
     "give every tenant's empty slabs back to the backend"},
};
#define NCOMMANDS (sizeof commands / sizeof commands[0])

/* The one path of every command: its request, the call, its renderer. A request that names
 * a key the daemon does not know (unpublish) is answered with the keys meant. */
static int run(ctl *c, const command *k, const char *arg) {
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  gpupool__rep *rep;
  body b;
  int rc;

  if ((rc = k->request(arg, &req, &b)) != 0)
    return rc;
  req.body_case = k->body_case;
  if ((rc = call(c, &req, &rep)) == EXIT_NOT_FOUND) {
    not_filed(c, arg);
    return EXIT_REFUSED;
  }
  if (rc != 0)
    return rc;
  rc = k->render(c, rep, arg);
  gpupool__wire__reply__free_unpacked(rep, NULL);
  return rc;
}

static const command *find_command(const char *name) {
  for (size_t i = 0; i < NCOMMANDS; i++)
    if (!strcmp(commands[i].name, name))
      return &commands[i];
  return NULL;
}

/* The nearest of words[0..n) to w when it is near enough to be a typo, else NULL. */
static const char *nearest(const char *w, const char *const *words, size_t n) {
  const char *best = NULL;
  size_t best_d = SIZE_MAX;
  for (size_t i = 0; i < n; i++) {
    size_t d = gpupool__edit_distance(w, words[i]);
    if (d < best_d) {
      best_d = d;
      best = words[i];
    }
  }
  return best && best_d <= 1 + strlen(best) / 4 ? best : NULL;
}

#define SHORT_USAGE "Usage: gpupoolctl [-s PATH] [-j] [-t SEC] COMMAND [ARG]"

/* A mistyped command line: the problem (already said), the short usage and where the rest is. */
static int usage_error(void) {
  fprintf(stderr, "%s\nTry 'gpupoolctl --help' for the commands and options.\n", SHORT_USAGE);
  return EXIT_USAGE;
}

static void usage(FILE *f) {
  fprintf(f,
          "Usage: gpupoolctl [OPTIONS] COMMAND [ARG]\n"
          "\n"
          "Inspect and manage a running gpupoold.\n"
          "\n"
          "Commands:\n");
  for (size_t i = 0; i < NCOMMANDS; i++) {
    const command *k = &commands[i];
    int ri = gpupool__request_index(k->body_case);
    int admin = ri >= 0 && (gpupool__request_kinds[ri].flags & GPUPOOL__REQ_ADMIN);
    char head[32];
    const char *p = k->help;
    snprintf(head, sizeof head, "%s%s%s", k->name, k->arg ? " " : "", k->arg ? k->arg : "");
    fprintf(f, "  %-16s  ", head);
    for (;;) {
      const char *nl = strchr(p, '\n');
      if (!nl) {
        fprintf(f, "%s%s\n", p, admin ? " (admin)" : "");
        break;
      }
      fprintf(f, "%.*s\n%20s", (int)(nl - p), p, "");
      p = nl + 1;
    }
  }
  fprintf(f,
          "\n"
          "Options:\n"
          "  -s, --socket PATH   daemon socket (default: $GPUPOOL_SOCKET, else\n"
          "                      /run/gpupool/gpupoold.sock for root, else\n"
          "                      $XDG_RUNTIME_DIR/gpupool/gpupoold.sock)\n"
          "  -j, --json          print one JSON document instead of text\n"
          "  -t, --timeout SEC   how long to wait for the daemon's answer (default %d, the\n"
          "                      client library's connect timeout; 0 = wait forever)\n"
          "  -h, --help          show this help\n"
          "  -V, --version       show the version\n"
          "\n"
          "Admin commands need root or the daemon's own user.\n"
          "Environment: GPUPOOL_SOCKET (as --socket), GPUPOOL_CONNECT_TIMEOUT_MS (connect and\n"
          "  Hello only; default --timeout).\n"
          "Exit status: 0 success, 1 the daemon refused or failed the request, 2 usage error,\n"
          "3 the daemon could not be reached, 4 the daemon runs but does not serve: its\n"
          "configuration is invalid.\n",
          GPUPOOL_CONNECT_TIMEOUT_DEFAULT_MS / 1000);
}

/* The options, into c and *sock. Returns -1 to go on, or the exit status (--help, --version,
 * a mistake). */
static int parse_options(int argc, char **argv, ctl *c, const char **sock) {
  static const struct option opts[] = {
      {"socket", required_argument, NULL, 's'}, {"json", no_argument, NULL, 'j'},
      {"timeout", required_argument, NULL, 't'}, {"help", no_argument, NULL, 'h'},
      {"version", no_argument, NULL, 'V'},       {NULL, 0, NULL, 0}};
  int o;

  opterr = 0; /* the messages below say what was wrong, and the short usage */
  while ((o = getopt_long(argc, argv, ":s:jt:hV", opts, NULL)) != -1) {
    switch (o) {
    case 's': *sock = optarg; break;
    case 'j': c->json = json_errors = 1; break;
    case 't': {
      char *end = NULL;
      long v = strtol(optarg, &end, 10);
      if (end == optarg || *end != '\0' || v < 0 || v > 86400) {
        die_msg("--timeout wants whole seconds (0 = wait forever), got '%s'", optarg);
        return usage_error();
      }
      c->timeout_s = (int)v;
      break;
    }
    case 'h': usage(stdout); return 0;
    case 'V': printf("gpupoolctl %s\n", GPUPOOL_VERSION_STRING); return 0;
    case ':':
      die_msg("option '%s' needs a value", argv[optind - 1]);
      return usage_error();
    default: {
      /* An option mistyped: name it, and the one meant when it is near enough. */
      const char *bad = argv[optind - 1], *near = NULL;
      char shown[8];
      if (optopt && strncmp(bad, "--", 2) != 0) {
        snprintf(shown, sizeof shown, "-%c", optopt);
        bad = shown;
      } else {
        const char *names[sizeof opts / sizeof opts[0]];
        size_t n = 0, len = strcspn(bad + 2, "=");
        char word[64];
        snprintf(word, sizeof word, "%.*s", (int)(len < sizeof word ? len : sizeof word - 1), bad + 2);
        for (const struct option *op = opts; op->name; op++)
          names[n++] = op->name;
        near = nearest(word, names, n);
      }
      if (near)
        die_msg("unknown option '%s'; did you mean '--%s'?", bad, near);
      else
        die_msg("unknown option '%s'", bad);
      return usage_error();
    }
    }
  }
  return -1;
}

int main(int argc, char **argv) {
  ctl c;
  const char *sock = NULL, *arg;
  int rc;

  memset(&c, 0, sizeof(c));
  c.fd = -1;
  c.timeout_s = GPUPOOL_CONNECT_TIMEOUT_DEFAULT_MS / 1000;
  c.hello_timeout_ms = -1;
  const command *cmd;

  if ((rc = parse_options(argc, argv, &c, &sock)) >= 0)
    return rc;
  if (optind >= argc) {
    die_msg("no command given");
    return usage_error();
  }
  c.cmd = argv[optind];
  arg = optind + 1 < argc ? argv[optind + 1] : NULL;
  if (!(cmd = find_command(c.cmd))) {
    const char *names[NCOMMANDS], *near;
    for (size_t i = 0; i < NCOMMANDS; i++)
      names[i] = commands[i].name;
    near = nearest(c.cmd, names, NCOMMANDS);
    if (near)
      die_msg("unknown command '%s'; did you mean '%s'?", c.cmd, near);
    else
      die_msg("unknown command '%s'", c.cmd);
    return usage_error();
  }
  if (optind + 1 + (cmd->arg != NULL) < argc) {
    die_msg("unexpected argument '%s' after '%s'", argv[optind + 1 + (cmd->arg != NULL)], c.cmd);
    return usage_error();
  }

  if (sock != NULL) {
    if (strlen(sock) >= sizeof(c.path)) {
      die_msg("socket path '%s' is longer than a Unix socket address allows (%zu bytes)", sock,
              sizeof(c.path) - 1);
      return EXIT_USAGE;
    }
    snprintf(c.path, sizeof(c.path), "%s", sock);
  } else if (gpupool_client_default_socket_path(c.path, sizeof(c.path)) != 0) {
    die_msg("%s; pass --socket PATH", gpupool__errmsg());
    return EXIT_USAGE;
  }

  {
    const char *env = getenv("GPUPOOL_CONNECT_TIMEOUT_MS");
    char *end = NULL;
    long v = env && *env ? strtol(env, &end, 10) : -1;
    if (env && *env && (*end != '\0' || v < 0 || v > 86400000)) {
      die_msg("GPUPOOL_CONNECT_TIMEOUT_MS='%s' is not a number of milliseconds", env);
      return EXIT_USAGE;
    }
    c.hello_timeout_ms = v >= 0 ? (int)v : c.timeout_s * 1000;
  }
  if (connect_daemon(&c) != 0)
    return EXIT_UNREACHABLE;
  rc = hello(&c);
  if (rc != 0)
    goto out;
  rc = run(&c, cmd, arg);

out:
  if (c.hello != NULL)
    gpupool__wire__reply__free_unpacked(c.hello, NULL);
  close(c.fd);
  if (fflush(stdout) != 0 && rc == 0) {
    die_msg("cannot write the output: %s", strerror(errno));
    rc = EXIT_REFUSED;
  }
  return rc;
}

