/*
 * gpupoold: command line, configuration, backend and pools, the listening socket (its own or
 * systemd's), readiness, status and watchdog, a reload on SIGHUP, and a graceful shutdown on
 * SIGINT/SIGTERM.
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
#include "state.h"
#include "supervise.h"
#include "wire.h"
#include "config_wait.h"

static void usage(FILE *f) {
  char def[108];
  if (gpupool__socket_path(def, sizeof def, 0) != 0)
    snprintf(def, sizeof def, "(too long)");
  fprintf(f,
          "Usage: gpupoold [OPTIONS]\n"
          "\n"
          "Owns shareable GPU (or host) memory pools and serves them to worker processes over a\n"
          "Unix socket: clients allocate, share, publish and get buffers without copies, and memory\n"
          "returns to the pool only after every holder is done.\n"
          "\n"
          "Options:\n"
          "  -c, --config FILE        read settings from FILE (INI format, see gpupoold.conf)\n"
          "      --check-config       check the settings (file and options) and exit: 0 when\n"
          "                           they are valid, 2 with every error when they are not\n"
          "  -s, --socket PATH        listen on PATH (default now: %s;\n"
          "                           $GPUPOOL_SOCKET, else /run/gpupool/gpupoold.sock for root,\n"
          "                           else $XDG_RUNTIME_DIR/gpupool/gpupoold.sock)\n"
          "  -b, --backend KIND       auto (default: cuda if a usable GPU is present), cuda or host\n"
          "  -p, --pool SPEC          add a pool (repeatable), e.g.\n"
          "                           name=gpu0,kind=device,device=0,capacity=16G,slab=256M\n"
          "                           keys (--list-config-keys says what each takes):\n"
          "                          ",
          def);
  /* The --pool keys as the table has them, short forms where there are. */
  for (size_t i = 0, col = 26; i < gpd_n_config_keys; i++) {
    const gpd_config_key *k = &gpd_config_keys[i];
    const char *name = k->alias ? k->alias : k->name;
    if (!(k->sections & GPUPOOL__CS_SPEC))
      continue;
    if (col + strlen(name) + 1 > 92) {
      fprintf(f, "\n                          ");
      col = 26;
    }
    col += (size_t)fprintf(f, " %s", name);
  }
  fprintf(f,
          "\n"
          "  -l, --log-level LEVEL    error, warn, info (default) or debug\n"
          "      --supervise          run the daemon as a child and keep its fd store (names,\n"
          "                           versions and memory survive its crash), for containers\n"
          "                           and hosts without systemd; SIGUSR2 restarts it\n"
          "      --list-config-keys   print every config key: section, default, what it does\n"
          "  -h, --help               show this help\n"
          "  -V, --version            show the version\n"
          "\n"
          "Without --pool or [pool] sections: one pool per GPU (cuda) or a 1 GiB host pool.\n"
          "\n"
          "Read-only file objects (config keys in [daemon]): a client publishes a file it opened\n"
          "itself (the daemon never opens paths for clients); consumers get a read-only fd.\n"
          "  allow_files = yes|no      whether clients may publish files (default yes)\n"
          "  file_paths = /data /models  allowed path prefixes, checked on the file's resolved\n"
          "                           path (default: none, any file the client can open)\n"
          "  max_files = N             files the daemon keeps open at once (default 1024);\n"
          "                           file names also count against max_names(_per_uid)\n"
          "  file_leases = yes|no      take a read lease on each file to learn of truncation\n"
          "                           and opens for writing (default yes; needs ownership or\n"
          "                           CAP_LEASE, otherwise only checked at get)\n"
          "Environment (over the config file): GPUPOOL_SOCKET (as --socket),\n"
          "  GPUPOOL_BUSY_POLL_US=N    poll N us after client traffic instead of sleeping\n"
          "                           (latency mode, config key busy_poll_us; default 0)\n"
          "  GPUPOOL_TRACE=FILE        append a line per request: when it came in (monotonic\n"
          "                           us) and how long it took (bench/trace_breakdown.py)\n"
          "Signals: SIGINT/SIGTERM shut down gracefully; SIGHUP re-reads the configuration\n"
          "  (what can change while serving changes; the log says what did and what waits\n"
          "  for a restart; a file that does not parse changes nothing).\n"
          "Exit status: 0 after a clean shutdown, 2 for an invalid configuration (restarting\n"
          "will not help: fix it), 1 for any other failure.\n");
}

