/*
 * Kept shares (gpupool_buffer_share_kept): a token for a message in flight keeps its buffer
 * alive without its maker. The maker, a real child process, writes a buffer, makes the token,
 * writes it into a pipe and exits at once; the reader opens it afterwards and reads the bytes.
 * A kept share opens once, expires after share_keep_ms when never opened (the daemon is back
 * at no buffers and no holds), counts as a hold, is bounded per connection, and a daemon that
 * stops with kept shares unopened exits cleanly.
 */
#include <inttypes.h>

#include "harness.h"

static th_daemon D;
static int token_pipe[2];

static int teardown(void **state) {
  (void)state;
  th_stop(&D);
  return 0;
}

static void start_with(const char *daemon_lines) {
  char conf[1024];
  snprintf(conf, sizeof conf, "[daemon]\n%s\n" TH_HOST_POOL("64M", "4M"), daemon_lines);
  th_start_conf(&D, conf);
}

/* The maker: n buffers of 4096 bytes filled with (i + arg), a kept share of each into the
 * pipe, every hold released and the connection closed before exiting. */
static int maker_child(const th_daemon *d, int arg) {
  gpupool_client *c = NULL;
  if (gpupool_client_connect(d->sock, "maker", GPUPOOL_TIMEOUT_DEFAULT, &c) != 0)
    return 2;
  for (int i = 0; i < 4; i++) {
    gpupool_buffer *b;
    gpupool_token tok;
    if (gpupool_buffer_alloc(c, NULL, 4096, 0, NULL, &b) != 0)
      return 3;
    memset(gpupool_buffer_ptr(b), i + arg, 4096);
    if (gpupool_buffer_share_kept(b, NULL, &tok) != 0)
      return 4;
    if (gpupool_buffer_release(b, NULL) != 0)
      return 5;
    if (write(token_pipe[1], &tok, sizeof tok) != (ssize_t)sizeof tok)
      return 6;
  }
  gpupool_client_disconnect(c);
  return 0;
}

/* Start the maker, wait for it to exit, read its four tokens. */
static void make_four(int fill, gpupool_token tok[4]) {
  int st;
  pid_t pid;
  assert_int_equal(pipe(token_pipe), 0);
  pid = th_spawn(&D, maker_child, fill);
  assert_int_equal(waitpid(pid, &st, 0), pid);
  assert_true(WIFEXITED(st));
  assert_int_equal(WEXITSTATUS(st), 0);
  close(token_pipe[1]);
  for (int i = 0; i < 4; i++)
    assert_int_equal(read(token_pipe[0], &tok[i], sizeof tok[i]), (ssize_t)sizeof tok[i]);
  close(token_pipe[0]);
}

static void test_outlives_its_maker(void **state) {
  gpupool_token tok[4];
  gpupool_daemon_stats ds;
  gpupool_client *r;
  (void)state;
  start_with("");
  make_four(0x40, tok);
  /* The maker is gone; its four buffers live on, one kept hold each. */
  th_stats(&D, &ds, NULL);
  assert_int_equal(ds.buffers, 4);
  assert_int_equal(ds.holds, 4);
  r = th_connect(&D, "reader");
  for (int i = 0; i < 4; i++) {
    gpupool_buffer *o;
    const unsigned char *p;
    assert_int_equal(gpupool_buffer_open(r, &tok[i], 0, NULL, &o), 0);
    p = gpupool_buffer_ptr(o);
    for (int j = 0; j < 4096; j++)
      if (p[j] != 0x40 + i)
        fail_msg("buffer %d byte %d is 0x%x, expected 0x%x", i, j, p[j], 0x40 + i);
    /* It opens once: the opener's hold took the keep's place. */
    {
      gpupool_buffer *again = NULL;
      assert_int_equal(gpupool_buffer_open(r, &tok[i], 0, NULL, &again), GPUPOOL_ENOENT);
      assert_non_null(strstr(gpupool_last_error(), "kept share"));
    }
    assert_int_equal(gpupool_buffer_release(o, NULL), 0);
  }
  gpupool_client_disconnect(r);
  th_wait_idle(&D, 3000);
}

