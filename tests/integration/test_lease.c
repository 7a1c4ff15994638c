/*
 * Leases: memory of a client whose connection closed is reused only once no process holds
 * the connection's lease any more; liveness never comes from a pid. Each case runs the real
 * gpupoold and real processes, and is one ctest entry (the argument names it):
 *   pidns     the daemon in its own PID namespace (clients' pids read as 0)
 *   nofile    the daemon at its fd limit: connections it cannot watch are refused, the ones
 *             it serves keep their memory
 *   fork      a forked worker keeps reading a buffer after its parent (the pid that
 *             connected) has exited
 *   flood     connect / allocate / hang up in a loop: the daemon's fds and the uid's pinned
 *             bytes stay bounded, and the refusal names the limit
 *   sigterm   SIGTERM with a live holder: the daemon exits within 1 s, and the holder's
 *             memory stays valid after it
 *   restarts  50 daemon SIGKILL + restart cycles: the client's fds and mappings stay flat,
 *             and gpupool_client_disconnect leaves none behind
 *   getrestart  a get blocked across a daemon restart succeeds on the new daemon
 *   emfile    out of fds at accept: no spin, one log line per interval, connected clients
 *             are served and new ones are refused with the reason
 * Exit 77 (skipped) only where the kernel refuses a PID namespace.
 */
#include <dirent.h>
#include <poll.h>
#include <pthread.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>

#include "harness.h"

#define POOL "name=default,kind=host,capacity=8M,slab=2M"
#define HOLD_SIZE (256u << 10)

static th_daemon D;
static int in_pidns;    /* D.pid is unshare; the daemon is its child */
static long nofile_cap; /* RLIMIT_NOFILE for the daemon, 0 = inherited */

/* ---- starting and stopping the daemon under a PID namespace or an fd limit -------------- */

/* In the daemon's child: the fd limit of the nofile case. */
static int cap_nofile(void *arg) {
  (void)arg;
  if (nofile_cap) {
    struct rlimit rl = {(rlim_t)nofile_cap, (rlim_t)nofile_cap};
    setrlimit(RLIMIT_NOFILE, &rl);
  }
  return 0;
}

/* The log is appended to: the restart cases keep every daemon's lines. */
static void start_daemon(int use_conf) {
  static const char *const unshare[] = {"unshare", "--pid", "--fork", "--kill-child", NULL};
  ts_daemon_opts o = {.gpupoold = GPUPOOLD_PATH, .backend = "host", .pool = POOL, .log_level = "debug",
                      .use_conf = use_conf, .ready_ms = 5000, .poll_ms = 10, .hook = cap_nofile,
                      .wrapper = in_pidns ? unshare : NULL, .append_log = 1};
  th_start_opts(&D, &o);
}

/* The process to signal: the daemon itself, also when unshare forked it. */
static pid_t daemon_pid(void) {
  char path[64];
  FILE *f;
  int child = 0;
  if (!in_pidns)
    return D.pid;
  snprintf(path, sizeof path, "/proc/%d/task/%d/children", (int)D.pid, (int)D.pid);
  f = fopen(path, "r");
  if (f) {
    if (fscanf(f, "%d", &child) != 1)
      child = 0;
    fclose(f);
  }
  return child > 0 ? child : D.pid;
}

/* SIGTERM; returns the exit status and sets *ms to how long the exit took. */
static int stop_daemon(uint64_t *ms) {
  int st = 0;
  uint64_t t0 = th_now_ms();
  pid_t dp = daemon_pid();
  kill(dp, SIGTERM);
  waitpid(D.pid, &st, 0);
  if (ms)
    *ms = th_now_ms() - t0;
  th_track(D.pid, 0);
  D.pid = 0;
  return st;
}

static void cleanup_dir(void) {
  unlink(D.sock);
  unlink(D.log);
  unlink(D.conf);
  rmdir(D.dir);
}

