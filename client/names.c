/*
 * libgpupool-client, names.c: The names this client published and has not unpublished (a
 * restart of the daemon reports them lost: see reconnect in connect.c), and the scrubbing of a
 * client name for the wire. Below buffers.c, bundles.c, files.c and pending.c, which note what
 * they publish, and connect.c, which reads the list; it calls nothing of the client.
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* The daemon refuses a Hello whose client name is not UTF-8 (every string on the wire must
 * be), and the name is only shown in logs: rather than fail the connect, bytes that are not
 * UTF-8 become '?', a character cut by the copy's length limit included. */
void gpupool__utf8_scrub(char *s) {
  size_t bad;
  while (gpupool__wire_utf8_check((const uint8_t *)s, strlen(s), &bad) != 0)
    s[bad] = '?';
}

void gpupool__note_published(gpupool_client *c, const char *name) {
  char *dup;
  if (c->npublished == c->cappublished) {
    size_t ncap = c->cappublished ? c->cappublished * 2 : 8;
    char **n = realloc(c->published, ncap * sizeof *n);
    if (!n)
      return;
    c->published = n;
    c->cappublished = ncap;
  }
  if ((dup = strdup(name)))
    c->published[c->npublished++] = dup;
}

void gpupool__note_unpublished(gpupool_client *c, const char *name) {
  for (size_t i = 0; i < c->npublished; i++)
    if (!strcmp(c->published[i], name)) {
      free(c->published[i]);
      c->published[i] = c->published[--c->npublished];
      return;
    }
}
