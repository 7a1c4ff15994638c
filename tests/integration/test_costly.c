/*
 * Requests built to cost the daemon more than their bytes: member names made to collide in
 * an unseeded hash, frames of thousands of unknown fields, strings protobuf-c would cut at a
 * NUL or that are not UTF-8, and member tables past the daemon-wide member limit. Each attack
 * runs from another uid (nobody, when the tests run as root, as CI does) over raw frames; the
 * daemon must refuse it (or do it at the cost of its bytes) and keep answering everyone else.
 */
#include <inttypes.h>
#include <sys/stat.h>

#include "harness.h"
#include "raw.h"

static th_daemon D;

/* A daemon on a socket every uid can reach, with the given [daemon] lines. */
static void start_with(const char *daemon_lines) {
  th_start_shared(&D, daemon_lines, TH_HOST_POOL("256M", "64M"));
}

static int teardown(void **state) {
  (void)state;
  th_stop(&D);
  return 0;
}

/* Connect and say Hello: the socket, or -1. No cmocka here: children use it too. */
static int session(int timeout_s) { return ts_raw_session(D.sock, timeout_s, "costly", 0); }

/* The reply to a request: its error code (0 when it succeeded), or 1 when none came. The
 * message goes to msg (may be NULL); *hold gets the first hold id of an allocation. */
static int reply_of(int fd, uint64_t seq, char *msg, size_t n, uint64_t *hold) {
  gpupool__rep *rep = th_raw_recv(fd);
  int rc;
  if (!rep)
    return 1;
  rc = rep->error ? rep->error->code : 0;
  if (rep->seq != seq)
    fprintf(stderr, "reply for seq %" PRIu64 " came as seq %" PRIu64 "\n", seq, rep->seq);
  if (msg)
    snprintf(msg, n, "%s", rep->error && rep->error->message ? rep->error->message : "");
  if (hold && rep->body_case == GPUPOOL__WIRE__REPLY__BODY_ALLOCATE && rep->allocate->buffer)
    *hold = rep->allocate->buffer->hold_id;
  if (hold && rep->body_case == GPUPOOL__WIRE__REPLY__BODY_ALLOCATE_BUNDLE && rep->allocate_bundle->bundle &&
      rep->allocate_bundle->bundle->n_buffers)
    *hold = rep->allocate_bundle->bundle->buffers[0]->hold_id;
  rc = rep->seq == seq ? rc : 1;
  gpupool__wire__reply__free_unpacked(rep, NULL);
  return rc;
}

static int stats_answered(int fd, uint64_t seq) {
  return th_raw_send_stats(fd, seq, NULL, 0) == 0 && reply_of(fd, seq, NULL, 0, NULL) == 0;
}

/* Send an AllocateBundle of n one-byte members named names[i]. */
static int send_bundle(int fd, uint64_t seq, char **names, size_t n) {
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__AllocateBundle ab = GPUPOOL__WIRE__ALLOCATE_BUNDLE__INIT;
  Gpupool__Wire__MemberSpec *specs = calloc(n, sizeof *specs), **ptrs = calloc(n, sizeof *ptrs);
  int rc;
  if (!specs || !ptrs)
    return -1;
  for (size_t i = 0; i < n; i++) {
    gpupool__wire__member_spec__init(&specs[i]);
    specs[i].name = names[i];
    specs[i].size = 1;
    ptrs[i] = &specs[i];
  }
  ab.n_members = n;
  ab.members = ptrs;
  req.seq = seq;
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_ALLOCATE_BUNDLE;
  req.allocate_bundle = &ab;
  rc = th_raw_send(fd, &req, NULL, 0);
  free(specs);
  free(ptrs);
  return rc;
}

/* ---- member names that collide in FNV-1a --------------------------------------------------- */

#define FLOOD_N 65536
#define FLOOD_BITS 17 /* the uniqueness check's table: the power of two >= 2n */
#define FNV_PRIME 0x100000001b3ull
/* Long: every comparison of a probe reads it. */
#define FLOOD_PREFIX "flooding-the-member-set-flooding-the-member-set-"

/* FLOOD_N distinct printable names whose FNV-1a hashes, as the uniqueness check computed them
 * (from 1469598103934665603, not FNV's usual offset basis), agree in their low FLOOD_BITS bits.
 * FNV-1a's low k bits depend only on the input's low bits, so the last two bytes can be
 * chosen to land any prefix on one value: b1 walks the printable range, and b2 is whatever
 * makes the state before the last multiply equal a fixed U. */
