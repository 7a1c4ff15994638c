/*
 * The config parser and pool checks: a full file, --pool specs, and errors that name the
 * file, the line and the fix. Also the daemon refusing a bad config at start-up.
 */
#include <sys/stat.h>

#include "harness.h"
#include "config.h"
#include "errors.h"

static char path[] = "/tmp/gpupool-conf-XXXXXX";

static void write_file(const char *text) {
  int fd = mkstemp(path);
  assert_true(fd >= 0);
  assert_int_equal(write(fd, text, strlen(text)), (ssize_t)strlen(text));
  close(fd);
}

/* Load text from a fresh temp file (its name in path, for the caller to check and unlink):
 * the load must be refused with GPUPOOL_ECONFIG. The message it left. */
static const char *load_refused(const char *text) {
  gpd_config c;
  strcpy(path, "/tmp/gpupool-conf-XXXXXX");
  write_file(text);
  gpd_config_defaults(&c);
  assert_int_equal(gpd_config_load(&c, path), GPUPOOL_ECONFIG);
  return gpupool__errmsg();
}

static void test_full_file(void **state) {
  gpd_config c;
  (void)state;
  write_file("# comment\n[daemon]\nsocket = /tmp/x.sock\nbackend = host\nlog_level = debug\n"
             "socket_mode = 0600\nmax_clients = 10\nmax_bytes_per_uid = 2G\nallow_uids = 0, 1000\nbusy_poll_us = 250\n"
             "[pool a]\nkind = host\ncapacity = 128M\nslab_size = 3M\nkeep_slabs = 2\n"
             "[pool b]\ncapacity = 64M\n");
  gpd_config_defaults(&c);
  assert_int_equal(gpd_config_load(&c, path), 0);
  assert_string_equal(c.socket_path, "/tmp/x.sock");
  assert_ptr_equal(c.backend, &gpupool__backend_host);
  assert_int_equal(c.socket_mode, 0600);
  assert_int_equal(c.max_clients, 10);
  assert_int_equal(c.max_bytes_per_uid, 2ull << 30);
  assert_int_equal(c.n_allow_uids, 2);
  assert_int_equal(c.allow_uids[1], 1000);
  assert_int_equal(c.busy_poll_us, 250);
  assert_int_equal(c.n_pools, 2);
  assert_int_equal(gpd_config_finish(&c, &gpupool__backend_host), 0);
  assert_int_equal(c.pools[0].slab_size, 4u << 20); /* rounded up to 2 MiB */
  assert_int_equal(c.pools[0].keep_slabs, 2);
  assert_int_equal(c.pools[1].kind, GPUPOOL_MEM_HOST);
  assert_int_equal(c.pools[1].slab_size, 64u << 20);
  unlink(path);
}

static void test_errors_name_line(void **state) {
  static const struct {
    const char *text, *needle;
  } cases[] = {
      {"[daemon]\nbogus = 1\n", ":2: unknown key 'bogus'"},
      {"socket = /x\n", "outside a section"},
      {"[daemon\n", "malformed section"},
      {"[weird]\n", "unknown section"},
      {"[pool p]\ncapacity = 12Q\n", "unknown suffix"},
      {"[pool p]\nkind = gpu\n", "unknown pool kind"},
      {"[daemon]\nbackend = tpu\n", "unknown backend"},
      {"[daemon]\nmax_clients\n", "expected 'key = value'"},
      /* Every parser's refusal, each reached through the file (so each carries file:line). */
      {"[pool p]\ncapacity = lots\n", ":2: 'lots' is not a size"},
      {"[pool p]\ncapacity = 64Mx\n", ":2: size '64Mx' has"},
      {"[pool p]\ncapacity = 99999999999T\n", ":2: size '99999999999T'"},
      {"[daemon]\nmax_clients = -3\n", ":2: '-3' is not a number"},
      {"[daemon]\nlisten_backlog = 0\n", ":2: listen_backlog must be between"},
      {"[pool p]\ndevice = 5000\n", ":2: '5000' is not a whole number"},
      {"[daemon]\nfile_leases = maybe\n", ":2: 'maybe' is not a boolean"},
      {"[daemon]\nfile_paths = data\n", ":2: file_paths entry 'data' is not an absolute path"},
      {"[daemon]\nfile_paths = /data/../etc\n", ":2: file_paths entry '/data/../etc' must be a canonical"},
      {"[daemon]\nsocket_mode = rw\n", ":2: socket_mode 'rw' is not an octal mode"},
      {"[daemon]\nallow_uids = x\n", ":2: "},
      {"[pool p]\nbogus = 1\n", ":2: unknown"},
      {"[pool " "p123456789012345678901234567890123456789012345678901234567890123456789" "]\n", ":1: pool name"},
      {"[tenant a/b]\n", ":1: [tenant NAME] needs a name"},
  };
  (void)state;
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    const char *msg = load_refused(cases[i].text);
    if (!strstr(msg, cases[i].needle))
      fail_msg("case %zu: '%s' lacks '%s'", i, msg, cases[i].needle);
    assert_non_null(strstr(msg, path));
    unlink(path);
  }
}

