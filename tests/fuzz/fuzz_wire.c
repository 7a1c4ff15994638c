/*
 * Fuzz target: the check that runs before protobuf-c unpacks a frame
 * (gpupool__wire_validate, common/wire_check.c).
 *
 * Input: one byte choosing the message (even: Request, as the daemon checks it; odd: Reply),
 * then the packed message. Whatever the validator accepts, protobuf-c must unpack, with no
 * more than GPUPOOL_WIRE_MAX_UNKNOWN_FIELDS unknown fields over all its messages and every
 * string UTF-8 without NUL, and a malformed verdict always comes with a refusal. The
 * validator itself must read nothing outside its input (ASan) whatever it is given.
 */
#include <string.h>

#include "errors.h"
#include "fuzz.h"
#include "wire.h"

/* Walks an unpacked message: counts unknown fields, checks every string that is set. */
static void check_message(const ProtobufCMessage *m, size_t *unknown) {
  const ProtobufCMessageDescriptor *d = m->descriptor;
  *unknown += m->n_unknown_fields;
  for (unsigned i = 0; i < d->n_fields; i++) {
    const ProtobufCFieldDescriptor *f = &d->fields[i];
    const char *base = (const char *)m;
    const void *const *items;
    size_t n = 1;
    if (f->type != PROTOBUF_C_TYPE_STRING && f->type != PROTOBUF_C_TYPE_MESSAGE)
      continue;
    if ((f->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) && *(const uint32_t *)(base + f->quantifier_offset) != f->id)
      continue;
    if (f->label == PROTOBUF_C_LABEL_REPEATED) {
      n = *(const size_t *)(base + f->quantifier_offset);
      items = *(const void *const *const *)(base + f->offset);
    } else {
      items = (const void *const *)(base + f->offset);
    }
    for (size_t k = 0; k < n; k++) {
      size_t bad;
      if (!items[k])
        continue;
      if (f->type == PROTOBUF_C_TYPE_MESSAGE)
        check_message(items[k], unknown);
      else if (gpupool__wire_utf8_check(items[k], strlen(items[k]), &bad) != 0)
        fuzz_fail("%s.%s passed the check but is not UTF-8", d->short_name, f->name);
    }
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  const ProtobufCMessageDescriptor *d;
  gpupool__wire_verdict v;
  ProtobufCMessage *m;
  size_t unknown = 0;
  int rc;
  if (size < 1)
    return 0;
  d = (data[0] & 1) ? &gpupool__wire__reply__descriptor : &gpupool__wire__request__descriptor;
  rc = gpupool__wire_validate(d, data + 1, size - 1, &v);
  if (rc == 0 && v.malformed)
    fuzz_fail("a malformed verdict without a refusal");
  if (rc != 0 && !*gpupool__errmsg())
    fuzz_fail("a refusal (%d) without a message", rc);
  if (rc != 0)
    return 0;
  m = protobuf_c_message_unpack(d, NULL, size - 1, data + 1);
  if (!m)
    fuzz_fail("the check accepted a %s that protobuf-c refuses", d->short_name);
  check_message(m, &unknown);
  if (unknown > GPUPOOL_WIRE_MAX_UNKNOWN_FIELDS)
    fuzz_fail("the check accepted %zu unknown fields", unknown);
  protobuf_c_message_free_unpacked(m, NULL);
  return 0;
}
