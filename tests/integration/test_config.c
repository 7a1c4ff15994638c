/*
 * The config parser and pool checks: a full file, --pool specs, and errors that name the
 * file, the line and the fix. Also the daemon refusing a bad config at start-up.
 */
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

static void test_full_file(void **state) {
  gpupool__config c;
  (void)state;
  write_file("# comment\n[daemon]\nsocket = /tmp/x.sock\nbackend = host\nlog_level = debug\n"
             "socket_mode = 0600\nmax_clients = 10\nmax_bytes_per_uid = 2G\nallow_uids = 0, 1000\nbusy_poll_us = 250\n"
             "[pool a]\nkind = host\ncapacity = 128M\nslab_size = 3M\nkeep_slabs = 2\n"
             "[pool b]\ncapacity = 64M\n");
  gpupool__config_defaults(&c);
  assert_int_equal(gpupool__config_load(&c, path), 0);
  assert_string_equal(c.socket_path, "/tmp/x.sock");
  assert_ptr_equal(c.backend, &gpupool__backend_host);
  assert_int_equal(c.socket_mode, 0600);
  assert_int_equal(c.max_clients, 10);
  assert_int_equal(c.max_bytes_per_uid, 2ull << 30);
  assert_int_equal(c.n_allow_uids, 2);
  assert_int_equal(c.allow_uids[1], 1000);
  assert_int_equal(c.busy_poll_us, 250);
  assert_int_equal(c.n_pools, 2);
  assert_int_equal(gpupool__config_finish(&c, &gpupool__backend_host), 0);
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
  };
  (void)state;
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    gpupool__config c;
    strcpy(path, "/tmp/gpupool-conf-XXXXXX");
    write_file(cases[i].text);
    gpupool__config_defaults(&c);
    assert_int_equal(gpupool__config_load(&c, path), GPUPOOL_ECONFIG);
    if (!strstr(gpupool__errmsg(), cases[i].needle))
      fail_msg("case %zu: '%s' lacks '%s'", i, gpupool__errmsg(), cases[i].needle);
    assert_non_null(strstr(gpupool__errmsg(), path));
    unlink(path);
  }
}

static void test_pool_checks(void **state) {
  gpupool__config c;
  (void)state;
  gpupool__config_defaults(&c);
  assert_int_equal(gpupool__config_add_pool_spec(&c, "name=x,capacity=1G,slab=5G"), 0);
  assert_int_equal(gpupool__config_finish(&c, &gpupool__backend_host), GPUPOOL_ECONFIG);
  assert_non_null(strstr(gpupool__errmsg(), "4G"));
  gpupool__config_defaults(&c);
  assert_int_equal(gpupool__config_add_pool_spec(&c, "name=x,kind=device"), 0);
  assert_int_equal(gpupool__config_finish(&c, &gpupool__backend_host), GPUPOOL_ECONFIG);
  assert_non_null(strstr(gpupool__errmsg(), "host backend"));
  gpupool__config_defaults(&c);
  assert_int_equal(gpupool__config_add_pool_spec(&c, "name=x,align=48"), 0);
  assert_int_equal(gpupool__config_finish(&c, &gpupool__backend_host), GPUPOOL_ECONFIG);
  gpupool__config_defaults(&c);
  assert_int_equal(gpupool__config_add_pool_spec(&c, "nonsense"), GPUPOOL_ECONFIG);
  gpupool__config_defaults(&c);
  assert_int_equal(gpupool__config_finish(&c, &gpupool__backend_host), 0); /* a default host pool */
  assert_int_equal(c.n_pools, 1);
  assert_string_equal(c.pools[0].name, "default");
}

static void test_sizes(void **state) {
  uint64_t v;
  (void)state;
  assert_int_equal(gpupool__parse_size("4096", &v), 0);
  assert_int_equal(v, 4096);
  assert_int_equal(gpupool__parse_size("64M", &v), 0);
  assert_int_equal(v, 64u << 20);
  assert_int_equal(gpupool__parse_size("2GiB", &v), 0);
  assert_int_equal(v, 2ull << 30);
  assert_int_equal(gpupool__parse_size("-1", &v), GPUPOOL_EINVAL);
  assert_int_equal(gpupool__parse_size("99999999999T", &v), GPUPOOL_EINVAL);
}

static void test_daemon_refuses_bad_config(void **state) {
  th_daemon d;
  int st;
  pid_t pid;
  FILE *f;
  char line[512] = "";
  (void)state;
  th_prepare(&d);
  th_write_conf(&d, "[pool p]\ncapacity = lots\n");
  pid = fork();
  if (pid == 0) {
    int fd = open(d.log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, 2);
    execl(GPUPOOLD_PATH, GPUPOOLD_PATH, "--config", d.conf, "--socket", d.sock, NULL);
    _exit(127);
  }
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

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_full_file),      cmocka_unit_test(test_errors_name_line),
      cmocka_unit_test(test_pool_checks),    cmocka_unit_test(test_sizes),
      cmocka_unit_test(test_daemon_refuses_bad_config),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
