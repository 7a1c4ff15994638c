/*
 * Unit tests of the error-message buffer: a message may quote the previous one
 * (gpupool__err(..., "%s", gpupool__errmsg())), as callers do to add the context of a
 * failure (which member, which file); the result is the exact text, with no repetition.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "../support/run_tests.h"

#include "errors.h"
#include "wire.h"

static void test_quotes_previous(void **state) {
  (void)state;
  assert_int_equal(gpupool__err(GPUPOOL_EMETA, "tensor has %d dimensions", 9), GPUPOOL_EMETA);
  assert_int_equal(gpupool__err(GPUPOOL_ENAME, "member %d: %s", 0, gpupool__errmsg()), GPUPOOL_ENAME);
  assert_string_equal(gpupool__errmsg(), "member 0: tensor has 9 dimensions");
  /* Twice over, and with the previous message after other text. */
  gpupool__err(GPUPOOL_EINVAL, "bundle 'w': %s (split it)", gpupool__errmsg());
  assert_string_equal(gpupool__errmsg(), "bundle 'w': member 0: tensor has 9 dimensions (split it)");
  gpupool__err_clear();
  assert_string_equal(gpupool__errmsg(), "");
}

/* What the name checks say when a caller adds the member's index, as both sides do. */
static void test_member_name_message(void **state) {
  (void)state;
  assert_int_equal(gpupool__wire_check_name("a\x01"), GPUPOOL_ENAME);
  gpupool__err(GPUPOOL_ENAME, "member %d: %s", 3, gpupool__errmsg());
  assert_string_equal(gpupool__errmsg(), "member 3: name contains a control character at byte 1");
}

/* A message that fills the buffer is cut at its end, still terminated. */
static void test_truncates(void **state) {
  char big[2 * GPUPOOL__ERRMSG_MAX];
  (void)state;
  memset(big, 'x', sizeof big - 1);
  big[sizeof big - 1] = '\0';
  gpupool__err(GPUPOOL_EINVAL, "%s", big);
  assert_int_equal(strlen(gpupool__errmsg()), GPUPOOL__ERRMSG_MAX - 1);
  gpupool__err(GPUPOOL_EINVAL, "y%s", gpupool__errmsg());
  assert_int_equal(strlen(gpupool__errmsg()), GPUPOOL__ERRMSG_MAX - 1);
  assert_int_equal(gpupool__errmsg()[0], 'y');
  assert_int_equal(gpupool__errmsg()[1], 'x');
}

/* An error taken as a value survives a later failure that records its own message (a
 * cleanup), and only reporting it makes it the thread's last error again. */
static void test_error_value_outlives_cleanup(void **state) {
  gpupool__error e = {.code = 0};
  (void)state;
  assert_int_equal(gpupool__error_report(&e, 0), 0);
  assert_int_equal(gpupool__error_report(&e, GPUPOOL_EIO), GPUPOOL_EIO); /* nothing taken: rc as is */
  gpupool__err(GPUPOOL_EBACKEND, "mapping failed");
  assert_int_equal(gpupool__error_take(&e, GPUPOOL_EBACKEND), GPUPOOL_EBACKEND);
  gpupool__err(GPUPOOL_EIO, "release after it failed too");
  assert_string_equal(gpupool_last_error(), "release after it failed too");
  assert_int_equal(gpupool__error_report(&e, GPUPOOL_EIO), GPUPOOL_EBACKEND);
  assert_string_equal(gpupool_last_error(), "mapping failed");
  assert_int_equal(gpupool__error_set(&e, GPUPOOL_EPROTO, "buffer %d of the bundle: %s", 2, "x"), GPUPOOL_EPROTO);
  gpupool__err_clear();
  assert_int_equal(gpupool__error_report(&e, 0), GPUPOOL_EPROTO);
  assert_string_equal(gpupool_last_error(), "buffer 2 of the bundle: x");
}

/* A step's context put before the message it took reads as the wrapping gpupool__err() above
 * (test_member_name_message, test_truncates) did: the same text, cut at the same end. */
static void test_error_prefix(void **state) {
  char big[2 * GPUPOOL__ERRMSG_MAX];
  gpupool__error e;
  (void)state;
  assert_int_equal(gpupool__wire_check_name("a\x01"), GPUPOOL_ENAME);
  gpupool__error_take(&e, GPUPOOL_ENAME);
  assert_int_equal(gpupool__error_prefix(&e, "member %d: ", 3), GPUPOOL_ENAME);
  assert_string_equal(e.msg, "member 3: name contains a control character at byte 1");
  gpupool__err(GPUPOOL_EIO, "a cleanup failed after it");
  assert_int_equal(gpupool__error_report(&e, GPUPOOL_EIO), GPUPOOL_ENAME);
  assert_string_equal(gpupool_last_error(), "member 3: name contains a control character at byte 1");
  memset(big, 'x', sizeof big - 1);
  big[sizeof big - 1] = '\0';
  gpupool__error_set(&e, GPUPOOL_EINVAL, "%s", big);
  gpupool__error_prefix(&e, "y");
  assert_int_equal(strlen(e.msg), GPUPOOL__ERRMSG_MAX - 1);
  assert_int_equal(e.msg[0], 'y');
  assert_int_equal(e.msg[1], 'x');
  gpupool__error_set(&e, GPUPOOL_EINVAL, "tail");
  gpupool__error_prefix(&e, "%s", big); /* a prefix that fills the message leaves no room */
  assert_int_equal(strlen(e.msg), GPUPOOL__ERRMSG_MAX - 1);
  assert_int_equal(e.msg[GPUPOOL__ERRMSG_MAX - 2], 'x');
}

int main(void) {
  return TS_RUN_TESTS(NULL, NULL, test_quotes_previous,
                      test_member_name_message,
                      test_truncates,
                      test_error_value_outlives_cleanup,
                      test_error_prefix);
}
