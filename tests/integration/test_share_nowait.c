/*
 * Shares that do not wait for their reply (gpupool_buffer_share_kept_many_nowait): the maker
 * makes its tokens from ids the daemon reserved for its connection, sends the Share and goes
 * on. Real processes over the real socket: a maker that exits right after such a share
 * leaves tokens that open, byte-exact; an Open that the daemon reads before the share (the
 * maker stopped in the test hook between making its tokens and sending them) waits for it and
 * then opens; fails at once, saying why, when the maker disconnects without sharing; fails
 * after open_wait_ms when the share never comes; a made-up token for a reserved id waits and
 * then fails; waiting Opens are bounded like other waiting requests; a share that fails in
 * the daemon is told to
 * the tokens' opener and counted for its maker; hundreds of such shares in a row (past the
 * 256 ids of a reserve, past the replies the client lets pile up) all open.
 */
#include <inttypes.h>
#include <pthread.h>

#include "harness.h"
#include "test_hooks.h"

static th_daemon D;
static int tok_pipe[2];   /* maker -> test: tokens */
static int go_pipe[2];    /* test -> maker: go on (a byte), or close it to end the maker */

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

/* What the maker does in the hook: hand its tokens on, then wait for the test's byte (its
 * share goes out after it) or for the pipe's end (it exits without sending the share). */
static void hand_on_first(gpupool_client *c, const gpupool_token *out, int n) {
  char b;
  (void)c;
  if (write(tok_pipe[1], out, sizeof *out * (size_t)n) != (ssize_t)(sizeof *out * (size_t)n))
    _exit(20);
  if (read(go_pipe[0], &b, 1) != 1)
    _exit(0); /* told to go without sharing */
}

/* The maker: n buffers of 4096 bytes, buffer i filled with fill + i; a first share of one
 * more buffer (it waits: the connection reserves its ids), then the n shared in one share that
 * does not wait (through the hook when arg has HOOK), every hold released, exit at once. */
enum { HOOK = 0x100 };
static int maker_child(const th_daemon *d, int arg) {
  gpupool_client *c = NULL;
  gpupool_buffer *b[4], *first;
  gpupool_token tok[4], t0;
  int n = 3, fill = arg & 0xff;
  close(go_pipe[1]); /* the test's ends */
  close(tok_pipe[0]);
  if (gpupool_client_connect(d->sock, "maker", GPUPOOL_TIMEOUT_DEFAULT, &c) != 0)
    return 2;
  if (gpupool_buffer_alloc(c, NULL, 4096, 0, NULL, &first) != 0 ||
      gpupool_buffer_share_kept_many_nowait(&first, 1, NULL, &t0) != 0)
    return 3;
  for (int i = 0; i < n; i++) {
    if (gpupool_buffer_alloc(c, NULL, 4096, 0, NULL, &b[i]) != 0)
      return 4;
    memset(gpupool_buffer_ptr(b[i]), fill + i, 4096);
  }
  if (arg & HOOK)
    gpupool__hook_nowait = hand_on_first;
  if (gpupool_buffer_share_kept_many_nowait(b, n, NULL, tok) != 0)
    return 5;
  if (!(arg & HOOK) && write(tok_pipe[1], tok, sizeof *tok * (size_t)n) != (ssize_t)(sizeof *tok * (size_t)n))
    return 6;
  for (int i = 0; i < n; i++)
    if (gpupool_buffer_release(b[i], NULL) != 0)
      return 7;
  /* No disconnect, no wait: the process ends with its share maybe unread by the daemon. */
  _exit(0);
}

static pid_t start_maker(int arg, gpupool_token tok[3]) {
  pid_t pid;
  assert_int_equal(pipe(tok_pipe), 0);
  assert_int_equal(pipe(go_pipe), 0);
  pid = th_spawn(&D, maker_child, arg);
  close(tok_pipe[1]);
  close(go_pipe[0]);
  for (size_t got = 0; got < 3 * sizeof *tok;) {
    ssize_t r = read(tok_pipe[0], (char *)tok + got, 3 * sizeof *tok - got);
    assert_true(r > 0);
    got += (size_t)r;
  }
  close(tok_pipe[0]);
  return pid;
}

static void maker_done(pid_t pid) {
  int st;
  close(go_pipe[1]);
  assert_int_equal(waitpid(pid, &st, 0), pid);
  assert_true(WIFEXITED(st));
  assert_int_equal(WEXITSTATUS(st), 0);
}