static char **colliding_names(void) {
  const uint64_t mask = (1ull << FLOOD_BITS) - 1, U = 0x15a5a & mask;
  char **names = calloc(FLOOD_N, sizeof *names);
  size_t n = 0;
  if (!names)
    return NULL;
  for (uint32_t ctr = 0; n < FLOOD_N; ctr++) {
    char name[sizeof FLOOD_PREFIX + 8];
    uint64_t s = 1469598103934665603ull;
    int len = snprintf(name, sizeof name, FLOOD_PREFIX "%c%c%c%c", 0x21 + ctr % 94, 0x21 + ctr / 94 % 94,
                       0x21 + ctr / (94 * 94) % 94, 0x21 + ctr / (94 * 94 * 94) % 94);
    for (int i = 0; i < len; i++)
      s = (s ^ (uint8_t)name[i]) * FNV_PRIME;
    for (unsigned b1 = 0x21; b1 <= 0x7e && n < FLOOD_N; b1++) {
      uint64_t v = ((s ^ b1) * FNV_PRIME) & mask, b2 = v ^ U;
      if (b2 < 0x21 || b2 > 0x7e)
        continue;
      name[len] = (char)b1;
      name[len + 1] = (char)b2;
      name[len + 2] = '\0';
      if (!(names[n++] = strdup(name)))
        return NULL;
    }
  }
  return names;
}

/* Child: as nobody, send the colliding table, say so on ready_fd, then wait for the answer
 * (whatever it is). */
static int flood_members(const th_daemon *d, int ready_fd) {
  char **names = colliding_names();
  int fd, rc;
  (void)d;
  CHILD_CHECK(names != NULL, "out of memory");
  CHILD_CHECK(th_become(NOBODY) == 0, "cannot become uid %d", NOBODY);
  CHILD_CHECK((fd = session(120)) >= 0, "no session");
  CHILD_CHECK(send_bundle(fd, 2, names, FLOOD_N) == 0, "send");
  CHILD_CHECK(write(ready_fd, "x", 1) == 1, "ready");
  rc = reply_of(fd, 2, NULL, 0, NULL);
  CHILD_CHECK(rc != 1, "no answer to the bundle within 120 s");
  close(fd);
  return 0;
}

static void test_member_name_flood(void **state) {
  int p[2], fd;
  char c;
  pid_t pid;
  uint64_t t0, waited;
  (void)state;
  /* The colliding table is a 3 MiB frame: let it in, to see what it costs once it is. */
  start_with("max_frame = 8M\n");
  assert_int_equal(pipe(p), 0);
  pid = th_spawn(&D, flood_members, p[1]);
  close(p[1]);
  assert_int_equal(read(p[0], &c, 1), 1);
  close(p[0]);
  /* While the daemon works on it, another client (root) asks for its Stats. */
  t0 = th_now_ms();
  fd = session(30);
  assert_true(fd >= 0);
  assert_true(stats_answered(fd, 2));
  waited = th_now_ms() - t0;
  close(fd);
  th_wait_ok(pid, "member-name flood");
  if (waited > 10000)
    fail_msg("another client's Stats waited %" PRIu64 " ms behind one table of colliding member names",
             waited);
}

/* ---- unknown fields ------------------------------------------------------------------------- */

/* A Stats request numbered seq followed by `unknown` one-byte varint fields numbered 1000
 * (no message of the protocol has one), as one frame. */
static int send_stats_unknown(int fd, uint64_t seq, size_t unknown) {
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__Stats st = GPUPOOL__WIRE__STATS__INIT;
  uint8_t *buf, *big;
  size_t len, plen;
  int rc;
  req.seq = seq;
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_STATS;
  req.stats = &st;
  if (gpupool__wire_pack_request(&req, &buf, &len) != 0)
    return -1;
  big = malloc(len + 3 * unknown);
  if (!big) {
    free(buf);
    return -1;
  }
  memcpy(big, buf, len);
  for (size_t i = 0; i < unknown; i++) {
    big[len + 3 * i] = 0xc0; /* key (1000 << 3 | 0) as a varint: 0xc0 0x3e */
    big[len + 3 * i + 1] = 0x3e;
    big[len + 3 * i + 2] = 0x01;
  }
  plen = len - GPUPOOL_WIRE_HDR + 3 * unknown;
  big[0] = (uint8_t)plen;
  big[1] = (uint8_t)(plen >> 8);
  big[2] = (uint8_t)(plen >> 16);
  big[3] = (uint8_t)(plen >> 24);
  rc = gpupool__wire_send(fd, big, len + 3 * unknown, NULL, 0);
  free(buf);
  free(big);
  return rc;
}

