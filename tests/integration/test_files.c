/*
 * Read-only file objects (host backend): a file published by one process is mapped byte-exact
 * by others, ranges included; a process publishes only what it can read itself, and a name is
 * seen only in its tenant; bad input gets a clear error; a file that changes after publishing
 * is refused at get (never mapped past its end); the daemon's fds come back on every path.
 * Uid switches need root (CI runs as root); elsewhere those checks are skipped.
 */
#include <inttypes.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include "harness.h"

#define SEED 0xF11Eu
#define FILE_SIZE (3u * 1024 * 1024 + 123) /* not a multiple of the page size */

static th_daemon D;
static char path[400];

/* The test file: SEED's bytes (th_byte), so a range read back can be checked. */
static void write_file(const char *p, uint64_t size, mode_t mode) { th_write_file(p, size, mode, SEED); }

static int check_range(const void *p, uint64_t offset, uint64_t n) {
  for (uint64_t j = 0; j < n; j++)
    if (((const uint8_t *)p)[j] != th_byte(SEED, offset + j))
      return 0;
  return 1;
}

static void start_conf(const char *extra) {
  th_start_shared(&D, extra, TH_HOST_POOL("16M", "4M"));
  snprintf(path, sizeof path, "%s/data.bin", D.dir);
  write_file(path, FILE_SIZE, 0644);
}

static int teardown(void **state) {
  (void)state;
  unlink(path);
  th_stop(&D);
  return 0;
}

static int publisher_child(const th_daemon *d, int arg) {
  gpupool_client *c = NULL;
  gpupool_file_info fi;
  (void)arg;
  CHILD_CHECK(gpupool_client_connect(d->sock, "publisher", GPUPOOL_TIMEOUT_DEFAULT, &c) == 0, "connect");
  CHILD_CHECK(gpupool_file_publish(c, "data", path, 0, 0, &fi) == 0, "publish_file");
  CHILD_CHECK(fi.offset == 0 && fi.length == FILE_SIZE && fi.size == FILE_SIZE, "info");
  CHILD_CHECK(gpupool_file_publish(c, "range", path, 4097, 100000, NULL) == 0, "publish a range");
  gpupool_client_disconnect(c);
  return 0;
}

static int consumer_child(const th_daemon *d, int arg) {
  gpupool_client *c = NULL;
  gpupool_file *f = NULL, *r = NULL;
  gpupool_file_info fi;
  (void)arg;
  CHILD_CHECK(gpupool_client_connect(d->sock, "consumer", GPUPOOL_TIMEOUT_DEFAULT, &c) == 0, "connect");
  CHILD_CHECK(gpupool_file_get(c, "data", 5000, 0, &f) == 0, "get_file");
  CHILD_CHECK(gpupool_file_size(f) == FILE_SIZE, "size %zu", gpupool_file_size(f));
  CHILD_CHECK(gpupool_file_device_ptr(f) == NULL, "no device pointer on the host backend");
  CHILD_CHECK(check_range(gpupool_file_ptr(f), 0, FILE_SIZE), "bytes differ");
  CHILD_CHECK(gpupool_file_get(c, "range", 5000, 0, &r) == 0, "get_file range");
  CHILD_CHECK(gpupool_file_size(r) == 100000, "range size %zu", gpupool_file_size(r));
  CHILD_CHECK(check_range(gpupool_file_ptr(r), 4097, 100000), "range bytes differ");
  CHILD_CHECK(gpupool_file_info_get(r, &fi) == 0 && fi.offset == 4097 && fi.size == FILE_SIZE, "range info");
  gpupool_client_disconnect(c);
  /* Mappings do not depend on the connection. */
  CHILD_CHECK(check_range(gpupool_file_ptr(f), 0, FILE_SIZE), "bytes differ after disconnect");
  gpupool_file_release(f);
  gpupool_file_release(r);
  return 0;
}

/* Published in one process, mapped in another (waiting for it), byte for byte; the name
 * outlives its publisher; every fd comes back once unpublished. */
