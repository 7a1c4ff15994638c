/*
 * The installed configuration file (config/gpupoold.conf) against the daemon's own parser:
 * it loads as shipped and agrees with the socket unit's path; with every commented-out key
 * and example section switched on it still loads and passes the final checks (so no key in
 * it is misspelt or out of range); and the commented-out [daemon] keys that claim to show a
 * default do show the parser's default.
 *
 * And the example against the config table (gpd_config_keys): every key of the table
 * has a line in the example, with the table's default where the table has one; the example
 * names no key the table lacks; and the table's defaults are what the parser starts from.
 *
 * Also the README's "essentials" block, inline comments and all, as a user would copy it.
 *
 * Usage: test_conf_example PATH_TO_gpupoold.conf PATH_TO_README.md
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "config.h"
#include "errors.h"

static const char *conf_path, *readme_path;
static char uncommented[64];

/* "#key = value" and "#[pool NAME]" lines lose their '#'; prose comments ("# ...") stay. */
static int write_uncommented(int daemon_only) {
  FILE *in = fopen(conf_path, "re"), *out;
  char line[1024];
  int fd, in_daemon = 0;

  snprintf(uncommented, sizeof(uncommented), "/tmp/gpupool-conf-XXXXXX");
  fd = mkstemp(uncommented);
  if (in == NULL || fd < 0)
    return -1;
  out = fdopen(fd, "w");
  while (fgets(line, sizeof(line), in)) {
    const char *l = line;
    if (strncmp(line, "[daemon]", 8) == 0)
      in_daemon = 1;
    else if (line[0] == '[' || strncmp(line, "#[", 2) == 0)
      in_daemon = 0;
    if (line[0] == '#' && (line[1] == '[' || (line[1] >= 'a' && line[1] <= 'z'))) {
      if (daemon_only && !in_daemon)
        continue;
      l = line + 1;
    }
    if (daemon_only && !in_daemon && line[0] == '[')
      break;
    fputs(l, out);
  }
  fclose(in);
  return fclose(out) == 0 ? 0 : -1;
}

static void test_as_shipped(void **state) {
  gpd_config c;
  (void)state;
  gpd_config_defaults(&c);
  if (gpd_config_load(&c, conf_path) != 0)
    fail_msg("%s", gpupool__errmsg());
  /* Same path as ListenStream= in gpupoold.socket and the clients' default for root. */
  assert_string_equal(c.socket_path, "/run/gpupool/gpupoold.sock");
  assert_string_equal(c.metrics_socket, "/run/gpupool/metrics.sock");
  assert_int_equal(c.n_pools, 0); /* the pools are examples */
}

static void test_everything_on(void **state) {
  gpd_config c;
  (void)state;
  assert_int_equal(write_uncommented(0), 0);
  gpd_config_defaults(&c);
  if (gpd_config_load(&c, uncommented) != 0)
    fail_msg("with every key switched on: %s", gpupool__errmsg());
  assert_int_equal(c.n_pools, 3);
  assert_int_equal(c.n_tenants, 1);
  assert_int_equal(c.tenants[0].n_uids, 2);
  assert_int_equal(c.n_groups, 1);
  assert_string_equal(c.pool_share_name[2], "ml");
  assert_string_equal(c.pools[0].name, "gpu0");
  assert_int_equal(c.pools[0].capacity, 16ull << 30);
  assert_int_equal(c.pools[1].kind, GPUPOOL_MEM_HOST_NUMA);
  assert_int_equal(c.n_allow_uids, 2);
  assert_string_equal(c.metrics_textfile, "/var/lib/prometheus/node-exporter/gpupool.prom");
  /* The example pools are cuda pools and must pass the daemon's checks. */
  if (gpd_config_finish(&c, &gpupool__backend_cuda) != 0)
    fail_msg("example pools refused: %s", gpupool__errmsg());
  unlink(uncommented);
}