static void stop_clean(void) {
  int st = stop_daemon(NULL);
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
    th_dump_log(&D);
    fail_msg("gpupoold did not exit cleanly on SIGTERM (status 0x%x)", st);
  }
  cleanup_dir();
}

/* A fill pattern in which every seed differs from every other at every byte (the harness's
 * th_byte depends on the seed only above 2^24). */
static uint8_t pat(uint32_t seed, uint64_t j) { return (uint8_t)(seed * 151u + j * 7u + (j >> 9)); }

static void fill(void *p, uint32_t seed, uint64_t n) {
  for (uint64_t j = 0; j < n; j++)
    ((uint8_t *)p)[j] = pat(seed, j);
}

static int check(const void *p, uint32_t seed, uint64_t n) {
  for (uint64_t j = 0; j < n; j++)
    if (((const uint8_t *)p)[j] != pat(seed, j))
      return 0;
  return 1;
}

/* ---- small process helpers ---------------------------------------------------------------- */

static int count_fds(void) {
  DIR *d = opendir("/proc/self/fd");
  struct dirent *e;
  int n = 0;
  while (d && (e = readdir(d)))
    if (e->d_name[0] != '.')
      n++;
  if (d)
    closedir(d);
  return n - 1; /* the directory's own fd */
}

/* Lines of /proc/self/maps, all of them and those of gpupool memory (memfd "gpupool:..."). */
static void count_maps(int *all, int *pool) {
  char line[512];
  FILE *f = fopen("/proc/self/maps", "re");
  *all = *pool = 0;
  while (f && fgets(line, sizeof line, f)) {
    (*all)++;
    if (strstr(line, "gpupool:"))
      (*pool)++;
  }
  if (f)
    fclose(f);
}

static void put_int(int fd, int v) { assert_true(write(fd, &v, sizeof v) == (ssize_t)sizeof v); }

/* Reads one int within timeout_ms; -1000 on timeout or EOF. */
static int get_int(int fd, int timeout_ms) {
  struct pollfd p = {.fd = fd, .events = POLLIN};
  int v;
  if (poll(&p, 1, timeout_ms) != 1 || read(fd, &v, sizeof v) != (ssize_t)sizeof v)
    return -1000;
  return v;
}

static int child_put(int fd, int v) { return write(fd, &v, sizeof v) == (ssize_t)sizeof v ? 0 : 1; }

static int child_get(int fd) {
  int v;
  return read(fd, &v, sizeof v) == (ssize_t)sizeof v ? v : -1;
}

/* Wait until the daemon has processed every hang-up: only the stats connection is left. */
static void wait_clients(uint64_t n) {
  gpupool_daemon_stats ds;
  uint64_t end = th_now_ms() + 5000;
  do {
    th_stats(&D, &ds, NULL);
    if (ds.clients == n + 1)
      return;
    th_sleep_ms(20);
  } while (th_now_ms() < end);
  th_dump_log(&D);
  fail_msg("daemon still has %llu clients, expected %llu", (unsigned long long)ds.clients - 1,
           (unsigned long long)n);
}

/* A child on two pipes: commands to it, reports from it. Both kinds below are these. */
typedef struct {
  pid_t pid;
  int to, from; /* command pipe to it, report pipe from it */
} piped;

typedef int (*piped_main)(uint32_t seed, int cmd, int rep, int arg);

/* Fork a child that runs child_main(seed, its command end, its report end, arg) and exits
 * with what it returns. */
static piped spawn_piped(piped_main child_main, uint32_t seed, int arg) {
  piped p;
  int a[2], b[2];
  assert_int_equal(pipe2(a, O_CLOEXEC), 0);
  assert_int_equal(pipe2(b, O_CLOEXEC), 0);
  p.pid = fork();
  assert_true(p.pid >= 0);
  if (p.pid == 0) {
    close(a[1]);
    close(b[0]);
    _exit(child_main(seed, a[0], b[1], arg));
  }
  close(a[0]);
  close(b[1]);
  p.to = a[1];
  p.from = b[0];
  return p;
}