/* An unknown key names the key it is nearest to, when that is close enough to be a typo, and
 * lists what its section takes; a key nowhere near any gets the list alone. */
static void test_did_you_mean(void **state) {
  static const struct {
    const char *text, *needle, *also;
  } cases[] = {
      {"[daemon]\nmax_clinets = 1\n", ":2: unknown key 'max_clinets' in [daemon]; did you mean 'max_clients'? (known",
       "max_clients, "},
      {"[daemon]\nbusy_pol_us = 1\n", "did you mean 'busy_poll_us'?", "--list-config-keys"},
      {"[pool p]\ncapcity = 1G\n", ":2: unknown pool key 'capcity'; did you mean 'capacity'? (known: ",
       "slab_size, alignment, keep_slabs, release_threshold, reuse_follow_event_deps"},
      {"[pool p]\nslabb = 2M\n", "did you mean 'slab'?", "share"},
      {"[tenant t]\nuid = 1\n", ":2: unknown key 'uid' in [t]; did you mean 'uids'? (known: uids, gids, export_peers)", ""},
      {"[group g]\ngid = 1\n", "did you mean 'gids'?", ""},
  };
  gpd_config c;
  (void)state;
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    const char *msg = load_refused(cases[i].text);
    if (!strstr(msg, cases[i].needle) || !strstr(msg, cases[i].also))
      fail_msg("case %zu: '%s' lacks '%s' or '%s'", i, msg, cases[i].needle, cases[i].also);
    unlink(path);
  }
  /* Far from every key: no guess, and the daemon's keys listed (nearest first, cut short). */
  gpd_config_defaults(&c);
  assert_int_equal(gpd_config_set(&c, "bogus", "1"), GPUPOOL_EINVAL);
  assert_null(strstr(gpupool__errmsg(), "did you mean"));
  assert_non_null(strstr(gpupool__errmsg(), "unknown key 'bogus' in [daemon] (known, nearest first: "));
  assert_non_null(strstr(gpupool__errmsg(), "more: gpupoold --list-config-keys"));
  /* --pool specs take the pool keys but not share, which only a [pool] section can say. */
  assert_int_equal(gpd_config_add_pool_spec(&c, "name=x,kepe=2"), GPUPOOL_ECONFIG);
  assert_non_null(strstr(gpupool__errmsg(), "--pool 'name=x,kepe=2': unknown pool key 'kepe'; did you mean 'keep'?"));
  assert_int_equal(gpd_config_add_pool_spec(&c, "share=ml"), GPUPOOL_ECONFIG);
  assert_non_null(strstr(gpupool__errmsg(), "unknown pool key 'share' (known: name, kind, "));
  assert_null(strstr(gpupool__errmsg(), "share,"));
}