static void test_documented_defaults(void **state) {
  gpd_config d, c;
  (void)state;
  assert_int_equal(write_uncommented(1), 0);
  gpd_config_defaults(&d);
  gpd_config_defaults(&c);
  if (gpd_config_load(&c, uncommented) != 0)
    fail_msg("%s", gpupool__errmsg());
  unlink(uncommented);
  assert_int_equal(c.backend, d.backend);
  assert_int_equal(c.log_level, d.log_level);
  assert_int_equal(c.socket_mode, d.socket_mode);
  assert_int_equal(c.max_clients, d.max_clients);
  assert_int_equal(c.max_bytes_per_client, d.max_bytes_per_client);
  assert_int_equal(c.max_allocs_per_client, d.max_allocs_per_client);
  assert_int_equal(c.max_bytes_per_uid, d.max_bytes_per_uid);
  assert_int_equal(c.max_allocs_per_uid, d.max_allocs_per_uid);
  assert_int_equal(c.max_frame, d.max_frame);
  assert_int_equal(c.max_names, d.max_names);
  assert_int_equal(c.max_names_per_uid, d.max_names_per_uid);
  assert_int_equal(c.max_files, d.max_files);
  assert_int_equal(c.max_files_per_uid, d.max_files_per_uid);
  assert_int_equal(c.max_holds_per_client, d.max_holds_per_client);
  assert_int_equal(c.max_holds_per_uid, d.max_holds_per_uid);
  assert_int_equal(c.max_clients_per_uid, d.max_clients_per_uid);
  assert_int_equal(c.reserved_clients, d.reserved_clients);
  assert_int_equal(c.max_waiters_per_client, d.max_waiters_per_client);
  assert_int_equal(c.max_waiters_per_uid, d.max_waiters_per_uid);
  assert_int_equal(c.max_queued_bytes_per_client, d.max_queued_bytes_per_client);
  assert_int_equal(c.max_queued_bytes_total, d.max_queued_bytes_total);
  assert_int_equal(c.max_waiting_leases_per_uid, d.max_waiting_leases_per_uid);
  assert_int_equal(c.handshake_timeout_ms, d.handshake_timeout_ms);
  assert_int_equal(c.metrics_interval_ms, d.metrics_interval_ms);
}

/* A "key = value" or "#key = value" line of the example, and the section it is in. */
typedef struct {
  unsigned section;
  char key[64], value[256];
  int line;
} example_line;

static int read_example(example_line *out, int max) {
  FILE *in = fopen(conf_path, "re");
  char line[1024];
  unsigned section = 0;
  int n = 0, lineno = 0;
  assert_non_null(in);
  while (fgets(line, sizeof line, in)) {
    char *l = line, *eq, *e;
    size_t kl;
    lineno++;
    if (*l == '#' && (l[1] == '[' || (l[1] >= 'a' && l[1] <= 'z')))
      l++;
    if (*l == '[') {
      section = !strncmp(l, "[daemon]", 8)   ? GPUPOOL__CS_DAEMON
                : !strncmp(l, "[pool ", 6)   ? GPUPOOL__CS_POOL
                : !strncmp(l, "[tenant ", 8) ? GPUPOOL__CS_TENANT
                : !strncmp(l, "[group ", 7)  ? GPUPOOL__CS_GROUP
                : !strncmp(l, "[peer ", 6)   ? GPUPOOL__CS_PEER
                                             : 0;
      if (!section)
        fail_msg("gpupoold.conf:%d: a section the test does not know: %s", lineno, l);
      continue;
    }
    kl = strspn(l, "abcdefghijklmnopqrstuvwxyz_");
    eq = l + kl + strspn(l + kl, " \t");
    if (kl == 0 || *eq != '=' || l != line + (line[0] == '#'))
      continue; /* prose */
    assert_true(n < max);
    out[n].section = section;
    out[n].line = lineno;
    snprintf(out[n].key, sizeof out[n].key, "%.*s", (int)kl, l);
    eq++;
    eq += strspn(eq, " \t");
    for (e = eq; *e && *e != '\n' && !(*e == '#' && (e == eq || e[-1] == ' ')); e++)
      ;
    while (e > eq && (e[-1] == ' ' || e[-1] == '\t'))
      e--;
    snprintf(out[n].value, sizeof out[n].value, "%.*s", (int)(e - eq), eq);
    n++;
  }
  fclose(in);
  return n;
}

/* What the parser starts from for the struct a row's section names. */
static void *fresh(const gpd_config_key *k, gpd_config *c, gpupool__pool_config *p,
                   gpd_member_set *m) {
  gpd_config_defaults(c);
  gpupool__pool_config_init(p);
  memset(m, 0, sizeof *m);
  return k->sections & GPUPOOL__CS_DAEMON ? (void *)c : k->sections & GPUPOOL__CS_POOL ? (void *)p : (void *)m;
}