/* Send the child its one command and return its answer (within timeout_ms); both pipes are
 * closed after. */
static int piped_ask(piped *p, int timeout_ms) {
  int v;
  put_int(p->to, 1);
  v = get_int(p->from, timeout_ms);
  close(p->to);
  close(p->from);
  return v;
}

/* A process that connects, then on command allocates everything the pool will give, writes
 * seed into it and exits: the client that would receive a range reused too early. */
typedef piped taker;

static int taker_main(uint32_t seed, int cmd, int rep, int arg) {
  gpupool_client *c;
  gpupool_buffer *bf;
  int got = 0;
  (void)arg;
  if (gpupool_client_connect(D.sock, "taker", GPUPOOL_TIMEOUT_DEFAULT, &c) != 0) {
    fprintf(stderr, "taker: %s\n", gpupool_last_error());
    return child_put(rep, -1);
  }
  child_put(rep, 1);
  if (child_get(cmd) != 1)
    return 1;
  while (gpupool_buffer_alloc(c, NULL, HOLD_SIZE, 0, NULL, &bf) == 0) {
    fill(gpupool_buffer_ptr(bf), seed, HOLD_SIZE);
    got++;
  }
  return child_put(rep, got);
}

static taker spawn_taker(uint32_t seed) {
  taker t = spawn_piped(taker_main, seed, 0);
  assert_int_equal(get_int(t.from, 10000), 1);
  return t;
}

/* Returns how many buffers the taker got; it has exited when this returns. */
static int taker_go(taker *t) {
  int n = piped_ask(t, 20000);
  waitpid(t->pid, NULL, 0);
  return n;
}

/* ---- hang-up holders ------------------------------------------------------------------------ */

typedef piped holder;

/* A child that allocates HOLD_SIZE bytes, fills them with seed, closes its connection but keeps
 * the mapping (and so the lease), reports 1 (or a negative gpupool code when it was refused),
 * then on command checks its bytes and exits 0 when they are intact, 3 when another client
 * wrote over them. */
static int holder_main(uint32_t seed, int cmd, int rep, int do_fork) {
  gpupool_client *c;
  gpupool_buffer *b;
  int rc = gpupool_client_connect(D.sock, "holder", GPUPOOL_TIMEOUT_DEFAULT, &c);
  if (rc != 0) {
    fprintf(stderr, "holder %u: connect refused: %s\n", seed, gpupool_last_error());
    return child_put(rep, rc);
  }
  if ((rc = gpupool_buffer_alloc(c, NULL, HOLD_SIZE, 0, NULL, &b)) != 0) {
    fprintf(stderr, "holder %u: alloc refused: %s\n", seed, gpupool_last_error());
    return child_put(rep, rc);
  }
  fill(gpupool_buffer_ptr(b), seed, HOLD_SIZE);
  if (do_fork) {
    /* DataLoader-style: the worker inherits the mapping (and the lease); the parent, the
     * process that connected, exits at once. */
    pid_t w = fork();
    if (w < 0)
      return 1;
    if (w > 0)
      _exit(0);
  }
  th_close_sockets();
  if (child_put(rep, 1) != 0)
    return 1;
  if (child_get(cmd) != 1)
    return 1;
  /* Read it like a worker would, after the other client wrote everything it was given. */
  if (!check(gpupool_buffer_ptr(b), seed, HOLD_SIZE)) {
    fprintf(stderr, "holder %u: its buffer was handed to another client and overwritten\n", seed);
    return child_put(rep, 3);
  }
  return child_put(rep, 0);
}

static holder spawn_holder(uint32_t seed, int do_fork) { return spawn_piped(holder_main, seed, do_fork); }

