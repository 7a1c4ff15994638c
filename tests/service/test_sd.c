/*
 * Unit tests of daemon/service/sd.c, in process: socket activation checks against real sockets placed
 * at fd 3 (a listening Unix stream socket is taken; several fds, a datagram socket, a socket
 * that is not listening, an IP socket, a pipe and malformed variables are refused with a
 * message), sd_notify to a path and to an abstract socket, and the watchdog variables.
 */
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cmocka.h>

#include "errors.h"
#include "sd.h"

static char tmpdir[64];
static int saved3 = -1, saved4 = -1;

static int setup(void **state) {
  (void)state;
  snprintf(tmpdir, sizeof(tmpdir), "/tmp/gpupool-sd-XXXXXX");
  assert_non_null(mkdtemp(tmpdir));
  /* Tests place sockets at fds 3 and 4; keep whatever the runner had there. */
  saved3 = fcntl(3, F_DUPFD_CLOEXEC, 100);
  saved4 = fcntl(4, F_DUPFD_CLOEXEC, 100);
  return 0;
}

static int teardown(void **state) {
  char cmd[128];
  (void)state;
  close(3);
  close(4);
  if (saved3 >= 0) {
    dup2(saved3, 3);
    close(saved3);
  }
  if (saved4 >= 0) {
    dup2(saved4, 4);
    close(saved4);
  }
  snprintf(cmd, sizeof(cmd), "rm -rf '%s'", tmpdir);
  return system(cmd) == 0 ? 0 : -1;
}

static void clear_env(void) {
  unsetenv("LISTEN_PID");
  unsetenv("LISTEN_FDS");
  unsetenv("LISTEN_FDNAMES");
  unsetenv("NOTIFY_SOCKET");
  unsetenv("WATCHDOG_USEC");
  unsetenv("WATCHDOG_PID");
}

static void set_pid_env(const char *name, pid_t pid) {
  char b[32];
  snprintf(b, sizeof(b), "%d", (int)pid);
  setenv(name, b, 1);
}

/* Put fd at position `at` (closing what was there) and close the original. */
static void place(int fd, int at) {
  assert_true(fd >= 0);
  if (fd != at) {
    assert_int_equal(dup2(fd, at), at);
    close(fd);
  }
}

static int unix_socket(int type, const char *name, int do_listen) {
  struct sockaddr_un a;
  int fd = socket(AF_UNIX, type, 0);
  assert_true(fd >= 0);
  memset(&a, 0, sizeof(a));
  a.sun_family = AF_UNIX;
  snprintf(a.sun_path, sizeof(a.sun_path), "%s/%s", tmpdir, name);
  unlink(a.sun_path);
  assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof(a)), 0);
  if (do_listen)
    assert_int_equal(listen(fd, 4), 0);
  return fd;
}

static void activate(int nfds) {
  char b[16];
  snprintf(b, sizeof(b), "%d", nfds);
  setenv("LISTEN_FDS", b, 1);
  set_pid_env("LISTEN_PID", getpid());
  setenv("LISTEN_FDNAMES", "gpupoold.socket", 1);
}

static void assert_env_cleared(void) {
  assert_null(getenv("LISTEN_PID"));
  assert_null(getenv("LISTEN_FDS"));
  assert_null(getenv("LISTEN_FDNAMES"));
}

static void test_not_activated(void **state) {
  (void)state;
  clear_env();
  assert_int_equal(gpd_sd_listen_fd(), -1);
}

static void test_activated(void **state) {
  int fd, fl;
  (void)state;
  clear_env();
  place(unix_socket(SOCK_STREAM, "a.sock", 1), 3);
  activate(1);
  fd = gpd_sd_listen_fd();
  assert_int_equal(fd, 3);
  fl = fcntl(3, F_GETFL);
  assert_true(fl >= 0 && (fl & O_NONBLOCK));
  fl = fcntl(3, F_GETFD);
  assert_true(fl >= 0 && (fl & FD_CLOEXEC));
  assert_env_cleared();
  /* A second call finds no variables: not activated. */
  assert_int_equal(gpd_sd_listen_fd(), -1);
  close(3);
}

static void test_other_pid(void **state) {
  (void)state;
  clear_env();
  place(unix_socket(SOCK_STREAM, "b.sock", 1), 3);
  activate(1);
  set_pid_env("LISTEN_PID", getpid() + 1);
  assert_int_equal(gpd_sd_listen_fd(), -1);
  assert_env_cleared();
  /* Not ours: left alone, still open and still blocking. */
  assert_true(fcntl(3, F_GETFD) >= 0);
  assert_false(fcntl(3, F_GETFL) & O_NONBLOCK);
  close(3);
}

