/*
 * The check every frame passes before protobuf-c unpacks it: one linear walk of the
 * protobuf encoding, guided by the message descriptors (nested messages too), that
 * allocates nothing.
 *
 * Why: protobuf-c allocates and keeps every field it does not know, so a 1 MiB frame of
 * 349,000 one-byte unknown fields costs the daemon 349,000 mallocs and frees while every other
 * client waits; and it copies a string up to the first NUL it holds, so "nul\0tail" would be
 * published as "nul". This walk refuses a frame with more than GPUPOOL_WIRE_MAX_UNKNOWN_FIELDS
 * unknown fields (a newer peer may send a few fields this side does not know; it may not send
 * thousands), every string field that is not UTF-8 or holds a NUL, and bytes that are no
 * protobuf encoding at all (told apart in the verdict, since the stream's peer is then broken
 * rather than merely refused).
 *
 * It accepts nothing protobuf-c refuses: wire types must match the field's type as
 * protobuf-c requires, varints end within 10 bytes, tags and lengths within 5, lengths stay
 * inside their message, and packed repeated fields hold whole elements.
 */
#include <stdio.h>
#include <string.h>

#include "errors.h"
#include "wire.h"

/* Deeper than any message of the protocol nests: a guard, not a limit anyone meets. */
#define MAX_DEPTH 16

enum { WT_VARINT = 0, WT_64 = 1, WT_LEN = 2, WT_32 = 5 };

typedef struct {
  const ProtobufCMessageDescriptor *root;
  const char *path[MAX_DEPTH]; /* field names from the root down to the one being read */
  int depth;
  unsigned unknown;
  gpupool__wire_verdict *v;
} walk_state;

/* "Request.publish.name": where in the message a refusal was found. */
static void path_of(const walk_state *w, const char *leaf, char *out, size_t n) {
  size_t at = (size_t)snprintf(out, n, "%s", w->root->short_name);
  for (int i = 0; i < w->depth && at < n; i++)
    at += (size_t)snprintf(out + at, n - at, ".%s", w->path[i]);
  if (leaf && at < n)
    snprintf(out + at, n - at, ".%s", leaf);
}

static int malformed(walk_state *w, const char *leaf, const char *what) {
  char where[160];
  path_of(w, leaf, where, sizeof where);
  w->v->malformed = 1;
  return gpupool__err(GPUPOOL_EPROTO, "malformed %s (%s): not a valid gpupool %s", where, what,
                      w->root->short_name);
}

/* A varint of at most max bytes at *p (before end): 1 with *val and *p moved past it, else 0. */
static int read_varint(const uint8_t **p, const uint8_t *end, int max, uint64_t *val) {
  uint64_t v = 0;
  for (int i = 0; i < max && *p + i < end; i++) {
    v |= (uint64_t)((*p)[i] & 0x7f) << (7 * i);
    if (!((*p)[i] & 0x80)) {
      *p += i + 1;
      *val = v;
      return 1;
    }
  }
  return 0;
}

static int varint_type(ProtobufCType t) {
  switch (t) {
  case PROTOBUF_C_TYPE_INT32:
  case PROTOBUF_C_TYPE_SINT32:
  case PROTOBUF_C_TYPE_INT64:
  case PROTOBUF_C_TYPE_SINT64:
  case PROTOBUF_C_TYPE_UINT32:
  case PROTOBUF_C_TYPE_UINT64:
  case PROTOBUF_C_TYPE_BOOL:
  case PROTOBUF_C_TYPE_ENUM:
    return 1;
  default:
    return 0;
  }
}

/* Bytes of one element of a fixed-size type (4 or 8), 0 for the others. */
static size_t fixed_size(ProtobufCType t) {
  switch (t) {
  case PROTOBUF_C_TYPE_SFIXED32:
  case PROTOBUF_C_TYPE_FIXED32:
  case PROTOBUF_C_TYPE_FLOAT:
    return 4;
  case PROTOBUF_C_TYPE_SFIXED64:
  case PROTOBUF_C_TYPE_FIXED64:
  case PROTOBUF_C_TYPE_DOUBLE:
    return 8;
  default:
    return 0;
  }
}

int gpupool__wire_utf8_check(const uint8_t *s, size_t n, size_t *bad) {
  size_t i = 0;
  while (i < n) {
    uint8_t c = s[i];
    size_t k;
    uint32_t cp, min;
    if (c == 0) {
      *bad = i;
      return GPUPOOL__WIRE_UTF8_NUL;
    }
    if (c < 0x80) {
      i++;
      continue;
    }
    if (c >= 0xc2 && c <= 0xdf) {
      k = 1, cp = c & 0x1f, min = 0x80;
    } else if (c >= 0xe0 && c <= 0xef) {
      k = 2, cp = c & 0x0f, min = 0x800;
    } else if (c >= 0xf0 && c <= 0xf4) {
      k = 3, cp = c & 0x07, min = 0x10000;
    } else {
      *bad = i;
      return GPUPOOL__WIRE_UTF8_INVALID;
    }
    if (n - i <= k) {
      *bad = i;
      return GPUPOOL__WIRE_UTF8_INVALID;
    }
    for (size_t j = 1; j <= k; j++) {
      if ((s[i + j] & 0xc0) != 0x80) {
        *bad = i;
        return GPUPOOL__WIRE_UTF8_INVALID;
      }
      cp = cp << 6 | (s[i + j] & 0x3f);
    }
    /* Overlong forms, UTF-16 surrogates and code points past U+10FFFF are not UTF-8. */
    if (cp < min || (cp >= 0xd800 && cp <= 0xdfff) || cp > 0x10ffff) {
      *bad = i;
      return GPUPOOL__WIRE_UTF8_INVALID;
    }
    i += k + 1;
  }
  return 0;
}