static void test_pool_checks(void **state) {
  gpd_config c;
  (void)state;
  gpd_config_defaults(&c);
  assert_int_equal(gpd_config_add_pool_spec(&c, "name=x,capacity=1G,slab=5G"), 0);
  assert_int_equal(gpd_config_finish(&c, &gpupool__backend_host), GPUPOOL_ECONFIG);
  assert_non_null(strstr(gpupool__errmsg(), "4G"));
  assert_non_null(strstr(gpupool__errmsg(), "--pool x: "));
  gpd_config_defaults(&c);
  assert_int_equal(gpd_config_add_pool_spec(&c, "name=x,kind=device"), 0);
  assert_int_equal(gpd_config_finish(&c, &gpupool__backend_host), GPUPOOL_ECONFIG);
  assert_non_null(strstr(gpupool__errmsg(), "host backend"));
  gpd_config_defaults(&c);
  assert_int_equal(gpd_config_add_pool_spec(&c, "name=x,align=48"), 0);
  assert_int_equal(gpd_config_finish(&c, &gpupool__backend_host), GPUPOOL_ECONFIG);
  /* survive=yes: any host pool; on cuda, device pools without stream-ordered attributes. */
  gpd_config_defaults(&c);
  assert_int_equal(gpd_config_add_pool_spec(&c, "name=x,survive=yes"), 0);
  assert_int_equal(gpd_config_finish(&c, &gpupool__backend_host), 0);
  assert_int_equal(c.pools[0].survive, 1);
  gpd_config_defaults(&c);
  assert_int_equal(gpd_config_add_pool_spec(&c, "name=x,kind=device,survive=yes,capacity=1G"), 0);
  assert_int_equal(gpd_config_finish(&c, &gpupool__backend_cuda), 0);
  assert_int_equal(c.pools[0].survive, 1);
  gpd_config_defaults(&c);
  assert_int_equal(gpd_config_add_pool_spec(&c, "name=x,kind=host-numa,numa=0,survive=yes,capacity=1G"), 0);
  assert_int_equal(gpd_config_finish(&c, &gpupool__backend_cuda), 0);
  gpd_config_defaults(&c);
  assert_int_equal(gpd_config_add_pool_spec(&c, "name=x,kind=device,survive=yes,reuse_allow_opportunistic=no"), 0);
  assert_int_equal(gpd_config_finish(&c, &gpupool__backend_cuda), GPUPOOL_ECONFIG);
  assert_non_null(strstr(gpupool__errmsg(), "remove them or survive"));
  gpd_config_defaults(&c);
  assert_int_equal(gpd_config_add_pool_spec(&c, "name=x,survive=perhaps"), GPUPOOL_ECONFIG);
  gpd_config_defaults(&c);
  assert_int_equal(gpd_config_add_pool_spec(&c, "nonsense"), GPUPOOL_ECONFIG);
  gpd_config_defaults(&c);
  assert_int_equal(gpd_config_finish(&c, &gpupool__backend_host), 0); /* a default host pool */
  assert_int_equal(c.n_pools, 1);
  assert_string_equal(c.pools[0].name, "default");
}

/* What the pool checks refuse once the file is read (slab_size over 4G, a kind the backend
 * lacks, an alignment, a capacity under one slab, a share with no group) names the file and
 * the line of the key at fault (the pool's section when the key is not written), as the
 * parser's errors do, with sizes as the file writes them; a --pool spec is named as such. */
static void test_pool_checks_name_line(void **state) {
  static const struct {
    const char *text, *needle;
  } cases[] = {
      {"[daemon]\nbackend = host\n\n[pool a]\nslab_size = 8G\n", ":5: [pool a] pool 'a': slab_size 8G exceeds 4G"},
      {"[pool a]\ncapacity = 64M\n[pool b]\n\nkind = device\n", ":5: [pool b] pool 'b' asks for device memory"},
      {"[pool a]\nalignment = 48\n", ":2: [pool a] pool 'a': alignment 48 must"},
      {"[pool a]\ncapacity = 1M\nslab_size = 4M\n", ":2: [pool a] pool 'a': capacity 1M is smaller than one slab (4M)"},
      {"[pool a]\nslab = 4G\n", ":1: [pool a] pool 'a': capacity 1G is smaller than one slab (4G)"},
      {"[pool a]\ncapacity = 1610612737\nslab_size = 2G\n", "capacity 1.5G (1610612737 bytes) is smaller"},
      {"[pool a]\n# the group\nshare = nobody\n", ":3: [pool a] pool 'a' is shared with group 'nobody'"},
  };
  (void)state;
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    gpd_config c;
    char where[320];
    strcpy(path, "/tmp/gpupool-conf-XXXXXX");
    write_file(cases[i].text);
    gpd_config_defaults(&c);
    assert_int_equal(gpd_config_load(&c, path), 0);
    assert_int_equal(gpd_config_finish(&c, &gpupool__backend_host), GPUPOOL_ECONFIG);
    snprintf(where, sizeof where, "%s%s", cases[i].needle[0] == ':' ? path : "", cases[i].needle);
    if (!strstr(gpupool__errmsg(), where))
      fail_msg("case %zu: '%s' lacks '%s'", i, gpupool__errmsg(), where);
    unlink(path);
  }
}