static void test_round_trip(void **state) {
  gpupool_client *c;
  uint64_t base;
  pid_t cons;
  (void)state;
  start_conf(NULL);
  base = th_settled_fds(&D);
  cons = th_spawn(&D, consumer_child, 0); /* waits for the name */
  th_sleep_ms(100);
  th_wait_ok(th_spawn(&D, publisher_child, 0), "publisher");
  th_wait_ok(cons, "consumer");
  th_wait_ok(th_spawn(&D, consumer_child, 0), "second consumer");
  c = th_connect(&D, "cleanup");
  assert_int_equal(gpupool_name_unpublish(c, "data"), 0);
  assert_int_equal(gpupool_name_unpublish(c, "range"), 0);
  {
    gpupool_file *f;
    assert_int_equal(gpupool_file_get(c, "data", 0, 0, &f), GPUPOOL_ENOENT);
  }
  gpupool_client_disconnect(c);
  th_expect_fds(&D, base);
}

/* Linux file names may hold any bytes: a file whose name is not UTF-8 is published and read
 * back (the path the client sends along for messages has '?' for those bytes, since every
 * string on the wire must be UTF-8). */
static void test_non_utf8_path(void **state) {
  char odd[450];
  gpupool_client *c;
  gpupool_file *f = NULL;
  (void)state;
  start_conf(NULL);
  snprintf(odd, sizeof odd, "%s/caf\xe9-\xff.bin", D.dir);
  write_file(odd, 70000, 0644);
  c = th_connect(&D, "odd");
  assert_int_equal(gpupool_file_publish(c, "odd", odd, 0, 0, NULL), 0);
  assert_int_equal(gpupool_file_get(c, "odd", 0, 0, &f), 0);
  assert_int_equal(gpupool_file_size(f), 70000);
  assert_true(check_range(gpupool_file_ptr(f), 0, 70000));
  gpupool_file_release(f);
  assert_int_equal(gpupool_name_unpublish(c, "odd"), 0);
  gpupool_client_disconnect(c);
  unlink(odd);
}

/* Missing, directory, empty, past the end, overflowing, existing names, the wrong kind of name:
 * each refused with what is wrong, and no fd left behind. */
static void test_bad_input(void **state) {
  gpupool_client *c;
  gpupool_buffer *b, *g;
  gpupool_file *f;
  char missing[450], empty[450];
  uint64_t base;
  (void)state;
  start_conf(NULL);
  base = th_settled_fds(&D);
  c = th_connect(&D, "bad");
  snprintf(missing, sizeof missing, "%s/missing.bin", D.dir);
  assert_int_equal(gpupool_file_publish(c, "m", missing, 0, 0, NULL), GPUPOOL_ENOENT);
  assert_non_null(strstr(gpupool_last_error(), "missing.bin"));
  assert_int_equal(gpupool_file_publish(c, "d", D.dir, 0, 0, NULL), GPUPOOL_EINVAL);
  assert_non_null(strstr(gpupool_last_error(), "directory"));
  assert_int_equal(gpupool_file_publish(c, "dev", "/dev/null", 0, 0, NULL), GPUPOOL_EINVAL);
  snprintf(empty, sizeof empty, "%s/empty.bin", D.dir);
  write_file(empty, 0, 0644);
  assert_int_equal(gpupool_file_publish(c, "e", empty, 0, 0, NULL), GPUPOOL_EINVAL);
  assert_non_null(strstr(gpupool_last_error(), "empty"));
  unlink(empty);
  /* Past the end: the message names the range and the file's size. */
  assert_int_equal(gpupool_file_publish(c, "p", path, FILE_SIZE - 10, 11, NULL), GPUPOOL_EINVAL);
  printf("past the end: %s\n", gpupool_last_error());
  assert_non_null(strstr(gpupool_last_error(), "past the end"));
  assert_non_null(strstr(gpupool_last_error(), "3145851 bytes")); /* FILE_SIZE */
  assert_int_equal(gpupool_file_publish(c, "p", path, FILE_SIZE + 1, 0, NULL), GPUPOOL_EINVAL);
  assert_non_null(strstr(gpupool_last_error(), "past the end"));
  assert_int_equal(gpupool_file_publish(c, "o", path, UINT64_MAX - 10, 100, NULL), GPUPOOL_EINVAL);
  assert_non_null(strstr(gpupool_last_error(), "overflows"));
  assert_int_equal(gpupool_file_publish(c, "", path, 0, 0, NULL), GPUPOOL_ENAME);
  /* A range that ends exactly at the end is fine; the same name again is not. */
  assert_int_equal(gpupool_file_publish(c, "f", path, FILE_SIZE - 10, 10, NULL), 0);
  assert_int_equal(gpupool_file_publish(c, "f", path, 0, 0, NULL), GPUPOOL_EEXIST);
  /* Buffers and files share names. */
  assert_int_equal(gpupool_buffer_alloc(c, NULL, 4096, 0, NULL, &b), 0);
  assert_int_equal(gpupool_buffer_publish(b, "f", NULL, NULL, NULL), GPUPOOL_EEXIST);
  assert_int_equal(gpupool_buffer_publish(b, "buf", NULL, NULL, NULL), 0);
  assert_int_equal(gpupool_file_publish(c, "buf", path, 0, 0, NULL), GPUPOOL_EEXIST);
  assert_int_equal(gpupool_file_get(c, "buf", 0, 0, &f), GPUPOOL_EINVAL);
  assert_non_null(strstr(gpupool_last_error(), "names a buffer"));
  assert_int_equal(gpupool_buffer_get(c, "f", 0, 0, 0, NULL, &g, NULL), GPUPOOL_EINVAL);
  assert_non_null(strstr(gpupool_last_error(), "gpupool_file_get"));
  assert_int_equal(gpupool_file_get(c, "f", 0, 0, &f), 0);
  assert_true(check_range(gpupool_file_ptr(f), FILE_SIZE - 10, 10));
  gpupool_file_release(f);
  assert_int_equal(gpupool_name_unpublish(c, "f"), 0);
  assert_int_equal(gpupool_name_unpublish(c, "buf"), 0);
  assert_int_equal(gpupool_buffer_release(b, NULL), 0);
  gpupool_client_disconnect(c);
  th_expect_fds(&D, base);
}