/* Tells the holder to check; returns its verdict (0 intact). */
static int holder_verdict(holder *h) { return piped_ask(h, 10000); }

static void reap_all(void) {
  while (waitpid(-1, NULL, WNOHANG) > 0)
    ;
}

/* One holder hangs up; another client takes everything; the holder's bytes must be intact
 * and its memory must come back once it has exited. */
static void hangup_then_take(void) {
  taker t = spawn_taker(99);
  holder h = spawn_holder(11, 0);
  int got, v;
  assert_int_equal(get_int(h.from, 10000), 1);
  wait_clients(1);
  got = taker_go(&t);
  assert_true(got > 0);
  v = holder_verdict(&h);
  waitpid(h.pid, NULL, 0);
  if (v != 0) {
    th_dump_log(&D);
    fail_msg("the holder's range was reused while it still mapped it (verdict %d)", v);
  }
  th_wait_idle(&D, 5000);
}

/* ---- cases ---------------------------------------------------------------------------------- */

static void case_pidns(void **state) {
  (void)state;
  hangup_then_take();
}

static void case_nofile(void **state) {
  holder hs[40];
  int nh = 0, refused = 0, v, got;
  taker t = spawn_taker(77);
  (void)state;
  /* Holders until the daemon runs out of fds: each one that is served keeps its lease. */
  for (int i = 0; i < 40; i++) {
    holder h = spawn_holder(100 + (uint32_t)i, 0);
    int r = get_int(h.from, 5000);
    if (r == 1) {
      hs[nh++] = h;
      continue;
    }
    /* Refused (with the reason), or never answered by a daemon stuck at its limit. */
    kill(h.pid, SIGKILL);
    waitpid(h.pid, NULL, 0);
    close(h.to);
    close(h.from);
    if (r == GPUPOOL_ELIMIT)
      refused++;
    if (refused >= 3 || r == -1000)
      break;
  }
  assert_true(nh >= 1);
  got = taker_go(&t);
  fprintf(stderr, "nofile: %d holders served, %d refused, the taker got %d buffers\n", nh, refused, got);
  assert_true(got > 0);
  for (int i = 0; i < nh; i++) {
    v = holder_verdict(&hs[i]);
    waitpid(hs[i].pid, NULL, 0);
    if (v != 0) {
      th_dump_log(&D);
      fail_msg("holder %d of %d: its range was reused while it still mapped it (verdict %d)", i, nh, v);
    }
  }
  /* Connections the daemon could not give a lease were refused with a clear reason. */
  assert_true(refused >= 1);
  th_wait_idle(&D, 5000);
}

static void case_fork(void **state) {
  holder h;
  taker t;
  int got, v, st;
  (void)state;
  /* The worker is reparented to this process when its parent exits. */
  assert_int_equal(prctl(PR_SET_CHILD_SUBREAPER, 1), 0);
  t = spawn_taker(98);
  h = spawn_holder(21, 1);
  assert_int_equal(get_int(h.from, 10000), 1);
  assert_int_equal(waitpid(h.pid, &st, 0), h.pid); /* the parent that connected has exited */
  wait_clients(1);
  got = taker_go(&t);
  assert_true(got > 0);
  v = holder_verdict(&h);
  if (v != 0) {
    th_dump_log(&D);
    fail_msg("the forked worker's buffer was reused after its parent exited (verdict %d)", v);
  }
  th_sleep_ms(50);
  reap_all();
  th_wait_idle(&D, 5000); /* the worker has exited: everything is back */
}