static int unknown_fields_child(const th_daemon *d, int arg) {
  char msg[512];
  int fd, other, rc;
  (void)d;
  (void)arg;
  CHILD_CHECK(th_become(NOBODY) == 0, "cannot become uid %d", NOBODY);
  CHILD_CHECK((fd = session(10)) >= 0, "no session");
  /* Thousands of fields nobody knows: refused before decoding, naming the limit, and the
   * reply answers the request it refuses. */
  CHILD_CHECK(send_stats_unknown(fd, 7, 100000) == 0, "send");
  rc = reply_of(fd, 7, msg, sizeof msg, NULL);
  CHILD_CHECK(rc == GPUPOOL_EPROTO, "100000 unknown fields: got %d (%s)", rc, msg);
  CHILD_CHECK(strstr(msg, "more than 64 fields") != NULL, "message: %s", msg);
  /* The connection still works, and so does everyone else's. */
  CHILD_CHECK(stats_answered(fd, 8), "the next well-formed request went unanswered");
  CHILD_CHECK((other = session(10)) >= 0, "no second session");
  CHILD_CHECK(stats_answered(other, 2), "another connection went unanswered");
  close(other);
  /* A few fields of a newer release are skipped, as protobuf promises. */
  CHILD_CHECK(send_stats_unknown(fd, 9, 3) == 0, "send");
  rc = reply_of(fd, 9, msg, sizeof msg, NULL);
  CHILD_CHECK(rc == 0, "3 unknown fields: got %d (%s)", rc, msg);
  CHILD_CHECK(send_stats_unknown(fd, 10, 64) == 0, "send");
  rc = reply_of(fd, 10, msg, sizeof msg, NULL);
  CHILD_CHECK(rc == 0, "64 unknown fields: got %d (%s)", rc, msg);
  CHILD_CHECK(send_stats_unknown(fd, 11, 65) == 0, "send");
  rc = reply_of(fd, 11, msg, sizeof msg, NULL);
  CHILD_CHECK(rc == GPUPOOL_EPROTO, "65 unknown fields: got %d (%s)", rc, msg);
  close(fd);
  return 0;
}

static void test_unknown_fields(void **state) {
  (void)state;
  start_with("");
  th_wait_ok(th_spawn(&D, unknown_fields_child, 0), "unknown fields");
}

/* ---- strings: NUL and UTF-8 ----------------------------------------------------------------- */

/* Publish hold under name, where every '#' of name is sent as a NUL byte (protobuf-c packs a
 * C string, so the NUL is patched into the packed frame). The reply's code; message in msg. */
static int publish_raw(int fd, uint64_t seq, uint64_t hold, const char *name, char *msg, size_t n) {
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__Publish pb = GPUPOOL__WIRE__PUBLISH__INIT;
  uint8_t *buf, *at;
  size_t len, nlen = strlen(name);
  int rc;
  pb.hold_id = hold;
  pb.name = (char *)name;
  req.seq = seq;
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_PUBLISH;
  req.publish = &pb;
  if (gpupool__wire_pack_request(&req, &buf, &len) != 0)
    return 1;
  at = memmem(buf, len, name, nlen);
  for (size_t i = 0; at && i < nlen; i++)
    if (at[i] == '#')
      at[i] = '\0';
  rc = gpupool__wire_send(fd, buf, len, NULL, 0);
  free(buf);
  return rc != 0 ? 1 : reply_of(fd, seq, msg, n, NULL);
}

static int get_raw(int fd, uint64_t seq, const char *name) {
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__Get g = GPUPOOL__WIRE__GET__INIT;
  g.name = (char *)name;
  req.seq = seq;
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_GET;
  req.get = &g;
  return th_raw_send(fd, &req, NULL, 0) == 0 ? reply_of(fd, seq, NULL, 0, NULL) : 1;
}