/* A file that shrinks (or is rewritten) after publishing: the get says so, nothing faults. */
static void shrink_case(int leases) {
  gpupool_client *c;
  gpupool_file *f, *before;
  (void)leases;
  c = th_connect(&D, "shrink");
  assert_int_equal(gpupool_file_publish(c, "s", path, 8192, 1 << 20, NULL), 0);
  /* Mapped before the change: this mapping keeps the pages it reads below the cut. */
  assert_int_equal(gpupool_file_get(c, "s", 0, 0, &before), 0);
  assert_int_equal(truncate(path, 4096), 0);
  assert_int_equal(gpupool_file_get(c, "s", 0, 0, &f), GPUPOOL_ESTALE);
  printf("after truncation: %s\n", gpupool_last_error());
  assert_non_null(strstr(gpupool_last_error(), leases ? "truncated" : "shorter than the published range"));
  gpupool_file_release(before);
  /* Grown back to the old size: still refused (the contents are not what was published). */
  write_file(path, FILE_SIZE, 0644);
  assert_int_equal(gpupool_file_get(c, "s", 0, 0, &f), GPUPOOL_ESTALE);
  assert_int_equal(gpupool_name_unpublish(c, "s"), 0);
  /* Published again, it serves the new file. */
  assert_int_equal(gpupool_file_publish(c, "s", path, 8192, 1 << 20, NULL), 0);
  assert_int_equal(gpupool_file_get(c, "s", 0, 0, &f), 0);
  assert_true(check_range(gpupool_file_ptr(f), 8192, 1 << 20));
  gpupool_file_release(f);
  assert_int_equal(gpupool_name_unpublish(c, "s"), 0);
  gpupool_client_disconnect(c);
}

static void test_shrink_checked_at_get(void **state) {
  (void)state;
  start_conf("file_leases = no");
  shrink_case(0);
}

/* With a lease (the daemon runs as root here, or owns the file): the daemon hears of the
 * truncation, and of an open for writing, at once. */
static void test_shrink_with_lease(void **state) {
  gpupool_client *c;
  gpupool_file *f;
  int fd;
  (void)state;
  start_conf(NULL);
  shrink_case(1);
  c = th_connect(&D, "writer");
  assert_int_equal(gpupool_file_publish(c, "w", path, 0, 0, NULL), 0);
  /* Opening it for writing breaks the lease: the open waits until the daemon let go. */
  fd = open(path, O_WRONLY | O_CLOEXEC);
  assert_true(fd >= 0);
  close(fd);
  th_sleep_ms(50);
  assert_int_equal(gpupool_file_get(c, "w", 0, 0, &f), GPUPOOL_ESTALE);
  assert_non_null(strstr(gpupool_last_error(), "opened for writing"));
  gpupool_client_disconnect(c);
}