static void case_flood(void **state) {
  gpupool_daemon_stats ds;
  gpupool_pool_stats ps;
  uint64_t base_fds;
  int p[2], q[2], ok, refused, named;
  pid_t f;
  (void)state;
  base_fds = th_settled_fds(&D);
  assert_int_equal(pipe2(p, O_CLOEXEC), 0);
  assert_int_equal(pipe2(q, O_CLOEXEC), 0);
  f = fork();
  assert_true(f >= 0);
  if (f == 0) {
    int good = 0, bad = 0, msg = 0;
    for (int i = 0; i < 300; i++) {
      gpupool_client *c;
      gpupool_buffer *b;
      int rc = gpupool_client_connect(D.sock, "flood", GPUPOOL_TIMEOUT_DEFAULT, &c);
      if (rc == 0) {
        rc = gpupool_buffer_alloc(c, NULL, 4096, 0, NULL, &b);
        if (rc == 0) {
          good++;
          memset(gpupool_buffer_ptr(b), 1, 4096);
        } else {
          bad++;
          if (rc == GPUPOOL_ELIMIT && strstr(gpupool_last_error(), "max_waiting_leases_per_uid"))
            msg++;
        }
      } else {
        bad++;
      }
      /* Hang up; the lease and the mapping stay with this process. */
      th_close_sockets();
    }
    child_put(p[1], good);
    child_put(p[1], bad);
    child_put(p[1], msg);
    child_get(q[0]);
    _exit(0);
  }
  close(p[1]);
  close(q[0]);
  ok = get_int(p[0], 60000);
  refused = get_int(p[0], 1000);
  named = get_int(p[0], 1000);
  assert_true(ok > 0);
  th_stats(&D, &ds, &ps);
  fprintf(stderr, "flood: %d allocations kept, %d refused (%d naming the lease limit); daemon fds %llu (base %llu), "
                  "pool used %llu bytes\n",
          ok, refused, named, (unsigned long long)ds.open_fds, (unsigned long long)base_fds,
          (unsigned long long)ps.used);
  /* Bounded by the config: 16 waiting leases and 1 MiB for the uid. */
  assert_true(ds.open_fds <= base_fds + 16 + 2);
  assert_true(ps.used <= (1u << 20));
  assert_true(named >= 1);
  put_int(q[1], 1);
  assert_int_equal(waitpid(f, NULL, 0), f);
  close(p[0]);
  close(q[1]);
  th_wait_idle(&D, 5000);
  th_expect_fds(&D, base_fds);
}

static void case_sigterm(void **state) {
  holder h = spawn_holder(31, 0);
  uint64_t ms;
  int st, v;
  FILE *f;
  char line[1024];
  int said = 0;
  (void)state;
  assert_int_equal(get_int(h.from, 10000), 1);
  wait_clients(0);
  st = stop_daemon(&ms);
  fprintf(stderr, "sigterm: the daemon exited %llu ms after SIGTERM (status 0x%x)\n", (unsigned long long)ms, st);
  if (ms >= 1000) {
    th_dump_log(&D);
    fail_msg("gpupoold took %llu ms to stop with a live holder; it must stop within 1 s",
             (unsigned long long)ms);
  }
  assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  /* The holder's memory is still its own after the daemon is gone. */
  v = holder_verdict(&h);
  waitpid(h.pid, NULL, 0);
  assert_int_equal(v, 0);
  f = fopen(D.log, "r");
  assert_non_null(f);
  while (fgets(line, sizeof line, f))
    if (strstr(line, "stopping with 1 closed connection(s)"))
      said = 1;
  fclose(f);
  if (!said) {
    th_dump_log(&D);
    fail_msg("the log does not say what was pending at shutdown");
  }
}

static void crash_and_restart(void) {
  kill(D.pid, SIGKILL);
  waitpid(D.pid, NULL, 0);
  th_track(D.pid, 0);
  D.pid = 0;
  start_daemon(0);
}

