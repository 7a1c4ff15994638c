/*
 * A hostile client: raw frames straight onto the daemon's socket. Each kind of bad input must
 * get a clear error reply (and a disconnect for protocol violations), and afterwards the
 * daemon must still serve a well-formed request, with no fd, byte or registry entry leaked.
 */
#include <sys/mman.h>

#include "harness.h"
#include "raw.h"

static th_daemon D;
static uint64_t base_fds;

static int setup(void **state) {
  (void)state;
  th_prepare(&D);
  th_write_conf(&D, "[daemon]\nhandshake_timeout_ms = 300\nmax_frame = 65536\n"
                    "[pool default]\nkind = host\ncapacity = 64M\nslab_size = 4M\n");
  th_start(&D, 1, NULL);
  base_fds = th_settled_fds(&D);
  return 0;
}

static void still_serves(void) {
  gpupool_client *c = th_connect(&D, "good");
  gpupool_buffer *b;
  assert_int_equal(gpupool_buffer_alloc(c, NULL, 1000, 0, NULL, &b), 0);
  memset(gpupool_buffer_ptr(b), 7, 1000);
  assert_int_equal(gpupool_buffer_release(b, NULL), 0);
  gpupool_client_disconnect(c);
}

static int teardown(void **state) {
  (void)state;
  still_serves();
  th_wait_idle(&D, 2000);
  th_expect_fds(&D, base_fds);
  th_stop(&D);
  return 0;
}

static int raw_connect(void) {
  int fd = th_raw_connect(D.sock, 5);
  assert_true(fd >= 0);
  return fd;
}

static void raw_send(int fd, gpupool__req *req, const int *fds, int nfds) {
  assert_int_equal(th_raw_send(fd, req, fds, nfds), 0);
}

#define raw_recv th_raw_recv

static void expect_error(int fd, int code, const char *needle) {
  gpupool__rep *rep = raw_recv(fd);
  assert_non_null(rep);
  assert_non_null(rep->error);
  if (rep->error->code != code)
    fail_msg("expected %s, got %s: %s", gpupool_err_name(code), gpupool_err_name(rep->error->code),
             rep->error->message);
  if (needle && !strstr(rep->error->message, needle))
    fail_msg("error message '%s' does not mention '%s'", rep->error->message, needle);
  gpupool__wire__reply__free_unpacked(rep, NULL);
}

/* The daemon hung up: end of stream, or ECONNRESET where it closed with bytes of ours unread
 * (it reads a connection a budget at a time, in its uid's turn). */
static void expect_eof(int fd) {
  char c;
  ssize_t n = recv(fd, &c, 1, 0);
  if (n < 0 && errno == ECONNRESET)
    n = 0;
  assert_int_equal(n, 0);
}

/* The error reply, then the daemon hangs up: what a peer it will not go on serving gets. */
static void expect_dropped(int fd, int code, const char *needle) {
  expect_error(fd, code, needle);
  expect_eof(fd);
  close(fd);
}

static void hello(int fd, uint32_t version) {
  gpupool__req req;
  Gpupool__Wire__Hello h;
  ts_hello(&req, &h, version, "hostile", 0);
  raw_send(fd, &req, NULL, 0);
}

static void hello_ok(int fd) {
  gpupool__rep *rep;
  hello(fd, GPUPOOL__WIRE__VERSION__PROTOCOL_VERSION);
  rep = raw_recv(fd);
  assert_non_null(rep);
  assert_null(rep->error);
  assert_int_equal(rep->body_case, GPUPOOL__WIRE__REPLY__BODY_HELLO);
  gpupool__wire__reply__free_unpacked(rep, NULL);
}

static void send_stats(int fd, uint64_t seq) { assert_int_equal(th_raw_send_stats(fd, seq, NULL, 0), 0); }

static void expect_stats(int fd) {
  gpupool__rep *rep = raw_recv(fd);
  assert_non_null(rep);
  assert_null(rep->error);
  assert_int_equal(rep->body_case, GPUPOOL__WIRE__REPLY__BODY_STATS);
  gpupool__wire__reply__free_unpacked(rep, NULL);
}

/* Send req and return its reply, which must be a success (the caller frees it). */
static gpupool__rep *call_ok(int fd, gpupool__req *req) {
  gpupool__rep *rep;
  raw_send(fd, req, NULL, 0);
  rep = raw_recv(fd);
  assert_non_null(rep);
  if (rep->error)
    fail_msg("expected success, got %s: %s", gpupool_err_name(rep->error->code), rep->error->message);
  return rep;
}

/* After what the daemon refused, the connection carries on: a Stats (seq) is answered. */
static void still_answers(int fd, uint64_t seq) {
  send_stats(fd, seq);
  expect_stats(fd);
}