static int nobody_publish_child(const th_daemon *d, int arg) {
  gpupool_client *c = NULL;
  gpupool_file *f = NULL;
  char secret[450];
  (void)arg;
  snprintf(secret, sizeof secret, "%s/secret.bin", d->dir);
  CHILD_CHECK(th_become(NOBODY) == 0, "setuid");
  CHILD_CHECK(gpupool_client_connect(d->sock, "nobody", GPUPOOL_TIMEOUT_DEFAULT, &c) == 0, "connect");
  /* It cannot read the file, so it cannot publish it: the daemon (root) never opens it for it. */
  CHILD_CHECK(gpupool_file_publish(c, "stolen", secret, 0, 0, NULL) == GPUPOOL_EPERM, "publish of an unreadable file");
  CHILD_CHECK(strstr(gpupool_last_error(), "Permission denied") != NULL, "message: %s", gpupool_last_error());
  /* Root's name is in root's namespace: not visible here. */
  CHILD_CHECK(gpupool_file_get(c, "rootfile", 0, 0, &f) == GPUPOOL_ENOENT, "get of another tenant's file");
  /* A file it can read is fine, in its own namespace. */
  CHILD_CHECK(gpupool_file_publish(c, "rootfile", path, 0, 4096, NULL) == 0, "publish a readable file");
  CHILD_CHECK(gpupool_file_get(c, "rootfile", 0, 0, &f) == 0, "get its own");
  CHILD_CHECK(check_range(gpupool_file_ptr(f), 0, 4096), "bytes");
  gpupool_file_release(f);
  CHILD_CHECK(gpupool_name_unpublish(c, "rootfile") == 0, "unpublish");
  gpupool_client_disconnect(c);
  return 0;
}

static void test_permissions(void **state) {
  gpupool_client *c;
  gpupool_file *f;
  char secret[450];
  uint64_t base;
  (void)state;
  if (!th_need_root("to run a client as another uid"))
    return;
  start_conf(NULL);
  base = th_settled_fds(&D);
  snprintf(secret, sizeof secret, "%s/secret.bin", D.dir);
  write_file(secret, 8192, 0600);
  c = th_connect(&D, "root");
  assert_int_equal(gpupool_file_publish(c, "rootfile", secret, 0, 0, NULL), 0);
  th_wait_ok(th_spawn(&D, nobody_publish_child, 0), "nobody");
  /* Root's own name was untouched by nobody's publish under the same plain name. */
  assert_int_equal(gpupool_file_get(c, "rootfile", 0, 0, &f), 0);
  assert_int_equal(gpupool_file_size(f), 8192);
  gpupool_file_release(f);
  assert_int_equal(gpupool_name_unpublish(c, "rootfile"), 0);
  gpupool_client_disconnect(c);
  unlink(secret);
  th_expect_fds(&D, base);
}

/* The operator's switches: no files at all, or only under some paths (on the resolved path,
 * so a symlink from an allowed place to elsewhere does not pass). */
static void test_config_restrictions(void **state) {
  gpupool_client *c;
  char conf[700], inside[300], link[450];
  (void)state;
  start_conf("allow_files = no");
  c = th_connect(&D, "off");
  assert_int_equal(gpupool_file_publish(c, "x", path, 0, 0, NULL), GPUPOOL_EPERM);
  assert_non_null(strstr(gpupool_last_error(), "allow_files"));
  gpupool_client_disconnect(c);
  teardown(NULL);

  th_prepare_shared(&D);
  snprintf(inside, sizeof inside, "%s/allowed", D.dir);
  assert_int_equal(mkdir(inside, 0755), 0);
  snprintf(conf, sizeof conf, "[daemon]\nfile_paths = %s\n[pool default]\nkind = host\ncapacity = 16M\nslab_size = 4M\n", inside);
  th_write_conf(&D, conf);
  th_start(&D, 1, NULL);
  snprintf(path, sizeof path, "%s/data.bin", D.dir);
  write_file(path, FILE_SIZE, 0644);
  c = th_connect(&D, "paths");
  assert_int_equal(gpupool_file_publish(c, "x", path, 0, 0, NULL), GPUPOOL_EPERM);
  assert_non_null(strstr(gpupool_last_error(), "file_paths"));
  snprintf(link, sizeof link, "%s/link.bin", inside);
  assert_int_equal(symlink(path, link), 0);
  assert_int_equal(gpupool_file_publish(c, "x", link, 0, 0, NULL), GPUPOOL_EPERM);
  unlink(link);
  snprintf(link, sizeof link, "%s/real.bin", inside);
  write_file(link, 5000, 0644);
  assert_int_equal(gpupool_file_publish(c, "x", link, 0, 0, NULL), 0);
  assert_int_equal(gpupool_name_unpublish(c, "x"), 0);
  gpupool_client_disconnect(c);
  unlink(link);
  rmdir(inside);
}