static void case_restarts(void **state) {
  gpupool_client *c;
  gpupool_buffer *b, *held;
  int fds0, all0, pool0, fds1 = 0, all1 = 0, pool1 = 0, fds, all, pool;
  (void)state;
  count_maps(&all0, &pool0);
  fds0 = count_fds();
  c = th_connect(&D, "restarts");
  assert_int_equal(gpupool_buffer_alloc(c, NULL, 4096, 0, NULL, &held), 0);
  for (int i = 1; i <= 50; i++) {
    crash_and_restart();
    /* The next request reconnects; a fresh buffer comes from the new daemon. */
    assert_int_equal(gpupool_buffer_alloc(c, NULL, 4096, 0, NULL, &b), 0);
    fill(gpupool_buffer_ptr(b), (uint32_t)i, 4096);
    assert_true(check(gpupool_buffer_ptr(b), (uint32_t)i, 4096));
    assert_int_equal(gpupool_buffer_release(b, NULL), 0);
    if (i == 1) {
      /* The buffer held since the first daemon keeps its mapping until released. */
      assert_true(gpupool_buffer_lost(held));
      assert_int_equal(gpupool_buffer_release(held, NULL), 0);
    }
    fds = count_fds();
    count_maps(&all, &pool);
    if (i == 1) {
      fds1 = fds;
      all1 = all;
      pool1 = pool;
    }
    if (i == 50)
      fprintf(stderr, "restarts: after 1 restart %d fds, %d mappings (%d of gpupool memory); after 50: %d, %d (%d)\n",
              fds1, all1, pool1, fds, all, pool);
    if (fds != fds1 || pool != pool1 || all != all1)
      fail_msg("restart %d: %d fds, %d mappings (%d of gpupool memory); after the first: %d, %d (%d)", i, fds, all,
               pool, fds1, all1, pool1);
  }
  gpupool_client_disconnect(c);
  fds = count_fds();
  count_maps(&all, &pool);
  fprintf(stderr, "restarts: before connecting %d fds, %d mappings (%d gpupool); after disconnect %d, %d (%d)\n", fds0,
          all0, pool0, fds, all, pool);
  /* Every fd and every mapping of gpupool memory is gone. (The total mapping count is not
   * compared with the one before connecting: the allocator, under ASan especially, keeps
   * regions it mapped for the client's first allocations.) */
  assert_int_equal(pool, 0);
  assert_int_equal(fds, fds0);
}

typedef struct {
  gpupool_client *c;
  int rc;
  int intact;
} get_arg;

static void *blocked_get(void *p) {
  get_arg *a = p;
  gpupool_buffer *b;
  a->rc = gpupool_buffer_get(a->c, "late", 0, 20000, GPUPOOL_READ_ONLY, NULL, &b, NULL);
  if (a->rc == 0) {
    a->intact = check(gpupool_buffer_ptr(b), 55, 10000);
    gpupool_buffer_release(b, NULL);
  } else {
    fprintf(stderr, "blocked get: %s: %s\n", gpupool_err_name(a->rc), gpupool_last_error());
  }
  return NULL;
}

/* A listener on the daemon's socket that drops what it accepts, the way a daemon going down
 * (or dying during start-up) closes connections before answering Hello. Returns how many
 * connections it dropped within ms. */
static int drop_connections(int ms) {
  struct sockaddr_un a = {.sun_family = AF_UNIX};
  uint64_t end = th_now_ms() + (uint64_t)ms;
  int l = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0), n = 0;
  assert_true(l >= 0);
  unlink(D.sock);
  memcpy(a.sun_path, D.sock, strlen(D.sock) + 1);
  assert_int_equal(bind(l, (struct sockaddr *)&a, sizeof a), 0);
  assert_int_equal(listen(l, 16), 0);
  while (th_now_ms() < end) {
    struct pollfd p = {.fd = l, .events = POLLIN};
    if (poll(&p, 1, 20) == 1) {
      int fd = accept4(l, NULL, NULL, SOCK_CLOEXEC);
      if (fd >= 0) {
        close(fd);
        n++;
      }
    }
  }
  close(l);
  unlink(D.sock);
  return n;
}