/* What the command line asked for; applied over the config file by load_config (at start
 * and at each reload). */
typedef struct {
  const char *config_path, *socket_opt, *backend_opt, *level_opt;
  const char *pool_specs[GPUPOOL_MAX_POOLS];
  int npool_specs;
  int check_only;
  int supervise;
} options;

typedef struct {
  uv_loop_t *loop;
  gpd_server *server;
  gpd_registry *reg;
  gpd_config *cfg;         /* what the server and registry read: a reload changes it in place */
  const options *opts;
  gpupool__backend *be;
  uv_signal_t sigint, sigterm, sighup;
  uv_timer_t watchdog, status;
  int watchdog_on;
  char last_status[GPD_SD_STATUS_MAX]; /* the STATUS= last sent, to send only changes */
  char reload_note[GPUPOOL__ERRMSG_MAX + 64]; /* after a failed reload, kept in STATUS= until the next one */
} daemon_ctx;

static void shutdown_daemon(daemon_ctx *d, const char *why) {
  if (!d->server)
    return;
  GPUPOOL__INFO("shutting down (%s)", why);
  gpd_sd_notify("STOPPING=1");
  /* The last state, with the clients still connected (their holds, read-only or not, to give
   * back to their next connections); the next daemon starts from it. */
  gpd_state_flush(d->reg);
  gpd_server_stop(d->server);
  d->server = NULL;
  gpd_state_stop(d->reg);
  /* Bounded shutdown: leases and GPU work are not waited for (nothing is reused any more). */
  gpd_registry_stop(d->reg);
  gpd_close_watch(&d->sigint, &d->sigterm, &d->sighup, d->watchdog_on ? &d->watchdog : NULL);
  uv_close((uv_handle_t *)&d->status, NULL);
}

static void on_signal(uv_signal_t *h, int signum) {
  shutdown_daemon(h->data, signum == SIGINT ? "SIGINT" : "SIGTERM");
}

/* The live figures for STATUS= (systemctl status): clients, memory, names. Sent when they
 * changed, at most once a second (the status timer), so a busy daemon does not flood PID 1.
 * Parts in order of importance, each cut only between words to fit GPD_SD_STATUS_MAX: a
 * failed reload, then what is served (short, never cut), then the degraded exporters
 * (room kept for at least their names). */
#define STATUS_KEEP_DEGRADED 96
static void status_text(daemon_ctx *d, char *buf, size_t len) {
  uint64_t used = 0, cap = 0;
  char serving[160], degraded[3 * GPUPOOL__ERRMSG_MAX + 64];
  size_t at = 0;
  for (int i = 0; i < d->reg->npools; i++) {
    used += d->reg->pools[i].used;
    cap += d->reg->pools[i].cfg.capacity;
  }
  if (gpd_server_metrics_degraded(d->server, degraded, sizeof degraded) <= 0)
    degraded[0] = '\0';
  snprintf(serving, sizeof serving, "Serving %d pool(s) on the %s backend: %" PRIu64 " client(s), %" PRIu64
           " of %" PRIu64 " MiB used, %" PRIu64 " name(s)",
           d->cfg->n_pools, d->be->desc->name, gpd_server_clients(d->server), used >> 20, cap >> 20,
           d->reg->nnames);
  {
    const gpd_state_info *si = gpd_state_info_get(d->reg);
    size_t n = strlen(serving);
    if (si && si->found && n < sizeof serving)
      snprintf(serving + n, sizeof serving - n, " (%" PRIu64 " restored at start)", si->names);
  }
  buf[0] = '\0';
  if (d->reload_note[0])
    at = gpd_sd_status_add(buf, len, at, "", d->reload_note,
                           strlen(serving) + 2 + (degraded[0] ? STATUS_KEEP_DEGRADED : 0));
  at = gpd_sd_status_add(buf, len, at, at ? "; " : "", serving, 0);
  if (degraded[0])
    (void)gpd_sd_status_add(buf, len, at, "; degraded: ", degraded, 0);
}

/* STATUS= when it changed; with READY=1 in the same message when ready is set (systemd
 * shows the status the moment the unit becomes active). */
static void update_status(daemon_ctx *d, int ready) {
  char buf[sizeof d->last_status];
  if (!d->server)
    return;
  status_text(d, buf, sizeof buf);
  if (!ready && !strcmp(buf, d->last_status))
    return;
  memcpy(d->last_status, buf, sizeof buf);
  gpd_sd_notifyf("%sSTATUS=%s", ready ? "READY=1\n" : "", buf);
}