static int strings_child(const th_daemon *d, int arg) {
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__Allocate al = GPUPOOL__WIRE__ALLOCATE__INIT;
  char msg[512], *names[2];
  uint64_t hold = 0;
  int fd, rc;
  (void)d;
  (void)arg;
  CHILD_CHECK(th_become(NOBODY) == 0, "cannot become uid %d", NOBODY);
  CHILD_CHECK((fd = session(10)) >= 0, "no session");
  al.size = 4096;
  req.seq = 2;
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_ALLOCATE;
  req.allocate = &al;
  CHILD_CHECK(th_raw_send(fd, &req, NULL, 0) == 0, "send");
  CHILD_CHECK((rc = reply_of(fd, 2, msg, sizeof msg, &hold)) == 0 && hold, "allocate: %d %s", rc, msg);
  /* "nul\0tail" is refused, naming the field, and nothing is published as "nul". */
  rc = publish_raw(fd, 3, hold, "nul#tail", msg, sizeof msg);
  CHILD_CHECK(rc == GPUPOOL_EINVAL, "publish of nul\\0tail: got %d (%s)", rc, msg);
  CHILD_CHECK(strstr(msg, "Request.publish.name") && strstr(msg, "NUL"), "message: %s", msg);
  rc = get_raw(fd, 4, "nul");
  CHILD_CHECK(rc == GPUPOOL_ENOENT, "get of 'nul' after the refused publish: got %d", rc);
  /* Invalid UTF-8 (a lone continuation byte, an overlong '/') is refused the same way. */
  rc = publish_raw(fd, 5, hold, "bad\x80name", msg, sizeof msg);
  CHILD_CHECK(rc == GPUPOOL_EINVAL && strstr(msg, "Request.publish.name") && strstr(msg, "UTF-8"),
              "publish of invalid UTF-8: got %d (%s)", rc, msg);
  rc = publish_raw(fd, 6, hold, "over\xc0\xaflong", msg, sizeof msg);
  CHILD_CHECK(rc == GPUPOOL_EINVAL, "publish of an overlong form: got %d (%s)", rc, msg);
  /* So is a member name inside a bundle, named down to the member's field. */
  names[0] = "a";
  names[1] = "b\xff";
  CHILD_CHECK(send_bundle(fd, 7, names, 2) == 0, "send");
  rc = reply_of(fd, 7, msg, sizeof msg, NULL);
  CHILD_CHECK(rc == GPUPOOL_EINVAL && strstr(msg, "Request.allocate_bundle.members.name"),
              "bundle with an invalid member name: got %d (%s)", rc, msg);
  /* Valid UTF-8 beyond ASCII is a name like any other, and the connection still serves. */
  rc = publish_raw(fd, 8, hold, "gr\xc3\xbc\xc3\x9f-\xe2\x82\xac", msg, sizeof msg);
  CHILD_CHECK(rc == 0, "publish of a UTF-8 name: got %d (%s)", rc, msg);
  CHILD_CHECK(stats_answered(fd, 9), "stats after the refusals");
  close(fd);
  return 0;
}

static void test_strings(void **state) {
  (void)state;
  start_with("");
  th_wait_ok(th_spawn(&D, strings_child, 0), "strings");
}

/* ---- the daemon-wide member limit ----------------------------------------------------------- */

static char **numbered_names(const char *prefix, size_t n) {
  char **names = calloc(n, sizeof *names);
  for (size_t i = 0; names && i < n; i++) {
    char b[32];
    snprintf(b, sizeof b, "%s%zu", prefix, i);
    if (!(names[i] = strdup(b)))
      return NULL;
  }
  return names;
}

/* Child, as nobody: a 60-member bundle. arg 0: refused by max_members (not the per-uid
 * limit); arg 1: accepted, within 5 s (the memory of a client that hung up comes back
 * asynchronously). */
static int member_cap_child(const th_daemon *d, int arg) {
  char **names = numbered_names("n", 60), msg[512];
  int fd, rc = 1;
  uint64_t end = th_now_ms() + 5000;
  (void)d;
  CHILD_CHECK(names != NULL, "out of memory");
  CHILD_CHECK(th_become(NOBODY) == 0, "cannot become uid %d", NOBODY);
  CHILD_CHECK((fd = session(10)) >= 0, "no session");
  for (uint64_t seq = 2;; seq++) {
    CHILD_CHECK(send_bundle(fd, seq, names, 60) == 0, "send");
    rc = reply_of(fd, seq, msg, sizeof msg, NULL);
    if (arg == 0 || rc == 0 || th_now_ms() > end)
      break;
    th_sleep_ms(20);
  }
  if (arg == 0)
    CHILD_CHECK(rc == GPUPOOL_ELIMIT && strstr(msg, "(max_members)"), "got %d (%s)", rc, msg);
  else
    CHILD_CHECK(rc == 0, "still refused after the other uid hung up: %d (%s)", rc, msg);
  close(fd);
  return 0;
}

static void test_member_cap(void **state) {
  char **names = numbered_names("r", 60), msg[512];
  int fd;
  (void)state;
  assert_non_null(names);
  /* Each uid's own budget is far above what either asks for; the daemon's is not. */
  start_with("max_members = 100\nmax_members_per_uid = 1000\n");
  fd = session(10);
  assert_true(fd >= 0);
  assert_int_equal(send_bundle(fd, 2, names, 60), 0);
  if (reply_of(fd, 2, msg, sizeof msg, NULL) != 0)
    fail_msg("root's 60 members: %s", msg);
  th_wait_ok(th_spawn(&D, member_cap_child, 0), "nobody's members while root holds 60");
  assert_true(stats_answered(fd, 3));
  close(fd); /* root hangs up: its table goes */
  th_wait_ok(th_spawn(&D, member_cap_child, 1), "nobody's members after root hung up");
  for (int i = 0; i < 60; i++)
    free(names[i]);
  free(names);
}

int main(void) {
  return TS_RUN_TESTS(NULL, teardown, test_member_name_flood, test_unknown_fields, test_strings, test_member_cap);
}