static void test_example_matches_table(void **state) {
  static example_line lines[256];
  static gpd_config c0, c1;
  gpupool__pool_config p0, p1;
  gpd_member_set m0, m1;
  int n = read_example(lines, 256);
  (void)state;
  assert_true(n > 40);
  for (int i = 0; i < n; i++) {
    const gpd_config_key *k = gpd_config_key_find(lines[i].section, lines[i].key);
    if (!k || strcmp(k->name, lines[i].key))
      fail_msg("gpupoold.conf:%d: '%s' is not a key of its section in the config table "
               "(gpd_config_keys in daemon/service/config.c)", lines[i].line, lines[i].key);
  }
  for (size_t r = 0; r < gpd_n_config_keys; r++) {
    const gpd_config_key *k = &gpd_config_keys[r];
    const example_line *at = NULL;
    void *start, *set;
    if (k->flags & GPUPOOL__CF_CMDLINE)
      continue;
    for (int i = 0; i < n && !at; i++)
      if ((lines[i].section & k->sections) && !strcmp(lines[i].key, k->name))
        at = &lines[i];
    if (!at)
      fail_msg("config key '%s' has no line in gpupoold.conf", k->name);
    if (!k->def)
      continue;
    /* The table's default is what the parser starts from... */
    start = fresh(k, &c0, &p0, &m0);
    set = fresh(k, &c1, &p1, &m1);
    if (gpd_config_key_set(set, k, k->def) != 0)
      fail_msg("config key '%s': the table's default '%s' does not parse: %s", k->name, k->def, gpupool__errmsg());
    if (memcmp((char *)start + k->off, (char *)set + k->off, k->size))
      fail_msg("config key '%s': the table's default '%s' is not the value the parser starts from", k->name, k->def);
    /* ...and the example shows it. */
    set = fresh(k, &c1, &p1, &m1);
    if (gpd_config_key_set(set, k, at->value) != 0)
      fail_msg("gpupoold.conf:%d: %s = %s does not parse: %s", at->line, k->name, at->value, gpupool__errmsg());
    if (memcmp((char *)start + k->off, (char *)set + k->off, k->size))
      fail_msg("gpupoold.conf:%d: %s = %s, but its default is %s", at->line, k->name, at->value, k->def);
  }
}

/* The first ```ini block of the README, written to a file as it stands. */
static void test_readme_essentials(void **state) {
  FILE *in = fopen(readme_path, "re"), *out;
  char line[1024], path[] = "/tmp/gpupool-readme-XXXXXX";
  int fd = mkstemp(path), in_block = 0, lines = 0;
  gpd_config c;
  (void)state;
  assert_non_null(in);
  assert_true(fd >= 0);
  out = fdopen(fd, "w");
  while (fgets(line, sizeof line, in)) {
    if (!in_block && strncmp(line, "```ini", 6) == 0) {
      in_block = 1;
      continue;
    }
    if (in_block && strncmp(line, "```", 3) == 0)
      break;
    if (in_block) {
      fputs(line, out);
      lines++;
    }
  }
  fclose(in);
  fclose(out);
  assert_true(lines > 5);
  gpd_config_defaults(&c);
  if (gpd_config_load(&c, path) != 0)
    fail_msg("the README's config block does not load: %s", gpupool__errmsg());
  unlink(path);
  assert_null(c.backend); /* "auto   # auto | cuda | host" is auto */
  assert_int_equal(c.max_clients, 1024);
  assert_int_equal(c.n_pools, 1);
  assert_int_equal(c.pools[0].kind, GPUPOOL_MEM_DEVICE);
  assert_int_equal(c.pools[0].capacity, 16ull << 30);
  assert_int_equal(c.pools[0].slab_size, 256ull << 20);
  assert_int_equal(c.pools[0].keep_slabs, 1);
}

/* Inline comments after values and section headers; '#' inside a value stays. */
static void test_inline_comments(void **state) {
  char path[] = "/tmp/gpupool-inline-XXXXXX";
  const char *text = "[daemon]   # the daemon\nsocket = /tmp/a#b.sock # not part of it\n"
                     "log_level = debug\t# tab before\n; old style\n[pool p] # a pool\n"
                     "capacity = 64M # sixty-four\n";
  int fd = mkstemp(path);
  gpd_config c;
  (void)state;
  assert_true(fd >= 0);
  assert_int_equal(write(fd, text, strlen(text)), (ssize_t)strlen(text));
  close(fd);
  gpd_config_defaults(&c);
  if (gpd_config_load(&c, path) != 0)
    fail_msg("%s", gpupool__errmsg());
  unlink(path);
  assert_string_equal(c.socket_path, "/tmp/a#b.sock");
  assert_int_equal(c.log_level, 7);
  assert_int_equal(c.n_pools, 1);
  assert_int_equal(c.pools[0].capacity, 64ull << 20);
}

int main(int argc, char **argv) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_readme_essentials),
      cmocka_unit_test(test_inline_comments),
      cmocka_unit_test(test_as_shipped),
      cmocka_unit_test(test_everything_on),
      cmocka_unit_test(test_documented_defaults),
      cmocka_unit_test(test_example_matches_table),
  };
  if (argc != 3) {
    fprintf(stderr, "usage: test_conf_example PATH_TO_gpupoold.conf PATH_TO_README.md\n");
    return 2;
  }
  conf_path = argv[1];
  readme_path = argv[2];
  return cmocka_run_group_tests(tests, NULL, NULL);
}