static void check_bytes(gpupool_buffer *const *o, int fill) {
  for (int i = 0; i < 3; i++) {
    const unsigned char *p = gpupool_buffer_ptr(o[i]);
    for (size_t j = 0; j < 4096; j++)
      if (p[j] != (unsigned char)(fill + i))
        fail_msg("buffer %d byte %zu is %#x, not %#x", i, j, p[j], fill + i);
  }
}

static void test_maker_exits_at_once(void **state) {
  gpupool_token tok[3];
  gpupool_buffer *o[3];
  gpupool_client *r;
  (void)state;
  start_with("");
  maker_done(start_maker(0x30, tok));
  r = th_connect(&D, "reader");
  assert_int_equal(gpupool_buffer_open_many(r, tok, 3, 0, NULL, o), 0);
  check_bytes(o, 0x30);
  for (int i = 0; i < 3; i++)
    assert_int_equal(gpupool_buffer_release(o[i], NULL), 0);
  /* A kept share opens once. */
  assert_int_equal(gpupool_buffer_open_many(r, tok, 3, 0, NULL, o), GPUPOOL_ENOENT);
  gpupool_client_disconnect(r);
  {
    gpupool_daemon_stats ds;
    th_stats(&D, &ds, NULL);
    assert_int_equal(ds.opens_waited, 0); /* the share was read long before */
  }
}

/* An Open in a thread of its own: what it got. */
typedef struct {
  gpupool_client *r;
  gpupool_token tok[3];
  gpupool_buffer *o[3];
  int rc;
  char msg[512];
  uint64_t took_ms;
  volatile int done;
} opener;

static void *open_thread(void *arg) {
  opener *op = arg;
  uint64_t t0 = th_now_ms();
  op->rc = gpupool_buffer_open_many(op->r, op->tok, 3, 0, NULL, op->o);
  op->took_ms = th_now_ms() - t0;
  snprintf(op->msg, sizeof op->msg, "%s", op->rc ? gpupool_last_error() : "");
  __atomic_store_n(&op->done, 1, __ATOMIC_RELEASE);
  return NULL;
}

/* Until the daemon has handled the opener's request (its counter of requests moved past the
 * Stats requests of this loop): the Open is waiting in the daemon. */
static void until_open_read(gpupool_client *s, uint64_t before) {
  gpupool_daemon_stats ds;
  uint64_t mine = 0;
  for (int i = 0; i < 500; i++) {
    assert_int_equal(gpupool_client_stats(s, &ds, NULL, 0, NULL), 0);
    mine++;
    if (ds.requests >= before + mine + 1)
      return;
    th_sleep_ms(10);
  }
  fail_msg("the Open did not reach the daemon in 5 s");
}

static void start_open(opener *op, pthread_t *t, const gpupool_token tok[3], uint64_t *before) {
  gpupool_daemon_stats ds;
  gpupool_client *s = th_connect(&D, "stats");
  memset(op, 0, sizeof *op);
  memcpy(op->tok, tok, sizeof op->tok);
  op->r = th_connect(&D, "reader");
  assert_int_equal(gpupool_client_stats(s, &ds, NULL, 0, NULL), 0);
  *before = ds.requests;
  assert_int_equal(pthread_create(t, NULL, open_thread, op), 0);
  until_open_read(s, *before);
  gpupool_client_disconnect(s);
}

static void test_open_read_first_waits_for_the_share(void **state) {
  gpupool_token tok[3];
  opener op;
  pthread_t t;
  uint64_t before;
  pid_t pid;
  (void)state;
  start_with("");
  pid = start_maker(HOOK | 0x50, tok);
  /* The maker is stopped before sending its share: the Open gets there first and waits. */
  start_open(&op, &t, tok, &before);
  th_sleep_ms(100);
  assert_false(__atomic_load_n(&op.done, __ATOMIC_ACQUIRE));
  assert_int_equal(write(go_pipe[1], "g", 1), 1); /* now the share */
  assert_int_equal(pthread_join(t, NULL), 0);
  if (op.rc != 0)
    fail_msg("the waiting Open failed: %s", op.msg);
  assert_true(op.took_ms >= 100);
  check_bytes(op.o, 0x50);
  maker_done(pid);
  {
    gpupool_daemon_stats ds;
    th_stats(&D, &ds, NULL);
    assert_int_equal(ds.opens_waited, 1);
    assert_int_equal(ds.opens_waiting, 0);
  }
  for (int i = 0; i < 3; i++)
    assert_int_equal(gpupool_buffer_release(op.o[i], NULL), 0);
  gpupool_client_disconnect(op.r);
}