/* A file with several errors: all are found (each reported where --check-config sends them,
 * at its own line), the message is the first one's and counts the rest; the pool checks
 * after it report every pool's error too. */
static void test_all_errors(void **state) {
  gpd_config c;
  char out[4096] = "";
  FILE *f = tmpfile();
  size_t n;
  (void)state;
  assert_non_null(f);
  strcpy(path, "/tmp/gpupool-conf-XXXXXX");
  write_file("[daemon]\nmax_clinets = 5\nlog_level = loud\n[nonsense]\nx = 1\n[pool a]\nslab_size = 8G\n"
             "[pool b]\ncapacity = 2M\nslab_size = 4M\ncapacity = what\n");
  gpd_config_report_errors(f);
  gpd_config_defaults(&c);
  assert_int_equal(gpd_config_load(&c, path), GPUPOOL_ECONFIG);
  assert_non_null(strstr(gpupool__errmsg(), ":2: unknown key 'max_clinets'"));
  assert_non_null(strstr(gpupool__errmsg(), "(and 3 more errors"));
  assert_int_equal(gpd_config_errors_reported(), 4);
  assert_int_equal(gpd_config_finish(&c, &gpupool__backend_host), GPUPOOL_ECONFIG);
  assert_int_equal(gpd_config_errors_reported(), 6);
  gpd_config_report_errors(NULL);
  rewind(f);
  n = fread(out, 1, sizeof out - 1, f);
  out[n] = '\0';
  fclose(f);
  printf("%s", out);
  for (int i = 0; i < 6; i++) {
    static const char *const want[] = {":2: unknown key", ":3: unknown log level", ":4: unknown section",
                                       ":11: 'what' is not a size", ":7: [pool a] pool 'a': slab_size 8G",
                                       ":9: [pool b] pool 'b': capacity 2M is smaller than one slab (4M)"};
    if (!strstr(out, want[i]))
      fail_msg("the errors reported lack '%s':\n%s", want[i], out);
  }
  assert_null(strstr(out, ":5:")); /* the key of a refused section is not refused again */
  unlink(path);
}

static void test_sizes(void **state) {
  uint64_t v;
  (void)state;
  assert_int_equal(gpd_parse_size("4096", &v), 0);
  assert_int_equal(v, 4096);
  assert_int_equal(gpd_parse_size("64M", &v), 0);
  assert_int_equal(v, 64u << 20);
  assert_int_equal(gpd_parse_size("2GiB", &v), 0);
  assert_int_equal(v, 2ull << 30);
  assert_int_equal(gpd_parse_size("-1", &v), GPUPOOL_EINVAL);
  assert_int_equal(gpd_parse_size("99999999999T", &v), GPUPOOL_EINVAL);
}

static void test_daemon_refuses_bad_config(void **state) {
  th_daemon d;
  int st;
  pid_t pid;
  FILE *f;
  char line[512] = "";
  const char *argv[] = {GPUPOOLD_PATH, "--config", d.conf, "--socket", d.sock, NULL};
  (void)state;
  th_prepare(&d);
  th_write_conf(&d, "[pool p]\ncapacity = lots\n");
  pid = ts_exec(argv, d.log, TS_EXEC_STDERR_ONLY, NULL, NULL);
  assert_true(pid > 0);
  waitpid(pid, &st, 0);
  assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 2);
  f = fopen(d.log, "r");
  assert_non_null(f);
  assert_non_null(fgets(line, sizeof line, f));
  fclose(f);
  assert_non_null(strstr(line, ":2:"));
  assert_non_null(strstr(line, "not a size"));
  d.pid = 0;
  th_stop(&d);
}

