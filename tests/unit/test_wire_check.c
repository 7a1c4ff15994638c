/*
 * Unit tests of the check frames pass before protobuf-c unpacks them (common/wire_check.c):
 * strict UTF-8, the unknown-field budget counted over nested messages, strings with a NUL
 * named down to their field, the seq of a refused request, and malformed encodings told
 * apart from refusals.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "../support/run_tests.h"

#include "errors.h"
#include "wire.h"

static int utf8(const char *s, size_t n, size_t *bad) {
  *bad = SIZE_MAX;
  return gpupool__wire_utf8_check((const uint8_t *)s, n, bad);
}

static void test_utf8(void **state) {
  size_t bad;
  (void)state;
  assert_int_equal(utf8("", 0, &bad), 0);
  assert_int_equal(utf8("plain", 5, &bad), 0);
  assert_int_equal(utf8("\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80\xf4\x8f\xbf\xbf", 13, &bad), 0);
  assert_int_equal(utf8("a\0b", 3, &bad), GPUPOOL__WIRE_UTF8_NUL);
  assert_int_equal(bad, 1);
  assert_int_equal(utf8("ab\xc3", 3, &bad), GPUPOOL__WIRE_UTF8_INVALID); /* cut short */
  assert_int_equal(bad, 2);
  assert_int_equal(utf8("\x80", 1, &bad), GPUPOOL__WIRE_UTF8_INVALID); /* lone continuation */
  assert_int_equal(utf8("\xc0\xaf", 2, &bad), GPUPOOL__WIRE_UTF8_INVALID); /* overlong '/' */
  assert_int_equal(utf8("\xe0\x80\xaf", 3, &bad), GPUPOOL__WIRE_UTF8_INVALID);
  assert_int_equal(utf8("\xed\xa0\x80", 3, &bad), GPUPOOL__WIRE_UTF8_INVALID); /* surrogate */
  assert_int_equal(utf8("\xf4\x90\x80\x80", 4, &bad), GPUPOOL__WIRE_UTF8_INVALID); /* > U+10FFFF */
  assert_int_equal(utf8("\xc3\x28", 2, &bad), GPUPOOL__WIRE_UTF8_INVALID);
  assert_int_equal(bad, 0);
}

/* A packed Request (no frame header) with extra bytes appended. */
static size_t packed(const gpupool__req *r, uint8_t *out, size_t cap, const void *extra, size_t n) {
  size_t len = gpupool__wire__request__get_packed_size(r);
  assert_true(len + n <= cap);
  gpupool__wire__request__pack(r, out);
  if (n)
    memcpy(out + len, extra, n);
  return len + n;
}

/* Writes v as a varint at out (when not NULL); returns its length. */
static size_t varint(uint8_t *out, size_t v) {
  size_t n = 0;
  do {
    if (out)
      out[n] = (uint8_t)((v & 0x7f) | (v > 0x7f ? 0x80 : 0));
    n++;
    v >>= 7;
  } while (v);
  return n;
}

static int check(const uint8_t *b, size_t n, gpupool__wire_verdict *v) {
  return gpupool__wire_validate(&gpupool__wire__request__descriptor, b, n, v);
}

static void test_unknown_budget(void **state) {
  gpupool__req r = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__Publish p = GPUPOOL__WIRE__PUBLISH__INIT;
  Gpupool__Wire__TensorMeta t = GPUPOOL__WIRE__TENSOR_META__INIT;
  static uint8_t buf[4096], unknown[3 * 100];
  gpupool__wire_verdict v;
  size_t n;
  (void)state;
  for (int i = 0; i < 100; i++)
    memcpy(unknown + 3 * i, "\xc0\x3e\x01", 3);
  r.seq = 42;
  r.body_case = GPUPOOL__WIRE__REQUEST__BODY_PUBLISH;
  r.publish = &p;
  p.name = "w";
  p.tensor = &t;
  t.present = 1;
  n = packed(&r, buf, sizeof buf, unknown, 3 * 64);
  assert_int_equal(check(buf, n, &v), 0);
  assert_int_equal(v.seq, 42);
  n = packed(&r, buf, sizeof buf, unknown, 3 * 65);
  assert_int_equal(check(buf, n, &v), GPUPOOL_EPROTO);
  assert_false(v.malformed);
  assert_int_equal(v.seq, 42); /* the refusal can answer the request */
  assert_non_null(strstr(gpupool__errmsg(), "more than 64 fields"));
  /* Unknown fields inside a nested message count towards the same budget: 60 in the
   * TensorMeta (a 180-byte field 1000 block wrapped as Publish.tensor) and 5 at the top. */
  {
    uint8_t meta[4 + 3 * 60], all[sizeof meta + 3 * 5 + 64];
    size_t m = 0, k = 0;
    gpupool__req r2 = GPUPOOL__WIRE__REQUEST__INIT;
    Gpupool__Wire__Publish p2 = GPUPOOL__WIRE__PUBLISH__INIT;
    r2.seq = 7;
    r2.body_case = GPUPOOL__WIRE__REQUEST__BODY_PUBLISH;
    r2.publish = &p2;
    p2.name = "w";
    meta[m++] = 0x08; /* TensorMeta.present = 1 */
    meta[m++] = 0x01;
    memcpy(meta + m, unknown, 3 * 60);
    m += 3 * 60;
    /* Request.publish (field 16) again, carrying Publish.tensor (field 3) = meta: protobuf
     * merges a repeated message field, and protobuf-c does too. */
    all[k++] = 0x82; /* key 16 << 3 | 2 */
    all[k++] = 0x01;
    k += varint(all + k, 1 + varint(NULL, m) + m); /* Publish body: tensor key, length, meta */
    all[k++] = 0x1a;                                /* key 3 << 3 | 2 */
    k += varint(all + k, m);
    memcpy(all + k, meta, m);
    k += m;
    memcpy(all + k, unknown, 3 * 4);
    n = packed(&r2, buf, sizeof buf, all, k + 3 * 4);
    assert_int_equal(check(buf, n, &v), 0); /* 64 */
    {
      gpupool__req *u = gpupool__wire__request__unpack(NULL, n, buf);
      assert_non_null(u);
      assert_non_null(u->publish->tensor);
      assert_int_equal(u->publish->tensor->base.n_unknown_fields, 60);
      assert_int_equal(u->base.n_unknown_fields, 4);
      gpupool__wire__request__free_unpacked(u, NULL);
    }
    memcpy(all + k, unknown, 3 * 5);
    n = packed(&r2, buf, sizeof buf, all, k + 3 * 5);
    assert_int_equal(check(buf, n, &v), GPUPOOL_EPROTO); /* 65 */
  }
}