/* File names count against the name limits, and the daemon's open files against max_files. */
static void test_limits(void **state) {
  gpupool_client *c;
  gpupool_buffer *b;
  uint64_t base;
  (void)state;
  start_conf("max_files = 2\nmax_names_per_uid = 3");
  base = th_settled_fds(&D);
  c = th_connect(&D, "limits");
  assert_int_equal(gpupool_file_publish(c, "a", path, 0, 0, NULL), 0);
  assert_int_equal(gpupool_file_publish(c, "b", path, 0, 0, NULL), 0);
  assert_int_equal(gpupool_file_publish(c, "c", path, 0, 0, NULL), GPUPOOL_ELIMIT);
  assert_non_null(strstr(gpupool_last_error(), "max_files"));
  assert_int_equal(gpupool_buffer_alloc(c, NULL, 4096, 0, NULL, &b), 0);
  assert_int_equal(gpupool_buffer_publish(b, "buf", NULL, NULL, NULL), 0);
  assert_int_equal(gpupool_name_unpublish(c, "a"), 0);
  assert_int_equal(gpupool_file_publish(c, "c", path, 0, 0, NULL), 0);
  assert_int_equal(gpupool_name_unpublish(c, "b"), 0);
  /* Three names (one buffer, two files... one file now plus "c"): the tenant's limit. */
  assert_int_equal(gpupool_file_publish(c, "d", path, 0, 0, NULL), 0);
  assert_int_equal(gpupool_file_publish(c, "e", path, 0, 0, NULL), GPUPOOL_ELIMIT);
  assert_non_null(strstr(gpupool_last_error(), "max_names_per_uid"));
  assert_int_equal(gpupool_name_unpublish(c, "c"), 0);
  assert_int_equal(gpupool_name_unpublish(c, "d"), 0);
  assert_int_equal(gpupool_name_unpublish(c, "buf"), 0);
  assert_int_equal(gpupool_buffer_release(b, NULL), 0);
  gpupool_client_disconnect(c);
  th_expect_fds(&D, base);
}

/* Many publishes and gets from a client that then vanishes: the daemon keeps one fd per name
 * and nothing else. */
static void test_fds_bounded(void **state) {
  gpupool_client *c;
  gpupool_file *f;
  uint64_t base;
  char name[32];
  (void)state;
  start_conf(NULL);
  base = th_settled_fds(&D);
  c = th_connect(&D, "fds");
  for (int i = 0; i < 20; i++) {
    snprintf(name, sizeof name, "f%d", i);
    assert_int_equal(gpupool_file_publish(c, name, path, (uint64_t)i * 100, 1000, NULL), 0);
    assert_int_equal(gpupool_file_get(c, name, 0, 0, &f), 0);
    assert_true(check_range(gpupool_file_ptr(f), (uint64_t)i * 100, 1000));
    gpupool_file_release(f);
    assert_int_equal(gpupool_file_publish(c, name, path, 0, 0, NULL), GPUPOOL_EEXIST);
  }
  gpupool_client_disconnect(c);
  /* Names outlive their publisher: 20 fds, until unpublished. */
  th_expect_fds(&D, base + 20);
  c = th_connect(&D, "fds2");
  for (int i = 0; i < 20; i++) {
    snprintf(name, sizeof name, "f%d", i);
    assert_int_equal(gpupool_name_unpublish(c, name), 0);
  }
  gpupool_client_disconnect(c);
  th_expect_fds(&D, base);
}

int main(void) {
  return TS_RUN_TESTS(NULL, teardown, test_round_trip, test_non_utf8_path, test_bad_input, test_shrink_checked_at_get,
                      test_shrink_with_lease, test_permissions, test_config_restrictions, test_limits,
                      test_fds_bounded);
}