static void case_getrestart(void **state) {
  get_arg a = {0};
  pthread_t t;
  gpupool_client *p;
  gpupool_buffer *b;
  int dropped;
  (void)state;
  a.c = th_connect(&D, "waiter");
  assert_int_equal(pthread_create(&t, NULL, blocked_get, &a), 0);
  th_sleep_ms(300); /* the get is waiting in the daemon */
  kill(D.pid, SIGKILL);
  waitpid(D.pid, NULL, 0);
  th_track(D.pid, 0);
  D.pid = 0;
  dropped = drop_connections(1500);
  fprintf(stderr, "getrestart: %d connection(s) dropped before the new daemon came up\n", dropped);
  assert_true(dropped >= 1);
  start_daemon(0);
  p = th_connect(&D, "late producer");
  assert_int_equal(gpupool_buffer_alloc(p, NULL, 10000, 0, NULL, &b), 0);
  fill(gpupool_buffer_ptr(b), 55, 10000);
  assert_int_equal(gpupool_buffer_publish(b, "late", NULL, NULL, NULL), 0);
  pthread_join(t, NULL);
  assert_int_equal(a.rc, 0);
  assert_true(a.intact);
  assert_int_equal(gpupool_buffer_release(b, NULL), 0);
  assert_int_equal(gpupool_name_unpublish(p, "late"), 0);
  gpupool_client_disconnect(p);
  gpupool_client_disconnect(a.c);
  th_wait_idle(&D, 5000);
}

static int log_lines_with(const char *what) {
  FILE *f = fopen(D.log, "r");
  char line[2048];
  int n = 0;
  while (f && fgets(line, sizeof line, f))
    if (strstr(line, what))
      n++;
  if (f)
    fclose(f);
  return n;
}

/* A client connecting while the daemon is out of fds: refused with the reason, in a child
 * that a daemon stuck at its limit cannot hang. Returns the gpupool code (0 = served). */
static int connect_in_child(int *said_fds) {
  int p[2], rc;
  pid_t pid;
  assert_int_equal(pipe2(p, O_CLOEXEC), 0);
  pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    gpupool_client *c;
    int r;
    alarm(10);
    r = gpupool_client_connect(D.sock, "late", GPUPOOL_TIMEOUT_DEFAULT, &c);
    child_put(p[1], r);
    child_put(p[1], r != 0 && strstr(gpupool_last_error(), "file descriptors") != NULL);
    _exit(0);
  }
  close(p[1]);
  rc = get_int(p[0], 15000);
  *said_fds = get_int(p[0], 1000);
  close(p[0]);
  waitpid(pid, NULL, 0);
  return rc;
}

static void case_emfile(void **state) {
  gpupool_client *c = th_connect(&D, "connected");
  gpupool_buffer *b;
  int raw[80], n = 0, said = 0, rc, lines;
  (void)state;
  assert_int_equal(gpupool_buffer_alloc(c, NULL, 4096, 0, NULL, &b), 0);
  assert_int_equal(gpupool_buffer_release(b, NULL), 0);
  /* Connections that never say Hello until the daemon has no fd left. */
  for (n = 0; n < 80; n++) {
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    raw[n] = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    assert_true(raw[n] >= 0);
    memcpy(a.sun_path, D.sock, strlen(D.sock) + 1);
    if (connect(raw[n], (struct sockaddr *)&a, sizeof a) != 0) {
      close(raw[n]);
      break;
    }
  }
  th_sleep_ms(1500);
  rc = connect_in_child(&said);
  fprintf(stderr, "emfile: late client got %s (%s the fd limit)\n", gpupool_err_name(rc), said ? "naming" : "not naming");
  assert_int_equal(rc, GPUPOOL_ELIMIT);
  assert_true(said);
  /* The connected client is still served. */
  assert_int_equal(gpupool_buffer_alloc(c, NULL, 4096, 0, NULL, &b), 0);
  assert_int_equal(gpupool_buffer_release(b, NULL), 0);
  /* Few log lines about it, not one per failed accept. */
  lines = log_lines_with("accept failed") + log_lines_with("out of file descriptors");
  fprintf(stderr, "emfile: %d log lines about accepting after 1.5 s at the limit\n", lines);
  if (lines > 10) {
    fail_msg("%d log lines about failed accepts: the daemon spins on its listener", lines);
  }
  for (int i = 0; i < n; i++)
    close(raw[i]);
  /* Fds come back: new clients are served again. */
  th_sleep_ms(600);
  gpupool_client_disconnect(c);
  c = th_connect(&D, "after");
  assert_int_equal(gpupool_buffer_alloc(c, NULL, 4096, 0, NULL, &b), 0);
  assert_int_equal(gpupool_buffer_release(b, NULL), 0);
  gpupool_client_disconnect(c);
}