static void test_expires_unopened(void **state) {
  gpupool_token tok[4];
  gpupool_client *r;
  gpupool_buffer *o = NULL;
  (void)state;
  start_with("share_keep_ms = 300");
  make_four(1, tok);
  /* Never opened: the daemon frees them after share_keep_ms, with nobody asking. */
  th_wait_idle(&D, 5000);
  r = th_connect(&D, "late reader");
  assert_int_equal(gpupool_buffer_open(r, &tok[0], 0, NULL, &o), GPUPOOL_ENOENT);
  gpupool_client_disconnect(r);
}

static void test_bounded_per_connection(void **state) {
  gpupool_client *c;
  gpupool_buffer *b, *o;
  gpupool_token tok[3], extra;
  (void)state;
  start_with("max_kept_shares_per_client = 3");
  c = th_connect(&D, "maker");
  assert_int_equal(gpupool_buffer_alloc(c, NULL, 100, 0, NULL, &b), 0);
  for (int i = 0; i < 3; i++)
    assert_int_equal(gpupool_buffer_share_kept(b, NULL, &tok[i]), 0);
  assert_int_equal(gpupool_buffer_share_kept(b, NULL, &extra), GPUPOOL_ELIMIT);
  assert_non_null(strstr(gpupool_last_error(), "max_kept_shares_per_client"));
  /* A plain share is no kept share: still allowed. */
  assert_int_equal(gpupool_buffer_share(b, NULL, &extra), 0);
  /* Opening one gives its slot back. */
  assert_int_equal(gpupool_buffer_open(c, &tok[0], 0, NULL, &o), 0);
  assert_int_equal(gpupool_buffer_share_kept(b, NULL, &tok[0]), 0);
  assert_int_equal(gpupool_buffer_release(o, NULL), 0);
  assert_int_equal(gpupool_buffer_release(b, NULL), 0);
  gpupool_client_disconnect(c);
  /* Three kept shares stay unopened: the daemon keeps the buffer, and stops cleanly with it
   * (teardown checks the exit status). */
  {
    gpupool_daemon_stats ds;
    th_stats(&D, &ds, NULL);
    assert_int_equal(ds.buffers, 1);
    assert_int_equal(ds.holds, 3);
  }
}

/* A kept share of a read-only hold opens read-only, whatever is asked. */
static void test_read_only_stays_read_only(void **state) {
  gpupool_client *a, *b;
  gpupool_buffer *x, *ro, *y;
  gpupool_token tok;
  (void)state;
  start_with("");
  a = th_connect(&D, "a");
  b = th_connect(&D, "b");
  assert_int_equal(gpupool_buffer_alloc(a, NULL, 100, 0, NULL, &x), 0);
  assert_int_equal(gpupool_buffer_share(x, NULL, &tok), 0);
  assert_int_equal(gpupool_buffer_open(b, &tok, GPUPOOL_READ_ONLY, NULL, &ro), 0);
  assert_int_equal(gpupool_buffer_share_kept(ro, NULL, &tok), 0);
  assert_int_equal(gpupool_buffer_release(ro, NULL), 0);
  assert_int_equal(gpupool_buffer_open(a, &tok, 0, NULL, &y), 0);
  assert_true(gpupool_buffer_read_only(y));
  assert_int_equal(gpupool_buffer_release(y, NULL), 0);
  assert_int_equal(gpupool_buffer_release(x, NULL), 0);
  gpupool_client_disconnect(a);
  gpupool_client_disconnect(b);
  th_wait_idle(&D, 3000);
}

int main(void) {
  return TS_RUN_TESTS(NULL, teardown, test_outlives_its_maker, test_expires_unopened, test_bounded_per_connection,
                      test_read_only_stays_read_only);
}
