/*
 * Names through the client library: the library refuses a name the daemon would (not UTF-8,
 * control characters) before anything is sent, with GPUPOOL_ENAME and a message that names
 * the member, said once. The daemon's own refusals of raw frames are in test_costly.c.
 */
#include "harness.h"

static th_daemon D;

static int setup(void **state) {
  th_start_conf(&D, "[pool default]\nkind = host\ncapacity = 64M\nslab_size = 4M\n");
  *state = &D;
  return 0;
}

static void test_local_refusals(void **state) {
  gpupool_client *c = th_connect(&D, "names");
  gpupool_buffer *b, *got;
  gpupool_bundle *bundle;
  gpupool_member_spec specs[2] = {{.name = "ok", .size = 8}, {.name = "m\xc0\xaf", .size = 8}};
  (void)state;
  assert_int_equal(gpupool_buffer_alloc(c, NULL, 4096, 0, NULL, &b), 0);
  /* Not UTF-8: a lone byte past ASCII, an overlong form, a UTF-16 surrogate. The daemon would
   * say EINVAL naming the wire field; ENAME is the library's own check. */
  assert_int_equal(gpupool_buffer_publish(b, "bad\xff", NULL, NULL, NULL), GPUPOOL_ENAME);
  assert_string_equal(gpupool_last_error(), "name is not valid UTF-8 (at byte 3); names are UTF-8 text");
  assert_int_equal(gpupool_buffer_publish(b, "over\xc0\xaflong", NULL, NULL, NULL), GPUPOOL_ENAME);
  assert_int_equal(gpupool_buffer_publish(b, "half\xed\xa0\x80", NULL, NULL, NULL), GPUPOOL_ENAME);
  assert_int_equal(gpupool_buffer_get(c, "bad\xff", 0, 0, 0, NULL, &got, NULL), GPUPOOL_ENAME);
  /* A member's name: the message names the member once. */
  assert_int_equal(gpupool_bundle_alloc(c, NULL, specs, 2, 0, 0, NULL, &bundle), GPUPOOL_ENAME);
  assert_string_equal(gpupool_last_error(), "member 1: name is not valid UTF-8 (at byte 1); names are UTF-8 text");
  specs[1].name = "a\x01";
  assert_int_equal(gpupool_bundle_alloc(c, NULL, specs, 2, 0, 0, NULL, &bundle), GPUPOOL_ENAME);
  assert_string_equal(gpupool_last_error(), "member 1: name contains a control character at byte 1");
  /* UTF-8 past ASCII is a name like any other. */
  assert_int_equal(gpupool_buffer_publish(b, "gr\xc3\xbc\xc3\x9f-\xe2\x82\xac-\xf0\x9f\x98\x80", NULL, NULL, NULL), 0);
  assert_int_equal(gpupool_buffer_get(c, "gr\xc3\xbc\xc3\x9f-\xe2\x82\xac-\xf0\x9f\x98\x80", 0, 0, 0, NULL, &got, NULL), 0);
  assert_int_equal(gpupool_buffer_release(got, NULL), 0);
  assert_int_equal(gpupool_buffer_release(b, NULL), 0);
  gpupool_client_disconnect(c);
}

/* Connect as name; the daemon must take the Hello and answer a request. */
static void connect_as(const char *name) {
  gpupool_client *c;
  gpupool_daemon_stats ds;
  assert_int_equal(gpupool_client_connect(D.sock, name, GPUPOOL_TIMEOUT_DEFAULT, &c), 0);
  assert_int_equal(gpupool_client_stats(c, &ds, NULL, 0, NULL), 0);
  gpupool_client_disconnect(c);
}

/* The client's own name is shown in logs only: bytes that are not UTF-8, and a character
 * cut by the library's length limit, must not make the daemon refuse the Hello. */
static void test_client_name(void **state) {
  char name[1024];
  (void)state;
  connect_as("latin1-\xe9t\xe9");
  /* Two-byte characters from an even offset and an odd one: whatever the limit, one of the
   * two copies cuts a character in half. */
  for (size_t start = 0; start < 2; start++) {
    name[0] = 'x';
    for (size_t i = start; i + 2 < sizeof name; i += 2)
      memcpy(name + i, "\xc3\xa9", 2);
    name[sizeof name - 1] = '\0';
    connect_as(name);
  }
}

int main(void) {
  return TS_RUN_TESTS(setup, th_teardown, test_local_refusals, test_client_name);
}