static void test_maker_gone_without_sharing(void **state) {
  gpupool_token tok[3];
  gpupool_daemon_stats ds;
  opener op;
  pthread_t t;
  uint64_t before;
  pid_t pid;
  (void)state;
  start_with("");
  pid = start_maker(HOOK | 0x60, tok);
  start_open(&op, &t, tok, &before);
  maker_done(pid); /* exits in the hook: the share never goes */
  assert_int_equal(pthread_join(t, NULL), 0);
  assert_int_equal(op.rc, GPUPOOL_ENOENT);
  if (!strstr(op.msg, "disconnected without sharing it") || !strstr(op.msg, "handed it on"))
    fail_msg("unexpected message: %s", op.msg);
  assert_true(op.took_ms < 5000);
  gpupool_client_disconnect(op.r);
  /* Nothing left behind: the maker's buffers went with it. */
  th_stats(&D, &ds, NULL);
  assert_int_equal(ds.holds, 1); /* the first share's, kept for share_keep_ms */
}

static void test_open_waits_at_most_open_wait_ms(void **state) {
  gpupool_token tok[3];
  opener op;
  pthread_t t;
  uint64_t before;
  pid_t pid;
  (void)state;
  start_with("open_wait_ms = 300");
  pid = start_maker(HOOK | 0x70, tok);
  start_open(&op, &t, tok, &before);
  assert_int_equal(pthread_join(t, NULL), 0);
  assert_int_equal(op.rc, GPUPOOL_ETIMEDOUT);
  if (!strstr(op.msg, "open_wait_ms"))
    fail_msg("unexpected message: %s", op.msg);
  assert_true(op.took_ms >= 250);
  assert_int_equal(write(go_pipe[1], "g", 1), 1); /* the share comes after all: it opens now */
  maker_done(pid);
  assert_int_equal(gpupool_buffer_open_many(op.r, tok, 3, 0, NULL, op.o), 0);
  check_bytes(op.o, 0x70);
  for (int i = 0; i < 3; i++)
    assert_int_equal(gpupool_buffer_release(op.o[i], NULL), 0);
  gpupool_client_disconnect(op.r);
}

/* A token made up for an id the maker reserved waits like a real one, and fails once the
 * share it waits for comes with another secret; the real token opens. */
static void test_made_up_token_waits_then_fails(void **state) {
  gpupool_token tok[3];
  opener op;
  pthread_t t;
  uint64_t before;
  pid_t pid;
  (void)state;
  start_with("");
  pid = start_maker(HOOK | 0x80, tok);
  memcpy(tok + 1, tok, sizeof *tok); /* the first id, twice... */
  tok[1].bytes[8] ^= 0x5a;            /* ...the second time with a secret of its own */
  start_open(&op, &t, tok, &before);
  th_sleep_ms(100);
  assert_false(__atomic_load_n(&op.done, __ATOMIC_ACQUIRE)); /* it waits for the share */
  assert_int_equal(write(go_pipe[1], "g", 1), 1);
  assert_int_equal(pthread_join(t, NULL), 0);
  assert_int_equal(op.rc, GPUPOOL_ENOENT);
  maker_done(pid);
  /* Nothing was opened by the request that failed (all or nothing): the real first token is
   * still there. */
  assert_int_equal(gpupool_buffer_open_many(op.r, tok, 1, 0, NULL, op.o), 0);
  assert_int_equal(*(const unsigned char *)gpupool_buffer_ptr(op.o[0]), 0x80);
  assert_int_equal(gpupool_buffer_release(op.o[0], NULL), 0);
  gpupool_client_disconnect(op.r);
}

/* Waiting Opens count as waiting requests: past max_waiters_per_client, refused at once. */
static void test_waiting_opens_are_bounded(void **state) {
  gpupool_token tok[3];
  opener op[3];
  pthread_t t[3];
  uint64_t before;
  int refused = 0, opened = 0;
  pid_t pid;
  (void)state;
  start_with("max_waiters_per_client = 2");
  pid = start_maker(HOOK | 0x90, tok);
  start_open(&op[0], &t[0], tok, &before);
  for (int i = 1; i < 3; i++) {
    gpupool_client *r = op[0].r;
    memset(&op[i], 0, sizeof op[i]);
    memcpy(op[i].tok, tok, sizeof op[i].tok);
    op[i].r = r; /* the same connection */
    assert_int_equal(pthread_create(&t[i], NULL, open_thread, &op[i]), 0);
  }
  /* The third is refused at once; the other two wait until the share comes. */
  th_sleep_ms(300);
  {
    int done = 0;
    for (int i = 0; i < 3; i++)
      done += __atomic_load_n(&op[i].done, __ATOMIC_ACQUIRE);
    assert_int_equal(done, 1);
  }
  assert_int_equal(write(go_pipe[1], "g", 1), 1);
  for (int i = 0; i < 3; i++) {
    assert_int_equal(pthread_join(t[i], NULL), 0);
    if (op[i].rc == GPUPOOL_ELIMIT && strstr(op[i].msg, "max_waiters_per_client"))
      refused++;
    else if (op[i].rc == 0)
      opened++;
    else
      assert_int_equal(op[i].rc, GPUPOOL_ENOENT); /* the loser of the two: a kept share opens once */
  }
  assert_int_equal(refused, 1);
  assert_int_equal(opened, 1);
  maker_done(pid);
  for (int i = 0; i < 3; i++)
    if (op[i].rc == 0)
      for (int j = 0; j < 3; j++)
        assert_int_equal(gpupool_buffer_release(op[i].o[j], NULL), 0);
  gpupool_client_disconnect(op[0].r);
}