static void test_two_fds(void **state) {
  int rc;
  (void)state;
  clear_env();
  place(unix_socket(SOCK_STREAM, "c1.sock", 1), 3);
  place(unix_socket(SOCK_STREAM, "c2.sock", 1), 4);
  activate(2);
  rc = gpd_sd_listen_fd();
  assert_int_equal(rc, GPUPOOL_ECONFIG);
  assert_non_null(strstr(gpupool__errmsg(), "LISTEN_FDS=2"));
  assert_non_null(strstr(gpupool__errmsg(), "ListenStream="));
  assert_env_cleared();
  /* Refused fds must not leak into programs the daemon could run. */
  assert_true(fcntl(3, F_GETFD) & FD_CLOEXEC);
  assert_true(fcntl(4, F_GETFD) & FD_CLOEXEC);
  close(3);
  close(4);
}

static void test_zero_and_garbage(void **state) {
  (void)state;
  clear_env();
  activate(0);
  assert_int_equal(gpd_sd_listen_fd(), -1);
  activate(1);
  setenv("LISTEN_FDS", "one", 1);
  assert_int_equal(gpd_sd_listen_fd(), GPUPOOL_ECONFIG);
  assert_non_null(strstr(gpupool__errmsg(), "LISTEN_FDS='one'"));
  activate(1);
  setenv("LISTEN_PID", "12x", 1);
  assert_int_equal(gpd_sd_listen_fd(), -1);
  assert_env_cleared();
}

static void expect_refused(const char *why) {
  int rc;
  activate(1);
  rc = gpd_sd_listen_fd();
  assert_int_equal(rc, GPUPOOL_ECONFIG);
  if (strstr(gpupool__errmsg(), why) == NULL)
    fail_msg("message '%s' does not mention '%s'", gpupool__errmsg(), why);
  assert_env_cleared();
  close(3);
}

static void test_datagram_refused(void **state) {
  (void)state;
  clear_env();
  place(unix_socket(SOCK_DGRAM, "d.sock", 0), 3);
  expect_refused("not a stream socket");
}

static void test_not_listening_refused(void **state) {
  (void)state;
  clear_env();
  place(unix_socket(SOCK_STREAM, "e.sock", 0), 3);
  expect_refused("not a listening socket");
}

static void test_inet_refused(void **state) {
  struct sockaddr_in a;
  int fd;
  (void)state;
  clear_env();
  fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0)
    skip();
  memset(&a, 0, sizeof(a));
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (bind(fd, (struct sockaddr *)&a, sizeof(a)) != 0) {
    close(fd);
    skip();
  }
  assert_int_equal(listen(fd, 1), 0);
  place(fd, 3);
  expect_refused("not a Unix domain socket");
}

static void test_pipe_refused(void **state) {
  int p[2];
  (void)state;
  clear_env();
  assert_int_equal(pipe(p), 0);
  close(p[1]);
  place(p[0], 3);
  expect_refused("not a socket");
}

static int notify_receiver(struct sockaddr_un *a, socklen_t alen) {
  struct timeval tv = {.tv_sec = 5, .tv_usec = 0};
  int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  assert_true(fd >= 0);
  assert_int_equal(bind(fd, (struct sockaddr *)a, alen), 0);
  assert_int_equal(setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)), 0);
  return fd;
}

static void expect_datagram(int fd, const char *want) {
  char buf[512];
  ssize_t n = recv(fd, buf, sizeof(buf) - 1, 0);
  assert_true(n >= 0);
  buf[n] = '\0';
  assert_string_equal(buf, want);
}

static void test_notify_unset(void **state) {
  (void)state;
  clear_env();
  assert_int_equal(gpd_sd_notify("READY=1"), 0);
  assert_int_equal(gpd_sd_notifyf("STATUS=%d", 1), 0);
}

static void test_notify_path(void **state) {
  struct sockaddr_un a;
  int fd;
  (void)state;
  clear_env();
  memset(&a, 0, sizeof(a));
  a.sun_family = AF_UNIX;
  snprintf(a.sun_path, sizeof(a.sun_path), "%s/notify", tmpdir);
  fd = notify_receiver(&a, sizeof(a));
  setenv("NOTIFY_SOCKET", a.sun_path, 1);
  assert_int_equal(gpd_sd_notify("READY=1\nSTATUS=serving"), 0);
  expect_datagram(fd, "READY=1\nSTATUS=serving");
  assert_int_equal(gpd_sd_notifyf("STATUS=%d pools on %s", 3, "host"), 0);
  expect_datagram(fd, "STATUS=3 pools on host");
  close(fd);
  /* Nobody listening any more: an error, with the socket named. */
  unlink(a.sun_path);
  assert_int_equal(gpd_sd_notify("WATCHDOG=1"), GPUPOOL_EIO);
  assert_non_null(strstr(gpupool__errmsg(), a.sun_path));
  clear_env();
}

static void test_notify_abstract(void **state) {
  struct sockaddr_un a;
  char name[64];
  size_t n;
  int fd;
  (void)state;
  clear_env();
  n = (size_t)snprintf(name, sizeof(name), "@gpupool-sd-test-%d", (int)getpid());
  memset(&a, 0, sizeof(a));
  a.sun_family = AF_UNIX;
  memcpy(a.sun_path, name, n);
  a.sun_path[0] = '\0';
  fd = notify_receiver(&a, (socklen_t)(offsetof(struct sockaddr_un, sun_path) + n));
  setenv("NOTIFY_SOCKET", name, 1);
  assert_int_equal(gpd_sd_notify("WATCHDOG=1"), 0);
  expect_datagram(fd, "WATCHDOG=1");
  close(fd);
  clear_env();
}

