/*
 * Stopping a real gpupoold while clients still hold memory: SIGTERM must end the daemon
 * promptly and cleanly even though the holders' processes live on (their mappings stay
 * valid without the daemon).
 */
#include "harness.h"

static int holder(const th_daemon *d, int wfd) {
  gpupool_client *c;
  gpupool_buffer *b;
  CHILD_CHECK(gpupool_client_connect(d->sock, "holder", GPUPOOL_TIMEOUT_DEFAULT, &c) == 0, "connect");
  CHILD_CHECK(gpupool_buffer_alloc(c, NULL, 4096, 0, NULL, &b) == 0, "alloc");
  CHILD_CHECK(write(wfd, "R", 1) == 1, "signal ready");
  for (;;)
    pause();
}

/* A client that held a buffer is watched until its process exits (its range is not reused
 * before); that watch must not keep a stopping daemon alive. */
static void test_sigterm_with_a_live_holder(void **state) {
  th_daemon d;
  int fds[2], st = 0, exited = 0;
  char ch;
  pid_t pid;
  (void)state;

  th_prepare(&d);
  th_start(&d, 0, NULL);
  assert_int_equal(pipe(fds), 0);
  pid = th_spawn(&d, holder, fds[1]);
  assert_int_equal(read(fds[0], &ch, 1), 1);
  kill(d.pid, SIGTERM);
  for (int i = 0; i < 500 && !exited; i++) {
    if (waitpid(d.pid, &st, WNOHANG) == d.pid)
      exited = 1;
    else
      th_sleep_ms(10);
  }
  kill(pid, SIGKILL);
  waitpid(pid, NULL, 0);
  close(fds[0]);
  close(fds[1]);
  if (!exited) {
    th_dump_log(&d);
    fail_msg("gpupoold still runs 5 s after SIGTERM while a client holding memory lives");
  }
  th_track(d.pid, 0);
  d.pid = 0;
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
    th_dump_log(&d);
    fail_msg("gpupoold did not exit cleanly on SIGTERM (status 0x%x)", st);
  }
  th_stop(&d);
}

int main(void) {
  return TS_RUN_TESTS(NULL, NULL, test_sigterm_with_a_live_holder);
}
