/*
 * Users reach only the memory they were given (host backend). Attacks run from another uid
 * (nobody, when the tests run as root, as CI does): map every memfd the process holds and look
 * for another user's bytes; write through a read-only hold; turn a read-only share token into
 * a writable hold; read what another user freed. Also: a pool's capacity is not lost to where
 * slabs happen to lie, and an out-of-space error says what would succeed.
 */
#include <dirent.h>
#include <grp.h>
#include <inttypes.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include "harness.h"

#define MIB (1u << 20)
#define SEED 0xC0FFEEu

static th_daemon D;

static void start_with(const char *pool_line) {
  char sections[1024];
  /* Root and nobody share only what is in pool "shared", through group "readers". */
  snprintf(sections, sizeof sections,
           "[group readers]\nuids = 0, %d\n"
           "[pool default]\nkind = host\n%s\n"
           "[pool shared]\nkind = host\ncapacity = 16M\nslab_size = 4M\nshare = readers\n", NOBODY, pool_line);
  th_start_shared(&D, NULL, sections);
}

static pid_t owner_pid; /* a helper process a failed test may leave waiting */

static int teardown(void **state) {
  (void)state;
  if (owner_pid > 0) {
    kill(owner_pid, SIGKILL);
    waitpid(owner_pid, NULL, 0);
    owner_pid = 0;
  }
  th_stop(&D);
  return 0;
}

/* Map every memfd this process holds, whole, and look for the secret pattern: 1 if found. */
static int any_memfd_holds_secret(void) {
  uint8_t secret[64];
  DIR *d = opendir("/proc/self/fd");
  struct dirent *e;
  int found = 0, scanned = 0;
  for (uint64_t j = 0; j < sizeof secret; j++)
    secret[j] = th_byte(SEED, j);
  if (!d)
    return -1;
  while ((e = readdir(d))) {
    char link[64], target[256];
    struct stat st;
    ssize_t n;
    int fd = atoi(e->d_name);
    uint8_t *m;
    if (e->d_name[0] == '.')
      continue;
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    n = readlink(link, target, sizeof target - 1);
    if (n <= 0)
      continue;
    target[n] = '\0';
    if (strncmp(target, "/memfd:", 7) != 0 || fstat(fd, &st) != 0 || st.st_size == 0)
      continue;
    m = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED)
      continue;
    scanned++;
    if (memmem(m, (size_t)st.st_size, secret, sizeof secret))
      found = 1;
    munmap(m, (size_t)st.st_size);
  }
  closedir(d);
  /* And every gpupool mapping the process has. */
  {
    FILE *f = fopen("/proc/self/maps", "r");
    char line[512];
    while (f && fgets(line, sizeof line, f)) {
      unsigned long lo, hi;
      char perms[8];
      if (!strstr(line, "memfd:gpupool") || sscanf(line, "%lx-%lx %7s", &lo, &hi, perms) != 3 || perms[0] != 'r')
        continue;
      scanned++;
      if (memmem((void *)lo, hi - lo, secret, sizeof secret))
        found = 1;
    }
    if (f)
      fclose(f);
  }
  printf("scanned %d memfd(s) and mappings: %s\n", scanned,
         found ? "found the other user's bytes" : "nothing of the other user");
  return found;
}

static int snoop_child(const th_daemon *d, int arg) {
  gpupool_client *c = NULL;
  gpupool_buffer *b;
  (void)arg;
  CHILD_CHECK(th_become(NOBODY) == 0, "setuid");
  CHILD_CHECK(gpupool_client_connect(d->sock, "snoop", GPUPOOL_TIMEOUT_DEFAULT, &c) == 0, "connect");
  CHILD_CHECK(gpupool_buffer_alloc(c, NULL, 4096, 0, NULL, &b) == 0, "alloc");
  CHILD_CHECK(any_memfd_holds_secret() == 0, "another user's unshared buffer is reachable");
  gpupool_buffer_release(b, NULL);
  gpupool_client_disconnect(c);
  return 0;
}

/* Root's client, in a process of its own (a forked child would inherit its mappings): holds
 * an unshared buffer with the secret pattern until told to let go. */