static void on_status_timer(uv_timer_t *t) { update_status(t->data, 0); }

static int load_config(const options *o, gpd_config *cfg);

/* SIGHUP (systemctl reload): read the configuration again and apply what can change while
 * serving (gpd_config_reload says what). A file that no longer parses changes nothing; why
 * goes to the log and to STATUS=. RELOADING=1 ... READY=1 frame it for systemd. */
static void reload(daemon_ctx *d) {
  gpd_config next;
  char applied[1024], kept[512];
  struct timespec ts;

  clock_gettime(CLOCK_MONOTONIC, &ts);
  gpd_sd_notifyf("RELOADING=1\nMONOTONIC_USEC=%llu\nSTATUS=Reloading the configuration",
                 (unsigned long long)ts.tv_sec * 1000000ull + (unsigned long long)ts.tv_nsec / 1000);
  if (load_config(d->opts, &next) != 0 || gpd_config_finish(&next, d->be->desc) != 0) {
    GPUPOOL__ERROR("reload: configuration not changed: %s (check it with gpupoold --check-config%s%s)",
                   gpupool__errmsg(), d->opts->config_path ? " --config " : "",
                   d->opts->config_path ? d->opts->config_path : "");
    snprintf(d->reload_note, sizeof d->reload_note, "Reload failed, old configuration kept: %s",
             gpupool__errmsg());
    update_status(d, 1);
    return;
  }
  d->reload_note[0] = '\0';
  gpd_config_reload(d->cfg, &next, applied, sizeof applied, kept, sizeof kept);
  /* What waits for a restart stays visible (gpupoolctl status) after this log line scrolls. */
  gpd_server_set_restart_pending(d->server, kept);
  gpupool__log_set_level(d->cfg->log_level);
  /* Before the line that says the reload is done: by then no connection the new file
   * refuses is served. */
  gpd_server_reloaded(d->server);
  GPUPOOL__INFO("reloaded %s: changed: %s%s%s%s", d->opts->config_path ? d->opts->config_path : "(no file)",
                applied[0] ? applied : "nothing", kept[0] ? "; not changed until a restart: " : "", kept,
                kept[0] ? " (they stay as they were)" : "");
  update_status(d, 1);
}

static void on_sighup(uv_signal_t *h, int signum) {
  (void)signum;
  reload(h->data);
}

static void on_watchdog(uv_timer_t *t) {
  (void)t;
  gpd_sd_notify("WATCHDOG=1");
}

/* A start-up failure: the reason goes to the log at error priority and, under systemd, to
 * the unit's status line (systemctl status shows it after the exit). Returns the exit
 * status: 2 for a configuration error (the unit's RestartPreventExitStatus=2 stops the
 * restart loop), 1 otherwise. */
static int start_failed(int rc, const char *what) {
  int status = rc == GPUPOOL_ECONFIG ? 2 : 1;
  const char *msg = gpupool__errmsg();
  if (!*msg)
    msg = gpupool_strerror(rc);
  GPUPOOL__ERROR("%s%s%s", what ? what : "", what ? ": " : "", msg);
  gpd_sd_notifyf("STATUS=Failed%s: %s%s%s", status == 2 ? " (configuration)" : "",
                      what ? what : "", what ? ": " : "", msg);
  return status;
}

