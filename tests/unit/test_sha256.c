/*
 * SHA-256 against the FIPS 180-4 examples and HMAC-SHA256 against RFC 4231's test cases (the
 * peers authenticate with it), fed whole and in pieces; the constant-time compare.
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

#include "sha256.h"

static void hex(const uint8_t *d, size_t n, char *out) {
  for (size_t i = 0; i < n; i++)
    sprintf(out + 2 * i, "%02x", d[i]);
}

static void unhex(const char *s, uint8_t *out, size_t *n) {
  size_t len = strlen(s) / 2;
  for (size_t i = 0; i < len; i++) {
    unsigned v;
    sscanf(s + 2 * i, "%2x", &v);
    out[i] = (uint8_t)v;
  }
  *n = len;
}

static void check_sha(const void *data, size_t len, const char *want) {
  uint8_t d[32];
  char got[65];
  gpupool__sha256_digest(data, len, d);
  hex(d, 32, got);
  assert_string_equal(got, want);
  /* The same bytes fed one at a time: the block boundaries fall everywhere. */
  gpupool__sha256 s;
  gpupool__sha256_init(&s);
  for (size_t i = 0; i < len; i++)
    gpupool__sha256_update(&s, (const uint8_t *)data + i, 1);
  gpupool__sha256_final(&s, d);
  hex(d, 32, got);
  assert_string_equal(got, want);
}

static void test_fips(void **state) {
  char *million;
  uint8_t d[32];
  char got[65];
  gpupool__sha256 s;
  (void)state;
  check_sha("abc", 3, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  check_sha("", 0, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  check_sha("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq", 56,
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  check_sha("abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmnoijklmnopjklmnopqklmnopqrlmnopqrs"
            "mnopqrstnopqrstu", 112, "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1");
  million = malloc(1000000);
  assert_non_null(million);
  memset(million, 'a', 1000000);
  gpupool__sha256_init(&s);
  for (int i = 0; i < 10; i++)
    gpupool__sha256_update(&s, million + i * 100000, 100000);
  gpupool__sha256_final(&s, d);
  hex(d, 32, got);
  assert_string_equal(got, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
  free(million);
}

/* RFC 4231 test cases 1-4, 6 and 7 (case 5 is a truncated output); 6 and 7 key with 131
 * bytes of 0xaa, longer than a block. */
#define AA10 "aaaaaaaaaaaaaaaaaaaa"
#define KEY131 AA10 AA10 AA10 AA10 AA10 AA10 AA10 AA10 AA10 AA10 AA10 AA10 AA10 "aa"
static void test_rfc4231(void **state) {
  static const struct {
    const char *key, *data, *mac;
  } cases[] = {
      {"0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b", "4869205468657265",
       "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"},
      {"4a656665", "7768617420646f2079612077616e7420666f72206e6f7468696e673f",
       "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"},
      {"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
       "dddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddd",
       "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe"},
      {"0102030405060708090a0b0c0d0e0f10111213141516171819",
       "cdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcd",
       "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b"},
      {KEY131,
       "54657374205573696e67204c6172676572205468616e20426c6f636b2d53697a65204b6579202d2048617368204b6579204669727374",
       "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"},
      {KEY131,
       "5468697320697320612074657374207573696e672061206c6172676572207468616e20626c6f636b2d73697a65206b657920616e6420"
       "61206c6172676572207468616e20626c6f636b2d73697a6520646174612e20546865206b6579206e6565647320746f20626520686173"
       "686564206265666f7265206265696e6720757365642062792074686520484d414320616c676f726974686d2e",
       "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2"},
  };
  static uint8_t key[256], data[256];
  uint8_t mac[32];
  char got[65];
  (void)state;
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    size_t kl, dl;
    unhex(cases[i].key, key, &kl);
    unhex(cases[i].data, data, &dl);
    const void *parts[] = {data};
    size_t lens[] = {dl};
    gpupool__hmac_sha256(key, kl, parts, lens, 1, mac);
    hex(mac, 32, got);
    if (strcmp(got, cases[i].mac))
      fail_msg("RFC 4231 case %zu: %s, want %s", i, got, cases[i].mac);
    /* The message in two parts is the same message. */
    const void *two[] = {data, data + dl / 3};
    size_t tl[] = {dl / 3, dl - dl / 3};
    gpupool__hmac_sha256(key, kl, two, tl, 2, mac);
    hex(mac, 32, got);
    assert_string_equal(got, cases[i].mac);
  }
}

static void test_ct_equal(void **state) {
  uint8_t a[32] = {0}, b[32] = {0};
  (void)state;
  assert_true(gpupool__ct_equal(a, b, 32));
  b[31] = 1;
  assert_false(gpupool__ct_equal(a, b, 32));
  b[31] = 0;
  b[0] = 0x80;
  assert_false(gpupool__ct_equal(a, b, 32));
  assert_true(gpupool__ct_equal(a, b, 0));
}

int main(void) {
  return TS_RUN_TESTS(NULL, NULL, test_fips, test_rfc4231, test_ct_equal);
}