static void test_garbage_frame(void **state) {
  uint8_t frame[4 + 16] = {16, 0, 0, 0};
  int fd = raw_connect();
  (void)state;
  hello_ok(fd);
  memset(frame + 4, 0xff, 16); /* not a protobuf message */
  assert_int_equal(gpupool__wire_send(fd, frame, sizeof frame, NULL, 0), 0);
  expect_dropped(fd, GPUPOOL_EPROTO, "malformed");
}

static void test_oversized_frame(void **state) {
  uint8_t hdr[4] = {0, 0, 0, 0x10}; /* 256 MiB */
  int fd = raw_connect();
  (void)state;
  hello_ok(fd);
  assert_int_equal(gpupool__wire_send(fd, hdr, sizeof hdr, NULL, 0), 0);
  expect_dropped(fd, GPUPOOL_EPROTO, "exceeds");
}

static void test_wrong_version(void **state) {
  int fd = raw_connect();
  (void)state;
  hello(fd, 999);
  expect_dropped(fd, GPUPOOL_EVERSION, "protocol version 999");
}

static void test_request_before_hello(void **state) {
  int fd = raw_connect();
  (void)state;
  send_stats(fd, 5);
  expect_dropped(fd, GPUPOOL_EPROTO, "Hello");
}

static void test_unknown_request_type(void **state) {
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  int fd = raw_connect();
  (void)state;
  hello_ok(fd);
  req.seq = 2; /* no body: what an unknown message type unpacks to */
  raw_send(fd, &req, NULL, 0);
  expect_error(fd, GPUPOOL_EPROTO, "unknown request type");
  still_answers(fd, 3);
  close(fd);
}

static void test_unexpected_fds(void **state) {
  int fd = raw_connect(), mfd = memfd_create("junk", MFD_CLOEXEC);
  int fds[3];
  (void)state;
  hello_ok(fd);
  for (int i = 0; i < 3; i++)
    fds[i] = mfd;
  assert_int_equal(th_raw_send_stats(fd, 9, fds, 3), 0);
  expect_error(fd, GPUPOOL_EFD, "file descriptors");
  still_answers(fd, 10);
  close(mfd);
  close(fd);
}

static void test_bad_ids_and_requests(void **state) {
  gpupool_client *a = th_connect(&D, "a");
  gpupool_buffer *b;
  int fd = raw_connect();
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__Release rl = GPUPOOL__WIRE__RELEASE__INIT;
  Gpupool__Wire__Allocate al = GPUPOOL__WIRE__ALLOCATE__INIT;
  Gpupool__Wire__Get gt = GPUPOOL__WIRE__GET__INIT;
  Gpupool__Wire__AttachPool ap = GPUPOOL__WIRE__ATTACH_POOL__INIT;
  char longname[300];
  (void)state;

  hello_ok(fd);
  /* Unknown hold. */
  rl.hold_id = 123456789;
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_RELEASE;
  req.release = &rl;
  raw_send(fd, &req, NULL, 0);
  expect_error(fd, GPUPOOL_ENOENT, "does not exist");
  /* Another client's hold: ids are small integers, so try the ones around a's buffer. */
  assert_int_equal(gpupool_buffer_alloc(a, NULL, 100, 0, NULL, &b), 0);
  for (uint64_t id = 1; id < 64; id++) {
    gpupool__rep *rep;
    rl.hold_id = id;
    raw_send(fd, &req, NULL, 0);
    rep = raw_recv(fd);
    assert_non_null(rep);
    assert_non_null(rep->error); /* never succeeds: we hold nothing */
    assert_true(rep->error->code == GPUPOOL_ENOENT || rep->error->code == GPUPOOL_EPERM);
    gpupool__wire__reply__free_unpacked(rep, NULL);
  }
  memset(gpupool_buffer_ptr(b), 1, 100); /* a's buffer is untouched by all that */
  assert_int_equal(gpupool_buffer_release(b, NULL), 0);
  /* Zero size, bigger than the pool, unknown pool. */
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_ALLOCATE;
  req.allocate = &al;
  al.size = 0;
  raw_send(fd, &req, NULL, 0);
  expect_error(fd, GPUPOOL_EINVAL, "0 bytes");
  al.size = 1ull << 30;
  raw_send(fd, &req, NULL, 0);
  expect_error(fd, GPUPOOL_ETOOBIG, "capacity");
  al.size = 10;
  al.pool_name = (char *)"missing";
  raw_send(fd, &req, NULL, 0);
  expect_error(fd, GPUPOOL_ENOENT, "missing");
  al.pool_name = (char *)"";
  al.alignment = 3;
  raw_send(fd, &req, NULL, 0);
  expect_error(fd, GPUPOOL_EINVAL, "power of two");
  /* Names: too long, empty, control characters. */
  memset(longname, 'x', sizeof longname - 1);
  longname[sizeof longname - 1] = '\0';
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_GET;
  req.get = &gt;
  gt.name = longname;
  raw_send(fd, &req, NULL, 0);
  expect_error(fd, GPUPOOL_ENAME, "longer than");
  gt.name = (char *)"";
  raw_send(fd, &req, NULL, 0);
  expect_error(fd, GPUPOOL_ENAME, "empty");
  gt.name = (char *)"bad\nname";
  raw_send(fd, &req, NULL, 0);
  expect_error(fd, GPUPOOL_ENAME, "control");
  /* Unknown pool to attach. */
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_ATTACH_POOL;
  req.attach_pool = &ap;
  ap.pool_id = 77;
  raw_send(fd, &req, NULL, 0);
  expect_error(fd, GPUPOOL_ENOENT, "77");
  /* A token of the wrong size. */
  {
    Gpupool__Wire__Open op = GPUPOOL__WIRE__OPEN__INIT;
    uint8_t t[5] = {0};
    op.token.data = t;
    op.token.len = sizeof t;
    req.body_case = GPUPOOL__WIRE__REQUEST__BODY_OPEN;
    req.open = &op;
    raw_send(fd, &req, NULL, 0);
    expect_error(fd, GPUPOOL_EINVAL, "token");
  }
  /* Admin requests from a normal uid are refused only for non-root; as root they work. */
  still_answers(fd, 99);
  close(fd);
  gpupool_client_disconnect(a);
}