static void test_failed_share_is_told(void **state) {
  gpupool_client *m, *r;
  gpupool_buffer *b[3], *o[2];
  gpupool_token tok[3];
  gpupool_daemon_stats ds;
  char msg[512];
  (void)state;
  /* Two kept shares at most: the first share (one buffer, it reserves) and then two more
   * exceed it, so the daemon refuses that share after the maker handed its tokens on. */
  start_with("max_kept_shares_per_client = 2");
  m = th_connect(&D, "maker");
  r = th_connect(&D, "reader");
  for (int i = 0; i < 3; i++)
    assert_int_equal(gpupool_buffer_alloc(m, NULL, 4096, 0, NULL, &b[i]), 0);
  assert_int_equal(gpupool_buffer_share_kept_many_nowait(b, 1, NULL, tok), 0);
  assert_int_equal(gpupool_buffer_share_kept_many_nowait(b + 1, 2, NULL, tok + 1), 0);
  assert_int_equal(gpupool_buffer_open_many(r, tok + 1, 2, 0, NULL, o), GPUPOOL_ENOENT);
  if (!strstr(gpupool_last_error(), "the share failed") || !strstr(gpupool_last_error(), "max_kept_shares_per_client"))
    fail_msg("unexpected message: %s", gpupool_last_error());
  /* The maker learns it once it reads the reply (any later request reads it). */
  assert_int_equal(gpupool_client_stats(m, &ds, NULL, 0, NULL), 0);
  assert_int_equal(gpupool_client_nowait_failures(m, msg, sizeof msg), 1);
  assert_non_null(strstr(msg, "max_kept_shares_per_client"));
  /* The first token still opens. */
  assert_int_equal(gpupool_buffer_open_many(r, tok, 1, 0, NULL, o), 0);
  assert_int_equal(gpupool_buffer_release(o[0], NULL), 0);
  gpupool_client_disconnect(r);
  gpupool_client_disconnect(m);
}

static void test_many_in_a_row(void **state) {
  enum { N = 600 };
  gpupool_client *m, *r;
  gpupool_buffer *b, *o;
  gpupool_token *tok = calloc(N, sizeof *tok);
  (void)state;
  assert_non_null(tok);
  start_with("max_kept_shares_per_client = 1000");
  m = th_connect(&D, "maker");
  r = th_connect(&D, "reader");
  assert_int_equal(gpupool_buffer_alloc(m, NULL, 4096, 0, NULL, &b), 0);
  memset(gpupool_buffer_ptr(b), 0x11, 4096);
  /* Past two reserves of 256 ids, and far past the 64 replies left unread at a time. */
  for (int i = 0; i < N; i++)
    assert_int_equal(gpupool_buffer_share_kept_many_nowait(&b, 1, NULL, &tok[i]), 0);
  for (int i = 0; i < N; i++) {
    if (gpupool_buffer_open_many(r, &tok[i], 1, 0, NULL, &o) != 0)
      fail_msg("token %d: %s", i, gpupool_last_error());
    assert_int_equal(*(const unsigned char *)gpupool_buffer_ptr(o), 0x11);
    assert_int_equal(gpupool_buffer_release(o, NULL), 0);
  }
  assert_int_equal(gpupool_client_nowait_failures(m, NULL, 0), 0);
  assert_int_equal(gpupool_buffer_release(b, NULL), 0);
  gpupool_client_disconnect(r);
  gpupool_client_disconnect(m);
  free(tok);
}

int main(void) {
  return TS_RUN_TESTS(NULL, teardown, test_maker_exits_at_once, test_open_read_first_waits_for_the_share,
                      test_maker_gone_without_sharing, test_open_waits_at_most_open_wait_ms,
                      test_made_up_token_waits_then_fails, test_waiting_opens_are_bounded, test_failed_share_is_told,
                      test_many_in_a_row);
}