/* A section named twice would be merged silently; both places are named in the refusal. */
static void test_duplicate_sections(void **state) {
  static const struct {
    const char *text, *needle;
  } cases[] = {
      {"[pool p]\ncapacity = 64M\n[pool q]\n[pool p]\nslab = 2M\n", ":4: [pool p] repeats the section at "},
      {"[tenant t]\nuids = 1\n[tenant t]\nuids = 2\n", ":3: [tenant t] repeats the section at "},
      {"[group g]\nuids = 1\n\n[group g]\n", ":4: [group g] repeats the section at "},
      {"[daemon]\nmax_clients = 1\n[daemon]\nmax_clients = 2\n", ":3: [daemon] repeats the section at "},
  };
  static const int first[] = {1, 1, 1, 1};
  (void)state;
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char where[320];
    const char *msg = load_refused(cases[i].text);
    snprintf(where, sizeof where, "%s:%d", path, first[i]);
    if (!strstr(msg, cases[i].needle) || !strstr(msg, where))
      fail_msg("case %zu: '%s' lacks '%s' or '%s'", i, msg, cases[i].needle, where);
    unlink(path);
  }
}

/* Runs gpupoold --config conf and requires it to exit with status 2 within 10 s, its log
 * holding `needle`; a daemon that blocks or starts serving is killed and the test fails. */
static void expect_refused_promptly(th_daemon *d, const char *conf, const char *needle) {
  char buf[2048] = "";
  int st = 0, fd;
  ssize_t n;
  const char *argv[] = {GPUPOOLD_PATH, "--config", conf, "--socket", d->sock, "--backend", "host", NULL};
  pid_t pid = ts_exec(argv, d->log, TS_EXEC_STDERR_ONLY, NULL, NULL);
  assert_true(pid >= 0);
  if (ts_wait_pid(pid, 10000, 1, &st) != 0) {
    th_dump_log(d);
    fail_msg("gpupoold --config %s neither refused it nor exited within 10 s", conf);
  }
  assert_true(WIFEXITED(st));
  fd = open(d->log, O_RDONLY);
  assert_true(fd >= 0);
  n = read(fd, buf, sizeof buf - 1);
  close(fd);
  buf[n > 0 ? n : 0] = '\0';
  if (WEXITSTATUS(st) != 2 || !strstr(buf, needle))
    fail_msg("gpupoold --config %s: status %d, log '%s' (expected 2 and '%s')", conf, WEXITSTATUS(st), buf,
             needle);
}

static void test_config_not_a_file(void **state) {
  th_daemon d;
  char dir[320], fifo[320];
  (void)state;
  th_prepare(&d);
  snprintf(dir, sizeof dir, "%s/conf.d", d.dir);
  snprintf(fifo, sizeof fifo, "%s/conf.fifo", d.dir);
  assert_int_equal(mkdir(dir, 0755), 0);
  assert_int_equal(mkfifo(fifo, 0644), 0);
  expect_refused_promptly(&d, dir, "is a directory, not a regular file");
  /* Nothing ever writes to the FIFO: a blocking open would wait forever. */
  expect_refused_promptly(&d, fifo, "is a FIFO, not a regular file");
  rmdir(dir);
  unlink(fifo);
  d.pid = 0;
  th_stop(&d);
}

/* Load text and finish it against the host backend: the refusal (load or finish) it left,
 * or "" when it was accepted. */
static const char *load_finish(const char *text, gpd_config *c) {
  strcpy(path, "/tmp/gpupool-conf-XXXXXX");
  write_file(text);
  gpd_config_defaults(c);
  if (gpd_config_load(c, path) != 0 || gpd_config_finish(c, &gpupool__backend_host) != 0)
    return gpupool__errmsg();
  return "";
}

/* [peer NAME] sections, export_peers and the peer keys of [daemon]: read into their fields,
 * and every refusal names the file, the line and what to write. */
