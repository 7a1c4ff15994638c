/*
 * The request table (common/requests.h) against the proto: every case of Request's `body`
 * oneof has a row with the field's name and its message's name, and every row is such a case.
 * A request added to the proto without its row fails here, instead of being dispatched as
 * "unknown request type" and counted in the metrics as "unknown".
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "../support/run_tests.h"

#include "requests.h"

static const ProtobufCMessageDescriptor *const req_desc = &gpupool__wire__request__descriptor;

static int is_body_case(const ProtobufCFieldDescriptor *f) {
  return (f->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) &&
         f->quantifier_offset == offsetof(Gpupool__Wire__Request, body_case);
}

static void test_every_case_has_a_row(void **state) {
  int ncases = 0;
  (void)state;
  for (unsigned i = 0; i < req_desc->n_fields; i++) {
    const ProtobufCFieldDescriptor *f = &req_desc->fields[i];
    int row;
    if (!is_body_case(f))
      continue;
    ncases++;
    row = gpupool__request_index((int)f->id);
    if (row < 0)
      fail_msg("Request.%s (field %u) has no row in GPUPOOL__REQUEST_MAP (common/requests.h)", f->name, f->id);
    assert_int_equal(gpupool__request_kinds[row].body_case, (int)f->id);
    assert_string_equal(gpupool__request_kinds[row].name, f->name);
    assert_string_equal(gpupool__request_name((int)f->id), f->name);
    assert_int_equal(f->type, PROTOBUF_C_TYPE_MESSAGE);
    assert_string_equal(gpupool__request_kinds[row].message,
                        ((const ProtobufCMessageDescriptor *)f->descriptor)->short_name);
  }
  assert_int_equal(ncases, GPUPOOL__NREQUESTS);
}

static void test_every_row_is_a_case(void **state) {
  (void)state;
  for (int i = 0; i < GPUPOOL__NREQUESTS; i++) {
    const gpupool__request_kind *k = &gpupool__request_kinds[i];
    const ProtobufCFieldDescriptor *f = protobuf_c_message_descriptor_get_field(req_desc, (unsigned)k->body_case);
    if (f == NULL || !is_body_case(f))
      fail_msg("row '%s' names field %d, which is not a case of Request.body", k->name, k->body_case);
    assert_int_equal(gpupool__request_index(k->body_case), i);
  }
}

/* No case, and a case a newer client may send: no row, named "unknown". */
static void test_unknown_cases(void **state) {
  (void)state;
  assert_int_equal(gpupool__request_index(GPUPOOL__WIRE__REQUEST__BODY__NOT_SET), -1);
  assert_int_equal(gpupool__request_index(9999), -1);
  assert_int_equal(gpupool__request_index(-1), -1);
  assert_string_equal(gpupool__request_name(9999), "unknown");
}

/* Only Hello may come first, and the operators' requests are exactly the Admin* ones and
 * Trim (it gives back every tenant's empty slabs). */
static void test_flags(void **state) {
  (void)state;
  for (int i = 0; i < GPUPOOL__NREQUESTS; i++) {
    const gpupool__request_kind *k = &gpupool__request_kinds[i];
    assert_int_equal(!(k->flags & GPUPOOL__REQ_NEEDS_HELLO), k->body_case == GPUPOOL__WIRE__REQUEST__BODY_HELLO);
    assert_int_equal(!!(k->flags & GPUPOOL__REQ_ADMIN),
                     strncmp(k->message, "Admin", 5) == 0 || k->body_case == GPUPOOL__WIRE__REQUEST__BODY_TRIM);
  }
}

int main(void) {
  return TS_RUN_TESTS(NULL, NULL, test_every_case_has_a_row,
                      test_every_row_is_a_case,
                      test_unknown_cases,
                      test_flags);
}