static int check_string(walk_state *w, const ProtobufCFieldDescriptor *f, const uint8_t *s, size_t n) {
  char where[160];
  size_t bad = 0;
  int rc = gpupool__wire_utf8_check(s, n, &bad);
  if (rc == 0)
    return 0;
  path_of(w, f->name, where, sizeof where);
  if (rc == GPUPOOL__WIRE_UTF8_NUL)
    return gpupool__err(GPUPOOL_EINVAL, "%s holds a NUL byte at byte %zu of %zu; strings (names above all) are "
                        "UTF-8 without NUL, and a C string would end there", where, bad, n);
  return gpupool__err(GPUPOOL_EINVAL, "%s is not valid UTF-8 (at byte %zu of %zu); send strings as UTF-8", where,
                      bad, n);
}

/* A packed repeated scalar: whole elements only. */
static int check_packed(walk_state *w, const ProtobufCFieldDescriptor *f, const uint8_t *p, const uint8_t *end) {
  size_t sz = fixed_size(f->type);
  if (sz)
    return (size_t)(end - p) % sz == 0 ? 0 : malformed(w, f->name, "packed field of partial elements");
  while (p < end) {
    uint64_t v;
    if (!read_varint(&p, end, 10, &v))
      return malformed(w, f->name, "packed field ends inside a varint");
  }
  return 0;
}

static int walk(walk_state *w, const ProtobufCMessageDescriptor *d, const uint8_t *p, const uint8_t *end) {
  while (p < end) {
    const ProtobufCFieldDescriptor *f;
    uint64_t key, val;
    unsigned wt;
    int rc;

    if (!read_varint(&p, end, 5, &key) || key > UINT32_MAX || (key >> 3) == 0)
      return malformed(w, NULL, "bad field key");
    wt = (unsigned)(key & 7);
    f = protobuf_c_message_descriptor_get_field(d, (unsigned)(key >> 3));
    if (!f && ++w->unknown > GPUPOOL_WIRE_MAX_UNKNOWN_FIELDS) {
      char where[160];
      path_of(w, NULL, where, sizeof where);
      return gpupool__err(GPUPOOL_EPROTO, "%s carries more than %d fields this side does not know (field %u "
                          "among them); a peer of a newer release sends a few at most: upgrade this side, or "
                          "stop sending them", where, GPUPOOL_WIRE_MAX_UNKNOWN_FIELDS, (unsigned)(key >> 3));
    }
    switch (wt) {
    case WT_VARINT:
      if (!read_varint(&p, end, 10, &val))
        return malformed(w, f ? f->name : NULL, "unterminated varint");
      if (f && !varint_type(f->type))
        return malformed(w, f->name, "varint for a field that is not one");
      if (f && w->depth == 0 && f->id == 1)
        w->v->seq = val;
      break;
    case WT_64:
    case WT_32: {
      size_t sz = wt == WT_64 ? 8 : 4;
      if ((size_t)(end - p) < sz)
        return malformed(w, f ? f->name : NULL, "truncated fixed-size field");
      if (f && fixed_size(f->type) != sz)
        return malformed(w, f->name, "fixed-size value for a field of another type");
      p += sz;
      break;
    }
    case WT_LEN: {
      const uint8_t *body;
      if (!read_varint(&p, end, 5, &val) || val > (uint64_t)(end - p))
        return malformed(w, f ? f->name : NULL, "length past the end of its message");
      body = p;
      p += val;
      if (!f || f->type == PROTOBUF_C_TYPE_BYTES)
        break;
      if (f->type == PROTOBUF_C_TYPE_STRING) {
        if ((rc = check_string(w, f, body, (size_t)val)) != 0)
          return rc;
      } else if (f->type == PROTOBUF_C_TYPE_MESSAGE) {
        if (w->depth >= MAX_DEPTH)
          return malformed(w, f->name, "messages nested too deep");
        w->path[w->depth++] = f->name;
        rc = walk(w, f->descriptor, body, p);
        w->depth--;
        if (rc != 0)
          return rc;
      } else if (f->label == PROTOBUF_C_LABEL_REPEATED) {
        if ((rc = check_packed(w, f, body, p)) != 0)
          return rc;
      } else {
        return malformed(w, f->name, "length-delimited value for a scalar field");
      }
      break;
    }
    default:
      return malformed(w, f ? f->name : NULL, "groups and unknown wire types are not used");
    }
  }
  return 0;
}

int gpupool__wire_validate(const ProtobufCMessageDescriptor *d, const uint8_t *buf, size_t len,
                           gpupool__wire_verdict *v) {
  walk_state w;
  memset(v, 0, sizeof *v);
  memset(&w, 0, sizeof w);
  w.root = d;
  w.v = v;
  if (len == 0)
    return 0;
  if (buf == NULL)
    return malformed(&w, NULL, "no bytes");
  return walk(&w, d, buf, buf + len);
}