static void test_peer_sections(void **state) {
  static const struct {
    const char *text, *needle;
  } bad[] = {
      {"[peer a.b]\n", ":1: [peer NAME] needs a name of 1 to 32 letters"},
      {"[peer a]\naddress = 10.0.0.1:1\n[peer a]\n", ":3: [peer a] repeats the section at"},
      {"[peer a]\nadress = 10.0.0.1:1\n", ":2: unknown key 'adress' in [peer a]; did you mean 'address'?"},
      {"[peer a]\naddress = host:1\n", ":2: address 'host:1' is not PORT"},
      {"[daemon]\npeer_listen = 1.2.3.4:0\n", ":2: peer_listen '1.2.3.4:0' is not PORT"},
      {"[daemon]\npeer_secret_file = /s\n[peer a]\n", ":3: [peer a] has no address"},
      {"[peer a]\naddress = 10.0.0.1:1\n", ":1: [peer a] has no secret: set peer_secret_file"},
      {"[daemon]\npeer_secret_file = /s\n[group ml]\ngids = 1\n[peer ml]\naddress = 10.0.0.1:1\n",
       ":5: [peer ml] has the name of [group ml] at"},
      {"[daemon]\npeer_secret_file = /s\n[tenant t]\nuids = 1\nexport_peers = b\n",
       ":3: [tenant t] export_peers names 'b', which has no [peer b] section"},
      {"[daemon]\npeer_listen = 7470\n", "peer_listen is set but peer_secret_file is not"},
  };
  gpd_config c;
  (void)state;
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    const char *msg = load_finish(bad[i].text, &c);
    if (!strstr(msg, bad[i].needle))
      fail_msg("case %zu: '%s' lacks '%s'", i, msg, bad[i].needle);
    unlink(path);
  }
  assert_string_equal(load_finish("[daemon]\npeer_listen = 127.0.0.1:7470\npeer_secret_file = /etc/s\n"
                                  "[tenant t]\nuids = 1\nexport_peers = b, c\n[group g]\ngids = 2\nexport_peers = *\n"
                                  "[peer b]\naddress = 10.0.0.2:7470\nprefix = remote/\n"
                                  "[peer c]\naddress = 10.0.0.3:7471\nsecret_file = /etc/c\n", &c), "");
  unlink(path);
  assert_string_equal(c.peer_listen, "127.0.0.1:7470");
  assert_int_equal(c.n_peers, 2);
  assert_string_equal(gpd_peer_find(&c, "b")->prefix, "remote/");
  assert_string_equal(gpd_peer_find(&c, "c")->secret_file, "/etc/c");
  assert_null(gpd_peer_find(&c, "d"));
  assert_true(gpd_exports_to(&c.tenants[0], "c"));
  assert_false(gpd_exports_to(&c.tenants[0], "d"));
  assert_true(gpd_exports_to(&c.groups[0], "d"));
  assert_int_equal(c.peer_max_fetches, 64);
}

/* gpupoold --check-config on the config text conf (written in d's dir): its exit status (-1
 * when it did not exit within 10 s), and what it printed (stdout and stderr) in out. */
static int check_config(th_daemon *d, const char *conf, char *out, size_t len) {
  int st = 0, fd;
  ssize_t n;
  const char *argv[] = {GPUPOOLD_PATH, "--check-config", "--config", d->conf, "--backend", "host", NULL};
  pid_t pid;
  th_write_conf(d, conf);
  pid = ts_exec(argv, d->log, 0, NULL, NULL);
  assert_true(pid > 0);
  if (ts_wait_pid(pid, 10000, 1, &st) != 0 || !WIFEXITED(st)) {
    snprintf(out, len, "(gpupoold --check-config did not exit within 10 s)");
    return -1;
  }
  fd = open(d->log, O_RDONLY);
  assert_true(fd >= 0);
  n = read(fd, out, len - 1);
  close(fd);
  out[n > 0 ? n : 0] = '\0';
  return WEXITSTATUS(st);
}

/* A [tenant] or [group] with no member passes --check-config (it may be emptied on purpose)
 * but is warned about, with its line: it covers nobody. A section with members is not. */
static void test_check_config_warns_empty_sets(void **state) {
  th_daemon d;
  char out[4096];
  (void)state;
  th_prepare(&d);
  assert_int_equal(check_config(&d, "[tenant root]\nexport_peers = *\n[tenant ok]\nuids = 5\n[group g]\n"
                                    "[group fine]\ngids = 7\n[pool p]\nkind = host\ncapacity = 16M\nslab_size = 4M\nshare = g\n",
                                out, sizeof out), 0);
  if (!strstr(out, ":1: [tenant root] has no uids = or gids = line: it covers no user") ||
      !strstr(out, ":5: [group g] has no uids = or gids = line") || strstr(out, "[tenant ok]") ||
      strstr(out, "[group fine]"))
    fail_msg("--check-config said: '%s'", out);
  d.pid = 0;
  th_stop(&d);
}