static int owner_child(const th_daemon *d, int arg) {
  gpupool_client *c = NULL;
  gpupool_buffer *b;
  int ready = arg & 0xffff, go = arg >> 16;
  char ch = 1;
  CHILD_CHECK(gpupool_client_connect(d->sock, "owner", GPUPOOL_TIMEOUT_DEFAULT, &c) == 0, "connect");
  CHILD_CHECK(gpupool_buffer_alloc(c, NULL, MIB, 0, NULL, &b) == 0, "alloc");
  th_fill(gpupool_buffer_ptr(b), SEED, MIB);
  CHILD_CHECK(write(ready, &ch, 1) == 1 && read(go, &ch, 1) >= 0, "handshake with the test");
  gpupool_buffer_release(b, NULL);
  gpupool_client_disconnect(c);
  return 0;
}

/* A client receives no fd that maps memory it was not given. */
static void test_no_fd_reaches_other_users_memory(void **state) {
  int ready[2], go[2];
  char ch = 1;
  (void)state;
  start_with("capacity = 64M\nslab_size = 4M");
  assert_int_equal(pipe(ready), 0);
  assert_int_equal(pipe(go), 0);
  owner_pid = th_spawn(&D, owner_child, ready[1] | go[0] << 16);
  assert_int_equal(read(ready[0], &ch, 1), 1);
  th_wait_ok(th_spawn(&D, snoop_child, 0), "snooping client");
  assert_int_equal(write(go[1], &ch, 1), 1);
  th_wait_ok(owner_pid, "owner");
  owner_pid = 0;
  close(ready[0]);
  close(ready[1]);
  close(go[0]);
  close(go[1]);
}

/* Write through p in a grandchild: its exit status says whether the write got through. */
static int write_survives(volatile uint8_t *p) {
  int st;
  pid_t pid = fork();
  if (pid == 0) {
    signal(SIGSEGV, SIG_DFL); /* not the test framework's handler: die of it */
    signal(SIGBUS, SIG_DFL);
    p[0] ^= 0xff;
    _exit(0);
  }
  if (pid < 0 || waitpid(pid, &st, 0) != pid)
    return -1;
  return WIFEXITED(st) && WEXITSTATUS(st) == 0;
}

static int read_only_child(const th_daemon *d, int arg) {
  gpupool_client *c = NULL;
  gpupool_buffer *ro, *up;
  gpupool_token tok;
  uint8_t *p;
  (void)arg;
  CHILD_CHECK(th_become(NOBODY) == 0, "setuid");
  CHILD_CHECK(gpupool_client_connect(d->sock, "reader", GPUPOOL_TIMEOUT_DEFAULT, &c) == 0, "connect");
  CHILD_CHECK(gpupool_buffer_get(c, "group:readers/weights", 0, 1000, GPUPOOL_READ_ONLY, NULL, &ro, NULL) == 0, "get read-only");
  p = gpupool_buffer_ptr(ro);
  CHILD_CHECK(th_check(p, SEED, MIB), "bytes of the published buffer");
  /* The kernel refuses the write, and refuses to make the mapping writable. */
  CHILD_CHECK(write_survives(p) == 0, "a write through a read-only hold went through");
  CHILD_CHECK(mprotect((void *)((uintptr_t)p & ~(uintptr_t)4095), 4096, PROT_READ | PROT_WRITE) != 0,
              "a read-only mapping could be made writable");
  /* Sharing a read-only hold and opening the token asking for read-write gives read-only. */
  CHILD_CHECK(gpupool_buffer_share(ro, NULL, &tok) == 0, "share");
  CHILD_CHECK(gpupool_buffer_open(c, &tok, 0, NULL, &up) == 0, "open");
  CHILD_CHECK(gpupool_buffer_read_only(up) == 1, "a read-only token opened a writable hold");
  CHILD_CHECK(write_survives(gpupool_buffer_ptr(up)) == 0, "a write through the reopened hold went through");
  /* Nor does publishing it under another name and getting that, asking for read-write. */
  {
    gpupool_buffer *again;
    CHILD_CHECK(gpupool_buffer_publish(ro, "group:readers/again", NULL, NULL, NULL) == 0, "republish");
    CHILD_CHECK(gpupool_buffer_get(c, "group:readers/again", 0, 0, 0, NULL, &again, NULL) == 0, "get republished");
    CHILD_CHECK(gpupool_buffer_read_only(again) == 1, "a read-only hold republished came back writable");
    CHILD_CHECK(write_survives(gpupool_buffer_ptr(again)) == 0, "a write through the republished hold went through");
    gpupool_buffer_release(again, NULL);
    gpupool_name_unpublish(c, "group:readers/again");
  }
  gpupool_buffer_release(up, NULL);
  gpupool_buffer_release(ro, NULL);
  gpupool_client_disconnect(c);
  return 0;
}