static void test_strings_named(void **state) {
  gpupool__req r = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__AllocateBundle ab = GPUPOOL__WIRE__ALLOCATE_BUNDLE__INIT;
  Gpupool__Wire__MemberSpec s0 = GPUPOOL__WIRE__MEMBER_SPEC__INIT, s1 = GPUPOOL__WIRE__MEMBER_SPEC__INIT;
  Gpupool__Wire__MemberSpec *sp[2] = {&s0, &s1};
  uint8_t buf[512], *at;
  gpupool__wire_verdict v;
  size_t n;
  (void)state;
  r.seq = 9;
  r.body_case = GPUPOOL__WIRE__REQUEST__BODY_ALLOCATE_BUNDLE;
  r.allocate_bundle = &ab;
  ab.n_members = 2;
  ab.members = sp;
  s0.name = "ok";
  s0.size = 1;
  s1.name = "nul#tail";
  s1.size = 1;
  n = packed(&r, buf, sizeof buf, NULL, 0);
  assert_int_equal(check(buf, n, &v), 0);
  at = memchr(buf, '#', n);
  assert_non_null(at);
  *at = '\0';
  assert_int_equal(check(buf, n, &v), GPUPOOL_EINVAL);
  assert_false(v.malformed);
  assert_int_equal(v.seq, 9);
  assert_string_equal(gpupool__errmsg(), "Request.allocate_bundle.members.name holds a NUL byte at byte 3 of 8; "
                                         "strings (names above all) are UTF-8 without NUL, and a C string would "
                                         "end there");
  *at = (char)0xff;
  assert_int_equal(check(buf, n, &v), GPUPOOL_EINVAL);
  assert_non_null(strstr(gpupool__errmsg(), "Request.allocate_bundle.members.name is not valid UTF-8 (at byte 3"));
}

static void test_malformed(void **state) {
  static const struct {
    const char *what;
    const char *bytes;
    size_t n;
  } bad[] = {
      {"truncated varint", "\x08\xff", 2},
      {"eleven-byte varint", "\x08\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", 12},
      {"field number 0", "\x00\x01", 2},
      {"length past the end", "\x9a\x01\x05\x00", 4},
      {"seq as a length-delimited field", "\x0a\x01\x00", 3},
      {"a message as a varint", "\x98\x01\x01", 3},
      {"a group", "\x0b\x0c", 2},
      {"truncated fixed64 of an unknown field", "\xc1\x3e\x00\x00", 4},
      {"packed ids ending inside a varint", "\x12\x02\x01\x80", 4},
  };
  gpupool__wire_verdict v;
  (void)state;
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    int rc = check((const uint8_t *)bad[i].bytes, bad[i].n, &v);
    if (rc != GPUPOOL_EPROTO || !v.malformed)
      fail_msg("%s: got %d, malformed %d", bad[i].what, rc, v.malformed);
    /* protobuf-c refuses them too: the check never turns away what it would take. */
    assert_null(gpupool__wire__request__unpack(NULL, bad[i].n, (const uint8_t *)bad[i].bytes));
  }
  assert_int_equal(check(NULL, 0, &v), 0); /* an empty Request is a valid encoding */
  assert_int_equal(check((const uint8_t *)"\x12\x03\x01\x80\x01", 5, &v), 0); /* packed ids */
}

/* The daemon checks a name's UTF-8 once, in the frame validator, and then only its length and
 * control characters (gpupool__wire_check_utf8_name): every other refusal reads the same as
 * the full check's, which the client library runs before sending. */
static void test_name_after_validation(void **state) {
  char longname[GPUPOOL_NAME_MAX + 2], full[GPUPOOL__ERRMSG_MAX];
  const char *names[] = {"", "a\tb", "tab\x7f", longname, "w", "caf\xc3\xa9", "group:ml/w"};
  (void)state;
  memset(longname, 'n', sizeof longname - 1);
  longname[sizeof longname - 1] = 0;
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
    int rc = gpupool__wire_check_name(names[i]);
    snprintf(full, sizeof full, "%s", rc ? gpupool__errmsg() : "");
    gpupool__err_clear();
    assert_int_equal(gpupool__wire_check_utf8_name(names[i]), rc);
    assert_string_equal(rc ? gpupool__errmsg() : "", full);
    assert_int_equal(rc ? i < 4 : i >= 4, 1);
  }
  /* Bytes that are no UTF-8 are the validator's to refuse; the full check still refuses them. */
  assert_int_equal(gpupool__wire_check_name("bad\xff"), GPUPOOL_ENAME);
  assert_string_equal(gpupool__errmsg(), "name is not valid UTF-8 (at byte 3); names are UTF-8 text");
}

int main(void) {
  return TS_RUN_TESTS(NULL, NULL, test_utf8,
                      test_unknown_budget,
                      test_strings_named,
                      test_malformed,
                      test_name_after_validation);
}