/* An invalid command line or configuration: exit status 2 with the reason. */
static int config_failed(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int config_failed(const char *fmt, ...) {
  char msg[GPUPOOL__ERRMSG_MAX];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  gpupool__err(GPUPOOL_ECONFIG, "%s", msg);
  return start_failed(GPUPOOL_ECONFIG, NULL);
}

/* --check-config: everything the daemon would check before serving, without serving. The
 * pools are checked against the backend the daemon would run (auto probes for a GPU, as
 * at start-up); nothing is bound and no memory is taken. */
static int check_config(const options *o, gpd_config *cfg) {
  const char *path = o->config_path;
  gpupool__backend *be = NULL;
  char changed[1024];
  int rc, load_failed, opt_err, nerr, secret_err;
  gpupool__log_set_level(GPUPOOL_LOG_WARN);
  /* Every error, not only the first: the file's as they are found, then what the pools and
   * sections say against the backend (checked after an error too, to find theirs as well). */
  gpd_config_report_errors(stderr);
  load_failed = load_config(o, cfg) != 0;
  opt_err = load_failed && gpd_config_errors_reported() == 0; /* the command line's, not the file's */
  if (opt_err)
    fprintf(stderr, "gpupoold: %s\n", gpupool__errmsg());
  if ((rc = gpupool__backend_open(cfg->backend, &be)) != 0) {
    fprintf(stderr, "gpupoold: cannot open the %s backend to check the pools against: %s\n",
            cfg->backend ? cfg->backend->name : "auto", gpupool__errmsg());
    return 1;
  }
  rc = gpd_config_finish(cfg, be->desc);
  /* The files the start reads, checked by the start's own code (after a file error too). */
  secret_err = gpd_peers_check_secrets(cfg) != 0;
  if (secret_err)
    fprintf(stderr, "gpupoold: %s\n", gpupool__errmsg());
  if (rc != 0 || load_failed || secret_err) {
    nerr = gpd_config_errors_reported() + opt_err + secret_err;
    fprintf(stderr, "gpupoold: %d error%s in %s\n", nerr, nerr == 1 ? "" : "s",
            path ? path : "the options");
    be->ops->close(be);
    return 2;
  }
  gpd_config_changed_keys(cfg, changed, sizeof changed);
  printf("gpupoold: configuration OK (%s): socket %s, backend %s, %d pool(s)\n"
         "gpupoold: [daemon] keys away from their defaults (file, options, environment): %s\n",
         path ? path : "no file", cfg->socket_path[0] ? cfg->socket_path : "(from systemd)",
         be->desc->name, cfg->n_pools, changed[0] ? changed : "none");
  be->ops->close(be);
  return 0;
}

/* -1 to go on, or the exit status to return now (--help, --version, a bad option). */
static int parse_options(int argc, char **argv, options *o) {
  static const struct option opts[] = {{"config", required_argument, NULL, 'c'},
                                       {"socket", required_argument, NULL, 's'},
                                       {"backend", required_argument, NULL, 'b'},
                                       {"pool", required_argument, NULL, 'p'},
                                       {"log-level", required_argument, NULL, 'l'},
                                       {"help", no_argument, NULL, 'h'},
                                       {"version", no_argument, NULL, 'V'},
                                       {"check-config", no_argument, NULL, 'C'},
                                       {"list-config-keys", no_argument, NULL, 'K'},
                                       {"supervise", no_argument, NULL, 'S'},
                                       {NULL, 0, NULL, 0}};
  int opt;

  while ((opt = getopt_long(argc, argv, "c:s:b:p:l:hV", opts, NULL)) != -1) {
    switch (opt) {
    case 'c':
      o->config_path = optarg;
      break;
    case 's':
      o->socket_opt = optarg;
      break;
    case 'b':
      o->backend_opt = optarg;
      break;
    case 'p':
      if (o->npool_specs >= GPUPOOL_MAX_POOLS)
        return config_failed("at most %d --pool options", GPUPOOL_MAX_POOLS);
      o->pool_specs[o->npool_specs++] = optarg;
      break;
    case 'l':
      o->level_opt = optarg;
      break;
    case 'S':
      o->supervise = 1;
      break;
    case 'C':
      o->check_only = 1;
      break;
    case 'K':
      gpd_config_list_keys(stdout);
      return 0;
    case 'h':
      usage(stdout);
      return 0;
    case 'V':
      printf("gpupoold %s (protocol %d, backends: host%s)\n", GPUPOOL_VERSION_STRING,
             GPUPOOL__WIRE__VERSION__PROTOCOL_VERSION,
#ifdef GPUPOOL_HAVE_CUDA
             ", cuda"
#else
             ""
#endif
      );
#ifdef GPUPOOL_HAVE_UCX
      printf("peers: ucx %s\n", GPUPOOL_UCX_VERSION);
#else
      printf("peers: not built (no UCX found by pkg-config)\n");
#endif
      return 0;
    default:
      usage(stderr);
      return 2;
    }
  }
  if (optind < argc)
    return config_failed("unexpected argument '%s' (see gpupoold --help)", argv[optind]);
  return -1;
}

/* The config file, then the command line and the environment over it. 0, or
 * GPUPOOL_ECONFIG with the reason (gpupool__errmsg). */
static int load_config(const options *o, gpd_config *cfg) {
  const char *bp = getenv("GPUPOOL_BUSY_POLL_US");
  char why[GPUPOOL__ERRMSG_MAX];

  gpd_config_defaults(cfg);
  if (o->config_path && gpd_config_load(cfg, o->config_path) != 0)
    goto fail;
  if (o->socket_opt && snprintf(cfg->socket_path, sizeof cfg->socket_path, "%s", o->socket_opt) >=
                           (int)sizeof cfg->socket_path)
    return gpupool__err(GPUPOOL_ECONFIG, "--socket path longer than %zu bytes", sizeof cfg->socket_path - 1);
  if (o->backend_opt && gpd_config_set_backend(cfg, o->backend_opt) != 0)
    goto fail;
  if (bp && *bp && gpd_config_set(cfg, "busy_poll_us", bp) != 0) {
    snprintf(why, sizeof why, "%s", gpupool__errmsg());
    return gpupool__err(GPUPOOL_ECONFIG, "GPUPOOL_BUSY_POLL_US: %s", why);
  }
  if (o->level_opt && gpupool__log_parse_level(o->level_opt, &cfg->log_level) != 0)
    goto fail;
  for (int i = 0; i < o->npool_specs; i++)
    if (gpd_config_add_pool_spec(cfg, o->pool_specs[i]) != 0)
      goto fail;
  return 0;
fail:
  snprintf(why, sizeof why, "%s", gpupool__errmsg());
  return gpupool__err(GPUPOOL_ECONFIG, "%s", why);
}

/* The registry and the server (which starts the metrics) on d->loop; the server takes
 * *listen_fd (-1: it binds its own socket). 0, or the exit status with both closed. */
static int start_serving(daemon_ctx *d, const gpd_config *cfg, gpupool__backend *be,
                         gpd_registry *reg, int *listen_fd) {
  int rc;

  if ((rc = gpd_registry_init(reg, d->loop, cfg, be)) != 0) {
    int status = start_failed(rc, NULL);
    gpd_registry_close(reg);
    uv_run(d->loop, UV_RUN_DEFAULT);
    return status;
  }
  d->reg = reg;
  /* What a previous daemon kept in the fd store comes back before the first client is served. */
  if ((rc = gpd_state_init(reg)) != 0) {
    int status = start_failed(rc, "cannot take over the kept state");
    gpd_registry_close(reg);
    uv_run(d->loop, UV_RUN_DEFAULT);
    return status;
  }
  if ((rc = gpd_server_start(&d->server, d->loop, cfg, reg, *listen_fd)) != 0) {
    int status = start_failed(rc, NULL);
    gpd_registry_close(reg);
    uv_run(d->loop, UV_RUN_DEFAULT);
    return status;
  }
  *listen_fd = -1; /* the server owns it now */
  return 0;
}

/* SIGINT/SIGTERM shut down, SIGHUP reloads; STATUS= follows the live figures; under a
 * systemd watchdog, a ping every half interval. */
static void watch_signals(daemon_ctx *d) {
  uint64_t wd;

  uv_signal_init(d->loop, &d->sigint);
  uv_signal_init(d->loop, &d->sigterm);
  uv_signal_init(d->loop, &d->sighup);
  d->sigint.data = d->sigterm.data = d->sighup.data = d;
  uv_signal_start(&d->sigint, on_signal, SIGINT);
  uv_signal_start(&d->sigterm, on_signal, SIGTERM);
  uv_signal_start(&d->sighup, on_sighup, SIGHUP);
  uv_timer_init(d->loop, &d->status);
  d->status.data = d;
  uv_timer_start(&d->status, on_status_timer, 1000, 1000);
  wd = gpd_sd_watchdog_usec();
  if (wd) {
    uv_timer_init(d->loop, &d->watchdog);
    uv_timer_start(&d->watchdog, on_watchdog, wd / 2000 ? wd / 2000 : 1, wd / 2000 ? wd / 2000 : 1);
    d->watchdog_on = 1;
  }
}

/* Serves until shutdown_daemon has run and the loop has nothing left. */
static void run_loop(daemon_ctx *d, const gpd_config *cfg) {
  if (cfg->busy_poll_us == 0) {
    uv_run(d->loop, UV_RUN_DEFAULT);
    return;
  }
  /* Latency mode: right after client traffic, poll without sleeping, so a request that
   * follows soon does not wait for this thread to be woken. */
  GPUPOOL__INFO("busy polling for %u us after client activity (busy_poll_us)", cfg->busy_poll_us);
  for (;;) {
    int more;
    if (d->server && gpd_now_ns() - gpd_server_last_activity(d->server) < (uint64_t)cfg->busy_poll_us * 1000)
      more = uv_run(d->loop, UV_RUN_NOWAIT);
    else
      more = uv_run(d->loop, UV_RUN_ONCE);
    if (!more && !d->server)
      break;
  }
}

/* The configuration and the backend it names; 0 with *be open, or an error (message set). */
static int try_config(const options *o, gpd_config *cfg, gpupool__backend **be) {
  int rc;
  if (load_config(o, cfg) != 0)
    return GPUPOOL_ECONFIG;
  /* Before the backend logs its first line: every line obeys the configured level. */
  gpupool__log_set_level(cfg->log_level);
  if ((rc = gpupool__backend_open(cfg->backend, be)) != 0)
    return rc;
  if (gpd_config_finish(cfg, (*be)->desc) != 0) {
    (*be)->ops->close(*be);
    *be = NULL;
    return GPUPOOL_ECONFIG;
  }
  return 0;
}

/* gpd_wait_for_config's way to read the configuration again. */
static int retry_config(void *arg, gpd_config *cfg, gpupool__backend **be) {
  return try_config(arg, cfg, be);
}

int main(int argc, char **argv) {
  options o = {0};
  gpd_config cfg;
  gpupool__backend *be = NULL;
  gpd_registry reg;
  daemon_ctx d = {0};
  sigset_t stop_sigs;
  int rc, listen_fd, exit_code;

  if ((rc = parse_options(argc, argv, &o)) >= 0)
    return rc;
  if (o.check_only) {
    return check_config(&o, &cfg);
  }
  if (o.supervise)
    return gpd_supervise(argc, argv);
  signal(SIGPIPE, SIG_IGN);

  /* Taken before anything else so a bad LISTEN_FDS fails fast and the variables do not leak
   * into children. */
  listen_fd = gpd_sd_listen_fd();
  if (listen_fd < -1)
    return start_failed(listen_fd, NULL);
  d.loop = uv_default_loop();
  d.opts = &o;

  rc = try_config(&o, &cfg, &be);
  if (rc == GPUPOOL_ECONFIG && listen_fd >= 0) {
    /* Socket-activated: stay and say why (see config_wait.c). */
    if (!gpd_wait_for_config(d.loop, listen_fd, &cfg, &be, retry_config, (void *)&o)) {
      exit_code = 0;
      goto out_fd;
    }
  } else if (rc == GPUPOOL_ECONFIG) {
    exit_code = start_failed(rc, NULL);
    goto out_fd;
  } else if (rc != 0) {
    char what[64];
    snprintf(what, sizeof what, "cannot open the %s backend", cfg.backend ? cfg.backend->name : "host");
    exit_code = start_failed(rc, what);
    goto out_fd;
  }
  gpupool__log_set_level(cfg.log_level);
  /* A client may connect, and a supervisor send SIGTERM, as soon as the socket listens: keep
   * those signals pending until their handlers are in place, not let them end the daemon. */
  sigemptyset(&stop_sigs);
  sigaddset(&stop_sigs, SIGINT);
  sigaddset(&stop_sigs, SIGTERM);
  sigaddset(&stop_sigs, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &stop_sigs, NULL);
  if ((exit_code = start_serving(&d, &cfg, be, &reg, &listen_fd)) != 0)
    goto out_be;
  d.cfg = &cfg;
  d.be = be;
  watch_signals(&d);
  pthread_sigmask(SIG_UNBLOCK, &stop_sigs, NULL);

  GPUPOOL__INFO("gpupoold %s ready on %s: backend %s, %d pool(s)", GPUPOOL_VERSION_STRING,
          cfg.socket_path[0] ? cfg.socket_path : "(socket from systemd)", be->desc->name, cfg.n_pools);
  update_status(&d, 1);
  run_loop(&d, &cfg);

  gpd_registry_close(&reg);
  uv_run(d.loop, UV_RUN_DEFAULT); /* close callbacks of what the registry held */
  GPUPOOL__INFO("stopped");
out_be:
  if (be)
    be->ops->close(be);
out_fd:
  if (listen_fd >= 0)
    close(listen_fd);
  uv_loop_close(uv_default_loop());
  return exit_code;
}