/* Read-only is enforced by the kernel, and a token never upgrades a hold. */
static void test_read_only_is_enforced(void **state) {
  gpupool_client *c;
  gpupool_buffer *b;
  (void)state;
  start_with("capacity = 64M\nslab_size = 4M");
  c = th_connect(&D, "producer");
  assert_int_equal(gpupool_buffer_alloc(c, "shared", MIB, 0, NULL, &b), 0);
  th_fill(gpupool_buffer_ptr(b), SEED, MIB);
  assert_int_equal(gpupool_buffer_publish(b, "group:readers/weights", NULL, NULL, NULL), 0);
  th_wait_ok(th_spawn(&D, read_only_child, 0), "read-only consumer");
  /* Nothing the consumer tried changed a byte. */
  assert_true(th_check(gpupool_buffer_ptr(b), SEED, MIB));
  assert_int_equal(gpupool_name_unpublish(c, "group:readers/weights"), 0);
  assert_int_equal(gpupool_buffer_release(b, NULL), 0);
  gpupool_client_disconnect(c);
}

static int fresh_child(const th_daemon *d, int arg) {
  gpupool_client *c = NULL;
  gpupool_buffer *b;
  const uint8_t *p;
  (void)arg;
  CHILD_CHECK(th_become(NOBODY) == 0, "setuid");
  CHILD_CHECK(gpupool_client_connect(d->sock, "next", GPUPOOL_TIMEOUT_DEFAULT, &c) == 0, "connect");
  CHILD_CHECK(gpupool_buffer_alloc(c, NULL, MIB, 0, NULL, &b) == 0, "alloc");
  p = gpupool_buffer_ptr(b);
  for (uint32_t i = 0; i < MIB; i++)
    CHILD_CHECK(p[i] == 0, "byte %u of a fresh allocation is 0x%02x: another user's data", i, p[i]);
  gpupool_buffer_release(b, NULL);
  gpupool_client_disconnect(c);
  return 0;
}

/* Memory one user freed never reaches another user with its bytes in it. */
static void test_freed_memory_is_not_handed_over(void **state) {
  gpupool_client *c;
  gpupool_buffer *b;
  (void)state;
  start_with("capacity = 64M\nslab_size = 4M");
  c = th_connect(&D, "first");
  assert_int_equal(gpupool_buffer_alloc(c, NULL, MIB, 0, NULL, &b), 0);
  memset(gpupool_buffer_ptr(b), 0xab, MIB);
  assert_int_equal(gpupool_buffer_release(b, NULL), 0);
  th_wait_ok(th_spawn(&D, fresh_child, 0), "next user");
  gpupool_client_disconnect(c);
}

/* Free capacity is usable whatever slabs came and went before, and the error for a request
 * that cannot fit says what would. */