/* --check-config reads the peers' secret files as the start does: a device, a directory, a
 * FIFO, a file others can read or a short one is refused with the start's reason; a good one
 * passes. */
static void test_check_config_checks_secret_files(void **state) {
#ifdef GPUPOOL_HAVE_UCX
  static const struct {
    const char *file, *needle;
  } bad[] = {
      {"/dev/zero", "the peer secret file /dev/zero is not a regular file"},
      {"DIR/secrets", "is not a regular file"},
      {"DIR/fifo", "is not a regular file"},
      {"DIR/open", "is readable by group or others (mode 0644)"},
      {"DIR/short", "holds 5 bytes, fewer than 16"},
  };
  th_daemon d;
  char out[4096], conf[1024], file[512], p[400];
  (void)state;
  th_prepare(&d);
  snprintf(p, sizeof p, "%s/secrets", d.dir);
  assert_int_equal(mkdir(p, 0700), 0);
  snprintf(p, sizeof p, "%s/fifo", d.dir);
  assert_int_equal(mkfifo(p, 0600), 0);
  snprintf(p, sizeof p, "%s/open", d.dir);
  th_write_file(p, 32, 0644, 1);
  snprintf(p, sizeof p, "%s/short", d.dir);
  th_write_file(p, 5, 0600, 1);
  snprintf(p, sizeof p, "%s/good", d.dir);
  th_write_file(p, 32, 0600, 1);
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    if (!strncmp(bad[i].file, "DIR/", 4))
      snprintf(file, sizeof file, "%s/%s", d.dir, bad[i].file + 4);
    else
      snprintf(file, sizeof file, "%s", bad[i].file);
    snprintf(conf, sizeof conf, "[daemon]\npeer_secret_file = %s\n[peer b]\naddress = 127.0.0.1:1\n", file);
    if (check_config(&d, conf, out, sizeof out) != 2 || !strstr(out, bad[i].needle))
      fail_msg("--check-config with peer_secret_file = %s: '%s' (expected status 2 and '%s')", file, out,
               bad[i].needle);
    /* A [peer]'s own secret_file too. */
    snprintf(conf, sizeof conf, "[daemon]\npeer_secret_file = %s/good\n[peer b]\naddress = 127.0.0.1:1\nsecret_file = %s\n",
             d.dir, file);
    if (check_config(&d, conf, out, sizeof out) != 2 || !strstr(out, bad[i].needle))
      fail_msg("--check-config with secret_file = %s: '%s' (expected status 2 and '%s')", file, out, bad[i].needle);
  }
  snprintf(conf, sizeof conf, "[daemon]\npeer_secret_file = %s/good\n[peer b]\naddress = 127.0.0.1:1\n", d.dir);
  if (check_config(&d, conf, out, sizeof out) != 0 || !strstr(out, "configuration OK"))
    fail_msg("--check-config with a good secret file: '%s'", out);
  /* The start refuses what --check-config refuses, and does not wait on a FIFO that nothing
   * writes to. */
  snprintf(conf, sizeof conf, "[daemon]\npeer_secret_file = %s/fifo\n[peer b]\naddress = 127.0.0.1:1\n"
           "[pool p]\nkind = host\ncapacity = 16M\nslab_size = 4M\n", d.dir);
  th_write_conf(&d, conf);
  expect_refused_promptly(&d, d.conf, "fifo is not a regular file");
  snprintf(p, sizeof p, "%s/secrets", d.dir);
  rmdir(p);
  d.pid = 0;
  th_stop(&d);
#else
  (void)state;
  printf("skipped: gpupoold built without UCX (no peers)\n");
#endif
}

int main(void) {
  return TS_RUN_TESTS(NULL, NULL, test_full_file, test_errors_name_line, test_pool_checks, test_sizes,
                      test_daemon_refuses_bad_config, test_duplicate_sections, test_config_not_a_file,
                      test_did_you_mean, test_pool_checks_name_line, test_peer_sections,
                      test_check_config_warns_empty_sets, test_check_config_checks_secret_files,
                      test_all_errors);
}