/* One Release naming many holds: a repeated, unknown or foreign one among them is refused and
 * drops nothing twice; the holds of the sender's own that it names go, the others stay. */
static void test_release_of_many_bad_ids(void **state) {
  gpupool_client *a = th_connect(&D, "a");
  gpupool_buffer *b;
  gpupool_daemon_stats ds;
  int fd = raw_connect();
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__Release rl = GPUPOOL__WIRE__RELEASE__INIT;
  Gpupool__Wire__Allocate al = GPUPOOL__WIRE__ALLOCATE__INIT;
  uint64_t mine[3], more[4];
  protobuf_c_boolean rec[4] = {0};
  (void)state;

  hello_ok(fd);
  assert_int_equal(gpupool_buffer_alloc(a, NULL, 100, 0, NULL, &b), 0);
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_ALLOCATE;
  req.allocate = &al;
  al.size = 4096;
  for (int i = 0; i < 3; i++) {
    gpupool__rep *rep = call_ok(fd, &req);
    mine[i] = rep->allocate->buffer->hold_id;
    gpupool__wire__reply__free_unpacked(rep, NULL);
  }
  th_stats(&D, &ds, NULL);
  assert_int_equal(ds.holds, 4);
  /* mine[0], then mine[0] again, a hold that does not exist, a's hold (id 1..: the first one
   * that is not ours), and mine[1]. */
  more[0] = mine[0];
  more[1] = 987654321;
  more[2] = mine[0] == 1 || mine[1] == 1 || mine[2] == 1 ? 2 : 1;
  more[3] = mine[1];
  if (more[2] == mine[0] || more[2] == mine[1] || more[2] == mine[2])
    more[2] = 3;
  rl.hold_id = mine[0];
  rl.n_more_hold_ids = 4;
  rl.more_hold_ids = more;
  rl.n_more_done_recorded = 4;
  rl.more_done_recorded = rec;
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_RELEASE;
  req.release = &rl;
  raw_send(fd, &req, NULL, 0);
  expect_error(fd, GPUPOOL_ENOENT, "does not exist");
  th_stats(&D, &ds, NULL);
  assert_int_equal(ds.holds, 2); /* a's and mine[2] */
  memset(gpupool_buffer_ptr(b), 1, 100);
  still_answers(fd, 77);
  /* The rest, in one request. */
  rl.hold_id = mine[2];
  rl.n_more_hold_ids = rl.n_more_done_recorded = 0;
  gpupool__wire__reply__free_unpacked(call_ok(fd, &req), NULL);
  th_stats(&D, &ds, NULL);
  assert_int_equal(ds.holds, 1);
  assert_int_equal(gpupool_buffer_release(b, NULL), 0);
  gpupool_client_disconnect(a);
  close(fd);
}