static void test_capacity_not_lost_to_placement(void **state) {
  gpupool_client *c;
  gpupool_buffer *b[16], *big;
  (void)state;
  start_with("capacity = 64M\nslab_size = 4M\nkeep_slabs = 0");
  c = th_connect(&D, "frag");
  for (int i = 0; i < 16; i++)
    assert_int_equal(gpupool_buffer_alloc(c, NULL, 3 * MIB, 0, NULL, &b[i]), 0); /* a slab each */
  for (int i = 0; i < 16; i += 2)
    assert_int_equal(gpupool_buffer_release(b[i], NULL), 0);
  assert_int_equal(gpupool_client_trim(c), 0);
  /* 32 MiB free, in 4 MiB pieces left between live slabs. */
  assert_int_equal(gpupool_buffer_alloc(c, NULL, 20 * MIB, 0, NULL, &big), 0);
  assert_int_equal(gpupool_buffer_release(big, NULL), 0);
  assert_int_equal(gpupool_buffer_alloc(c, NULL, 40 * MIB, 0, NULL, &big), GPUPOOL_ENOSPC);
  if (!strstr(gpupool_last_error(), "the largest request that would succeed now is 33554432 bytes"))
    fail_msg("out-of-space error does not say what would succeed: %s", gpupool_last_error());
  for (int i = 1; i < 16; i += 2)
    assert_int_equal(gpupool_buffer_release(b[i], NULL), 0);
  gpupool_client_disconnect(c);
}

/* The library checks a name as the daemon does, and says why it refuses it. */
static void test_names_checked_in_the_client(void **state) {
  gpupool_client *c;
  gpupool_buffer *b, *g;
  (void)state;
  start_with("capacity = 16M\nslab_size = 4M");
  c = th_connect(&D, "names");
  assert_int_equal(gpupool_buffer_alloc(c, NULL, 4096, 0, NULL, &b), 0);
  assert_int_equal(gpupool_buffer_publish(b, "bad\x01name", NULL, NULL, NULL), GPUPOOL_ENAME);
  assert_non_null(strstr(gpupool_last_error(), "control character at byte 3"));
  assert_int_equal(gpupool_buffer_get(c, "", 0, 0, 0, NULL, &g, NULL), GPUPOOL_ENAME);
  assert_non_null(strstr(gpupool_last_error(), "empty name"));
  assert_int_equal(gpupool_buffer_release(b, NULL), 0);
  gpupool_client_disconnect(c);
}

/* ---- a reload takes back what it removes ----------------------------------------------- */

#define OTHER 1001 /* a second uid, beside NOBODY, of tenant t */

/* The config of the reload test: allow_uids and the members of tenant t and group g. */
static void revoke_conf(const char *allow, const char *members, char *buf, size_t len) {
  snprintf(buf, len,
           "[daemon]\nsocket_mode = 0666\nallow_uids = %s\n"
           "[tenant t]\nuids = %s\n[group g]\nuids = %s\n"
           "[pool default]\nkind = host\ncapacity = 64M\nslab_size = 4M\n",
           allow, members, members);
}

/* Lines of the daemon's log holding what. */
static int log_lines(const char *what) {
  char line[4096];
  int n = 0;
  FILE *f = fopen(D.log, "r");
  while (f && fgets(line, sizeof line, f))
    n += strstr(line, what) != NULL;
  if (f)
    fclose(f);
  return n;
}

/* As NOBODY, a member of t: publishes t's name "tw" (the secret pattern) and keeps its
 * connection; once the reload has taken NOBODY out of allow_uids, its next request is
 * refused with the reason. */
static int dropped_uid_child(const th_daemon *d, int arg) {
  gpupool_client *c = NULL;
  gpupool_buffer *b, *more;
  int ready = arg & 0xffff, go = arg >> 16, rc;
  char ch = 1;
  CHILD_CHECK(th_become(NOBODY) == 0, "setuid");
  CHILD_CHECK(gpupool_client_connect(d->sock, "dropped", GPUPOOL_TIMEOUT_DEFAULT, &c) == 0, "connect");
  CHILD_CHECK(gpupool_buffer_alloc(c, NULL, MIB, 0, NULL, &b) == 0, "alloc");
  th_fill(gpupool_buffer_ptr(b), SEED, MIB);
  CHILD_CHECK(gpupool_buffer_publish(b, "tw", NULL, NULL, NULL) == 0, "publish tw");
  CHILD_CHECK(write(ready, &ch, 1) == 1 && read(go, &ch, 1) == 1, "handshake with the test");
  rc = gpupool_buffer_alloc(c, NULL, 4096, 0, NULL, &more);
  CHILD_CHECK(rc == GPUPOOL_EPERM, "uid %d, no longer in allow_uids, still allocates on its open connection (%s)",
              NOBODY, gpupool_err_name(rc));
  CHILD_CHECK(strstr(gpupool_last_error(), "no longer allowed") && strstr(gpupool_last_error(), "allow_uids"),
              "the refusal does not say why");
  gpupool_client_disconnect(c);
  return 0;
}