static void test_notify_bad_address(void **state) {
  (void)state;
  clear_env();
  setenv("NOTIFY_SOCKET", "relative/path", 1);
  assert_int_equal(gpd_sd_notify("READY=1"), GPUPOOL_EIO);
  assert_non_null(strstr(gpupool__errmsg(), "NOTIFY_SOCKET"));
  clear_env();
}

static void test_watchdog(void **state) {
  (void)state;
  clear_env();
  assert_int_equal(gpd_sd_watchdog_usec(), 0);
  setenv("WATCHDOG_USEC", "200000", 1);
  assert_int_equal(gpd_sd_watchdog_usec(), 200000);
  set_pid_env("WATCHDOG_PID", getpid());
  assert_int_equal(gpd_sd_watchdog_usec(), 200000);
  set_pid_env("WATCHDOG_PID", getpid() + 1);
  assert_int_equal(gpd_sd_watchdog_usec(), 0);
  unsetenv("WATCHDOG_PID");
  setenv("WATCHDOG_USEC", "20ms", 1);
  assert_int_equal(gpd_sd_watchdog_usec(), 0);
  setenv("WATCHDOG_USEC", "0", 1);
  assert_int_equal(gpd_sd_watchdog_usec(), 0);
  clear_env();
}

/* A status text fits its buffer whole, or is cut between words with " ..." at the end. */
static void test_fit(void **state) {
  char buf[32];
  size_t n;
  (void)state;
  n = gpd_sd_fit(buf, sizeof buf, "Serving 1 pool(s)");
  assert_string_equal(buf, "Serving 1 pool(s)");
  assert_int_equal(n, strlen(buf));
  /* 31 characters fit exactly. */
  n = gpd_sd_fit(buf, sizeof buf, "0123456789 0123456789 012345678");
  assert_string_equal(buf, "0123456789 0123456789 012345678");
  /* One more: cut at the last space, punctuation before it dropped, the mark added. */
  n = gpd_sd_fit(buf, sizeof buf, "peer_listen is set; peer_secret_file is not");
  assert_string_equal(buf, "peer_listen is set ...");
  assert_int_equal(n, strlen(buf));
  n = gpd_sd_fit(buf, sizeof buf, "the peer secret file /etc/gpupool/secret is readable");
  assert_string_equal(buf, "the peer secret file ...");
  assert_true(n < sizeof buf);
  /* No space to cut at: a character boundary, never inside a UTF-8 sequence. */
  n = gpd_sd_fit(buf, 12, "/\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9/x");
  assert_int_equal(n, strlen(buf));
  assert_true(n <= 11);
  assert_string_equal(buf, "/\xc3\xa9\xc3\xa9\xc3\xa9...");
  n = gpd_sd_fit(buf, 4, "abcdef");
  assert_int_equal(n, 0);
  assert_string_equal(buf, "");
}

/* Parts added in order of importance: each keeps the room the next ones need. */
static void test_status_add(void **state) {
  char buf[64];
  size_t at = 0;
  const char *serving = "Serving 1 pool(s)";
  (void)state;
  at = gpd_sd_status_add(buf, sizeof buf, at, "",
                         "Reload failed, old configuration kept: /etc/gpupool/gpupoold.conf:3: "
                         "'banana' is not a number",
                         strlen(serving) + 2);
  at = gpd_sd_status_add(buf, sizeof buf, at, "; ", serving, 0);
  assert_int_equal(at, strlen(buf));
  assert_true(at < sizeof buf);
  assert_string_equal(buf, "Reload failed, old configuration kept ...; Serving 1 pool(s)");
  /* No room left for another part: nothing of it is added. */
  assert_int_equal(gpd_sd_status_add(buf, sizeof buf, at, "; degraded: ", "metrics tcp: in use", 0), at);
  assert_string_equal(buf, "Reload failed, old configuration kept ...; Serving 1 pool(s)");
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_not_activated),
      cmocka_unit_test(test_activated),
      cmocka_unit_test(test_other_pid),
      cmocka_unit_test(test_two_fds),
      cmocka_unit_test(test_zero_and_garbage),
      cmocka_unit_test(test_datagram_refused),
      cmocka_unit_test(test_not_listening_refused),
      cmocka_unit_test(test_inet_refused),
      cmocka_unit_test(test_pipe_refused),
      cmocka_unit_test(test_notify_unset),
      cmocka_unit_test(test_notify_path),
      cmocka_unit_test(test_notify_abstract),
      cmocka_unit_test(test_notify_bad_address),
      cmocka_unit_test(test_watchdog),
      cmocka_unit_test(test_fit),
      cmocka_unit_test(test_status_add),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