static void test_eof_mid_frame_and_silence(void **state) {
  uint8_t partial[6] = {100, 0, 0, 0, 1, 2};
  int fd = raw_connect(), quiet = raw_connect();
  (void)state;
  hello_ok(fd);
  assert_int_equal(gpupool__wire_send(fd, partial, sizeof partial, NULL, 0), 0);
  close(fd); /* EOF in the middle of a frame */
  /* A client that never says Hello is dropped after handshake_timeout_ms. */
  expect_eof(quiet);
  close(quiet);
}

static void test_double_release_via_library(void **state) {
  gpupool_client *a = th_connect(&D, "a"), *b = th_connect(&D, "b");
  gpupool_buffer *x;
  gpupool_token tok;
  int fd = raw_connect();
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__Open op = GPUPOOL__WIRE__OPEN__INIT;
  Gpupool__Wire__Release rl = GPUPOOL__WIRE__RELEASE__INIT;
  gpupool__rep *rep;
  uint64_t hold;
  (void)state;

  hello_ok(fd);
  assert_int_equal(gpupool_buffer_alloc(a, NULL, 4096, 0, NULL, &x), 0);
  assert_int_equal(gpupool_buffer_share(x, NULL, &tok), 0);
  /* The raw client opens the buffer and releases its hold twice. */
  op.token.data = tok.bytes;
  op.token.len = sizeof tok.bytes;
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_OPEN;
  req.open = &op;
  rep = call_ok(fd, &req);
  hold = rep->open->buffer->hold_id;
  gpupool__wire__reply__free_unpacked(rep, NULL);
  rl.hold_id = hold;
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_RELEASE;
  req.release = &rl;
  gpupool__wire__reply__free_unpacked(call_ok(fd, &req), NULL);
  raw_send(fd, &req, NULL, 0);
  expect_error(fd, GPUPOOL_ENOENT, "already released");
  /* The owner's buffer is still alive and intact. */
  memset(gpupool_buffer_ptr(x), 3, 4096);
  assert_int_equal(gpupool_buffer_release(x, NULL), 0);
  close(fd);
  gpupool_client_disconnect(a);
  gpupool_client_disconnect(b);
}

/* A Publish with share_gid or share_all set (fields 5 and 6, reserved since the library
 * stopped sending them; an old client's) is refused, not read as a plain publish: its
 * readers would get the slab of the publisher's other buffers. Zero, as an old client sends
 * for "not shared", is a plain publish. */
static void test_publish_shares_refused(void **state) {
  int fd = raw_connect();
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__Allocate al = GPUPOOL__WIRE__ALLOCATE__INIT;
  Gpupool__Wire__Publish pb = GPUPOOL__WIRE__PUBLISH__INIT;
  Gpupool__Wire__Unpublish up = GPUPOOL__WIRE__UNPUBLISH__INIT;
  uint8_t one = 1, gid[2] = {0xe8, 0x07} /* 1000 */, zero = 0;
  ProtobufCMessageUnknownField uf = {.wire_type = PROTOBUF_C_WIRE_TYPE_VARINT};
  gpupool__rep *rep;
  (void)state;

  hello_ok(fd);
  al.pool_name = (char *)"";
  al.size = 4096;
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_ALLOCATE;
  req.allocate = &al;
  rep = call_ok(fd, &req);
  pb.hold_id = rep->allocate->buffer->hold_id;
  gpupool__wire__reply__free_unpacked(rep, NULL);
  pb.name = (char *)"shared";
  pb.base.n_unknown_fields = 1;
  pb.base.unknown_fields = &uf;
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_PUBLISH;
  req.publish = &pb;
  uf.tag = 6; /* share_all = true */
  uf.len = 1;
  uf.data = &one;
  raw_send(fd, &req, NULL, 0);
  expect_error(fd, GPUPOOL_EINVAL, "share_gid/share_all");
  uf.tag = 5; /* share_gid = 1000 */
  uf.len = sizeof gid;
  uf.data = gid;
  raw_send(fd, &req, NULL, 0);
  expect_error(fd, GPUPOOL_EINVAL, "share_gid/share_all");
  uf.tag = 6; /* share_all = false */
  uf.len = 1;
  uf.data = &zero;
  gpupool__wire__reply__free_unpacked(call_ok(fd, &req), NULL);
  up.name = (char *)"shared";
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_UNPUBLISH;
  req.unpublish = &up;
  gpupool__wire__reply__free_unpacked(call_ok(fd, &req), NULL);
  close(fd);
}

int main(void) {
  return TS_RUN_TESTS(setup, teardown, test_garbage_frame, test_oversized_frame, test_wrong_version,
                      test_request_before_hello, test_unknown_request_type, test_unexpected_fds,
                      test_bad_ids_and_requests, test_release_of_many_bad_ids, test_eof_mid_frame_and_silence,
                      test_double_release_via_library,
                      test_publish_shares_refused);
}