/* ---- main ------------------------------------------------------------------------------------ */

static int setup(void **state) {
  (void)state;
  th_prepare(&D);
  return 0;
}

static int setup_started(void **state) {
  setup(state);
  start_daemon(0);
  return 0;
}

static int setup_flood(void **state) {
  setup(state);
  th_write_conf(&D, "[daemon]\nmax_bytes_per_uid = 1M\nmax_waiting_leases_per_uid = 16\n");
  start_daemon(1);
  return 0;
}

static int setup_emfile(void **state) {
  setup(state);
  th_write_conf(&D, "[daemon]\nhandshake_timeout_ms = 60000\n");
  start_daemon(1);
  return 0;
}

static int teardown(void **state) {
  (void)state;
  if (D.pid > 0)
    stop_clean();
  else
    cleanup_dir();
  reap_all();
  return 0;
}

static int unshare_works(void) {
  int st;
  pid_t pid = fork();
  if (pid == 0) {
    int fd = open("/dev/null", O_WRONLY);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
    }
    execlp("unshare", "unshare", "--pid", "--fork", "true", (char *)NULL);
    _exit(127);
  }
  return pid > 0 && waitpid(pid, &st, 0) == pid && WIFEXITED(st) && WEXITSTATUS(st) == 0;
}

/* One row per case the ctest entries name (argv[1]): its cmocka test (setup included) and the
 * file limit it runs under (0: the default). */
#define LEASE_CASE(which, fn, setup, nofile) {which, cmocka_unit_test_setup_teardown(fn, setup, teardown), nofile}
static const struct lease_case {
  const char *which;
  struct CMUnitTest test;
  long nofile;
} cases[] = {
    LEASE_CASE("pidns", case_pidns, setup_started, 0),
    LEASE_CASE("nofile", case_nofile, setup_started, 40),
    LEASE_CASE("fork", case_fork, setup_started, 0),
    LEASE_CASE("flood", case_flood, setup_flood, 0),
    LEASE_CASE("sigterm", case_sigterm, setup_started, 0),
    LEASE_CASE("restarts", case_restarts, setup_started, 0),
    LEASE_CASE("getrestart", case_getrestart, setup_started, 0),
    LEASE_CASE("emfile", case_emfile, setup_emfile, 32),
};

int main(int argc, char **argv) {
  const char *which = argc > 1 ? argv[1] : "";
  signal(SIGPIPE, SIG_IGN);
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    const struct lease_case *k = &cases[i];
    const struct CMUnitTest t[] = {k->test};
    if (strcmp(which, k->which))
      continue;
    if (!strcmp(which, "pidns")) {
      if (!unshare_works()) {
        fprintf(stderr, "skipped: this kernel or sandbox refuses unshare --pid --fork\n");
        return 77;
      }
      in_pidns = 1;
    }
    if (k->nofile)
      nofile_cap = k->nofile;
    return cmocka_run_group_tests(t, NULL, NULL);
  }
  fprintf(stderr, "usage: test_lease pidns|nofile|fork|flood|sigterm|restarts|getrestart|emfile\n");
  return 2;
}