/* As OTHER, a member of t connected before the reload that moves it out of t: its open
 * connection gets nothing of t's any more (no name, no slab fd). */
static int moved_uid_child(const th_daemon *d, int arg) {
  gpupool_client *c = NULL;
  gpupool_buffer *g = NULL;
  int ready = arg & 0xffff, go = arg >> 16, rc;
  char ch = 1;
  CHILD_CHECK(th_become(OTHER) == 0, "setuid");
  CHILD_CHECK(gpupool_client_connect(d->sock, "moved", GPUPOOL_TIMEOUT_DEFAULT, &c) == 0, "connect");
  CHILD_CHECK(write(ready, &ch, 1) == 1 && read(go, &ch, 1) == 1, "handshake with the test");
  rc = gpupool_buffer_get(c, "tw", 0, 0, 0, NULL, &g, NULL);
  CHILD_CHECK(rc != 0, "uid %d, moved out of tenant t by a reload, still gets t's name 'tw' on its open connection",
              OTHER);
  /* Its connection was closed: the library reconnects (into its own tenant, where there is
   * no 'tw'), or the request already sent gets the reason. */
  CHILD_CHECK(rc == GPUPOOL_ENOENT || rc == GPUPOOL_ECLOSED, "get of tw after the reload: %s", gpupool_err_name(rc));
  CHILD_CHECK(any_memfd_holds_secret() == 0, "tenant t's memory is reachable after the reload");
  gpupool_client_disconnect(c);
  return 0;
}

/* A reload that takes a uid out of allow_uids, and another out of a tenant, applies to the
 * connections already open: the first is refused from its next request on, the second no
 * longer reaches the old tenant's names and memory. The log says why each was closed. */
static void test_reload_revokes_open_connections(void **state) {
  char conf[1024];
  int ready[2], go[2], before;
  pid_t dropped, moved;
  char ch = 1;
  (void)state;
  revoke_conf("65534, 1001", "65534, 1001", conf, sizeof conf);
  th_prepare_shared(&D);
  th_write_conf(&D, conf);
  th_start(&D, 1, NULL);
  assert_int_equal(pipe(ready), 0);
  assert_int_equal(pipe(go), 0);
  dropped = th_spawn(&D, dropped_uid_child, ready[1] | go[0] << 16);
  assert_int_equal(read(ready[0], &ch, 1), 1); /* "tw" is published */
  moved = th_spawn(&D, moved_uid_child, ready[1] | go[0] << 16);
  assert_int_equal(read(ready[0], &ch, 1), 1);

  revoke_conf("1001", "65534", conf, sizeof conf);
  th_write_conf(&D, conf);
  before = log_lines("reloaded ");
  assert_int_equal(kill(D.pid, SIGHUP), 0);
  for (int i = 0; i < 1000 && log_lines("reloaded ") == before; i++)
    th_sleep_ms(10);
  assert_int_equal(log_lines("reloaded "), before + 1);
  assert_int_equal(write(go[1], "gg", 2), 2);
  th_wait_ok(dropped, "client of the uid taken out of allow_uids");
  th_wait_ok(moved, "client of the uid taken out of tenant t");
  if (log_lines("no longer allowed") < 1 || log_lines("a reload moved") < 1) {
    th_dump_log(&D);
    fail_msg("the log does not say why the reload closed the two connections");
  }
  close(ready[0]);
  close(ready[1]);
  close(go[0]);
  close(go[1]);
}

int main(void) {
  return TS_RUN_TESTS(NULL, teardown, test_no_fd_reaches_other_users_memory, test_read_only_is_enforced,
                      test_freed_memory_is_not_handed_over, test_capacity_not_lost_to_placement,
                      test_names_checked_in_the_client, test_reload_revokes_open_connections);
}
